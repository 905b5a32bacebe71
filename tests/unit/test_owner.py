"""Runs left RUNNING by a killed process: every run we create or attach to names its owning process
(`rlhf.owner`, rlhf_core/infra/owner.py); a later process of the same machine marks the runs of a gone
owner KILLED (the pipeline at its start, `rlhf prune --yes`) and leaves every other run alone.

The killed processes here are real: a child creates (or attaches to) a run through the project's
own code and is SIGKILLed before it can close it."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from rlhf_core.infra.owner import OWNER_TAG, is_gone, machine, owner_tag

REPO = Path(__file__).resolve().parents[2]


def test_this_process_is_alive_and_a_finished_one_is_gone():
    assert not is_gone(owner_tag())
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    tag = owner_tag(child.pid)
    assert tag is not None and tag.startswith(machine() + "|") and not is_gone(tag)
    child.communicate(b"")
    assert is_gone(tag)


def test_a_reused_pid_another_machine_and_unreadable_values_are_not_taken_for_the_owner():
    where, pid, started = owner_tag().rsplit("|", 2)
    assert is_gone(f"{where}|{pid}|{int(started) + 1}"), "a live PID that started at another time is another process"
    assert not is_gone(f"other-host/boot/ns|{pid}|{int(started) + 1}"), "another machine's process is never judged"
    for value in (None, "", "garbage", f"{where}|not-a-pid|1"):
        assert not is_gone(value)


@pytest.fixture
def store(tmp_path, monkeypatch):
    import mlflow

    before = mlflow.get_tracking_uri()
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    from rlhf_core.infra.mlflow_ops import ensure_experiment

    experiment = f"owner-{uuid.uuid4().hex[:8]}"
    yield {"uri": uri, "experiment": experiment, "experiment_id": ensure_experiment(experiment)}
    mlflow.set_tracking_uri(before)


def _killed_child(code: str, uri: str, **env) -> str:
    """Run `code` in a child (it prints a run id, then is SIGKILLed by itself); the run id."""
    proc = subprocess.run([sys.executable, "-c", code + "\nimport os, signal, sys; sys.stdout.flush(); "
                           "os.kill(os.getpid(), signal.SIGKILL)"], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "MLFLOW_TRACKING_URI": uri, "PYTHONPATH": str(REPO), **env}, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    return proc.stdout.strip().splitlines()[-1]


def test_the_runs_of_killed_owners_are_closed_and_no_other(store):
    from mlflow import MlflowClient

    from orchestration import lineage

    client = MlflowClient(store["uri"])
    # A pipeline run created by a flow process that was then killed.
    created = _killed_child(
        "from orchestration.lineage import start_pipeline_run\n"
        f"print(start_pipeline_run({store['experiment']!r}, 'p', {{}}, {{}}))", store["uri"])
    # A stage run created by a live process (this one) and attached to by a job driver that was killed.
    attached = lineage.start_stage_run(created, "sft", "sft", {})
    assert not is_gone(client.get_run(attached).data.tags[OWNER_TAG])
    _killed_child("from rlhf_core.infra.tracking import Tracker\n"
                  "t = Tracker(True, 'ignored', None, None)\nprint(t.run_id)", store["uri"], MLFLOW_RUN_ID=attached)
    # Left alone: a RUNNING run of this live process, another machine's, and one with no owner.
    live = lineage.start_stage_run(created, "rm", "rm", {})
    where, pid, started = owner_tag().rsplit("|", 2)
    elsewhere = client.create_run(store["experiment_id"], tags={OWNER_TAG: f"another/machine/1|{pid}|1"}).info.run_id
    unowned = client.create_run(store["experiment_id"]).info.run_id
    finished = client.create_run(store["experiment_id"], tags={OWNER_TAG: f"{where}|{pid}|{int(started) + 1}"})
    client.set_terminated(finished.info.run_id, "FINISHED")

    assert sorted(lineage.close_orphans_of(store["experiment"])) == sorted([created, attached])
    for run_id in (created, attached):
        run = client.get_run(run_id)
        assert run.info.status == "KILLED" and run.info.end_time
        assert "ended without closing the run" in run.data.tags["rlhf.error"]
    for run_id in (live, elsewhere, unowned):
        assert client.get_run(run_id).info.status == "RUNNING", run_id
    assert client.get_run(finished.info.run_id).info.status == "FINISHED"
    assert lineage.close_orphans_of(store["experiment"]) == []
    assert lineage.close_orphans_of("no-such-experiment") == []


def test_prune_counts_a_killed_runs_folder_as_ended_and_yes_marks_it_killed(store, tmp_path):
    """A RUNNING pipeline run keeps its folder from `rlhf prune`; one whose flow was killed does not."""
    from mlflow import MlflowClient

    from rlhf_core.cli import main

    client = MlflowClient(store["uri"])
    old = int((time.time() - 40 * 86400) * 1000)
    killed = _killed_child(
        "from mlflow import MlflowClient\nfrom rlhf_core.infra.reachability import create_run_once\n"
        f"c = MlflowClient({store['uri']!r})\n"
        f"print(create_run_once(c, 'p', {{'rlhf.kind': 'pipeline'}})({store['experiment_id']!r}).info.run_id)",
        store["uri"])
    live = client.create_run(store["experiment_id"], start_time=old,
                                           tags={"rlhf.kind": "pipeline", OWNER_TAG: owner_tag()}).info.run_id
    root = tmp_path / "pipelines"
    for run_id in (killed, live):
        ckpt = root / run_id / "checkpoints" / "ppo"
        (ckpt / "global_step2").mkdir(parents=True)
        (ckpt / "rlhf-checkpoints.json").write_text("{}")
        os.utime(ckpt / "rlhf-checkpoints.json", (old / 1000, old / 1000))

    def prune(*flags):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            assert main(["prune", "--output_root", str(root), "--keep_last", "0", "--keep_days", "0", *flags]) == 0
        return printed.getvalue()

    text = prune()
    assert "1 MLflow run(s) are RUNNING but their process on this machine is gone" in text and killed in text
    assert str(root / killed / "checkpoints" / "ppo") in text.split("kept ")[0], text
    assert str(root / live / "checkpoints" / "ppo") in text.split("kept ")[1], text
    assert client.get_run(killed).info.status == "RUNNING", "a dry run changed the store"

    text = prune("--yes")
    assert "marked 1 MLflow run(s) KILLED" in text, text
    assert client.get_run(killed).info.status == "KILLED"
    assert not (root / killed / "checkpoints" / "ppo").exists()
    assert (root / live / "checkpoints" / "ppo" / "rlhf-checkpoints.json").exists()
    assert client.get_run(live).info.status == "RUNNING"


def test_a_run_created_for_another_process_carries_its_owner_or_none_never_the_creators(store):
    """The MLflow process creates the runs its command owns: the owner it is given is recorded, and
    an owner nobody could tell (None) leaves no tag rather than the creator's own."""
    from mlflow import MlflowClient

    from rlhf_core.infra.owner import OWNER_TAG, owner_tag
    from rlhf_core.infra.reachability import create_run_once

    client = MlflowClient(store["uri"])
    tags = {name: client.get_run(create_run_once(client, name, {}, owner=owner)(store["experiment_id"]).info.run_id)
            .data.tags.get(OWNER_TAG) for name, owner in (("given", "elsewhere|1|2"), ("unknown", None))}
    default = create_run_once(client, "default", {})(store["experiment_id"]).data.tags.get(OWNER_TAG)
    assert tags == {"given": "elsewhere|1|2", "unknown": None} and default == owner_tag()
