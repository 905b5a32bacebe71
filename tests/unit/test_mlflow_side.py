"""MLflow in a process of its own (infra/mlflow_side.py): the `rlhf` command's Tracker records the
same run as in-process MLflow, never imports MLflow itself, and keeps the Tracker's fault rules
(a refusal raised at once, an unreachable store or a dead side process bounded and named)."""

import json
import os
import subprocess
import sys
import time

import pytest

from rlhf_core.cli import _tracks_here

# Runs in a fresh process: the side process is started as the `rlhf` command starts it.
STAGE = """
import json, os, sys, time
from pathlib import Path
from rlhf_core.infra import mlflow_side
mlflow_side.start()
side_pid = mlflow_side._side.proc.pid
from rlhf_core.infra.tracking import Tracker
out = {"pid": os.getpid(), "side_pid": side_pid}
try:
    t = Tracker(True, "side", "sft", None, tags={"rlhf.stage": "sft"})
    out["run_id"] = t.run_id
    if os.environ.get("KILL_SIDE"):
        os.kill(side_pid, 9)
        time.sleep(0.5)
    t.log_params({"train": {"lr": 0.5}, "api_key": "sk-not-for-mlflow"})
    for step in (1, 2, 3):
        t.log_metrics({"train/loss": 1.0 / step}, step)
    data = Path(sys.argv[1]) / "rows.jsonl"
    data.write_text('{"a": 1}\\n')
    t.log_datasets([{"spec": str(data), "path": str(data), "split": "train", "digest": "0" * 40}], "training")
    note = Path(sys.argv[1]) / "note.json"
    note.write_text(json.dumps({"token": "hf_abcdefghijklmnopqrstuvwxyz"}))
    t.log_artifact(str(note))
    t.set_tags({"rlhf.output_uri": "/somewhere"})
    t.finish()
    out["finished"] = True
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
out["mlflow_imported"] = "mlflow" in sys.modules
print(json.dumps(out))
"""


def run_stage(tmp_path, timeout=120, **env) -> tuple[dict, float]:
    full = {**os.environ, "RLHF_HOME": str(tmp_path / "home"), "MLFLOW_EXPERIMENT_NAME": "side", **env}
    for name in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "RLHF_MLFLOW_IN_PROCESS"):
        if name not in env:
            full.pop(name, None)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", STAGE, str(tmp_path)], capture_output=True, text=True,
                          timeout=timeout, env=full)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), time.monotonic() - start


def store(tmp_path):
    import mlflow

    return mlflow.MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")


def test_the_commands_run_is_recorded_whole_by_the_side_process_and_mlflow_never_imported(tmp_path):
    out, _ = run_stage(tmp_path)
    assert out.get("finished"), out
    assert out["mlflow_imported"] is False  # every call went to the side process
    run = store(tmp_path).get_run(out["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "sft"
    assert run.data.params["train.lr"] == "0.5" and "sk-not-for-mlflow" not in json.dumps(run.data.params)
    history = store(tmp_path).get_metric_history(out["run_id"], "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 0.5), (3, 1 / 3)]
    tags = run.data.tags
    assert tags["rlhf.stage"] == "sft" and tags["rlhf.output_uri"] == "/somewhere"
    # the run is owned by the command's process, not by the side process, and named after its command line
    assert tags["rlhf.owner"].split("|")[1] == str(out["pid"]) != str(out["side_pid"])
    assert tags["mlflow.source.name"] == "-c"
    assert [d.dataset.name for d in run.inputs.dataset_inputs] == [f"{tmp_path / 'rows.jsonl'}[train]"]
    note = store(tmp_path).download_artifacts(out["run_id"], "note.json", str(tmp_path / "dl"))
    assert "hf_abcdefghijklmnopqrstuvwxyz" not in open(note).read()  # text artifacts redacted on this path too


def test_a_refusal_of_the_store_comes_back_at_once_with_its_error_code(tmp_path):
    """An orchestrator's run id the store does not know: RESOURCE_DOES_NOT_EXIST, not retried for
    the 60 s store check."""
    out, seconds = run_stage(tmp_path, MLFLOW_RUN_ID="0" * 32, RLHF_STORE_CHECK_S="60")
    assert out["error"].startswith("StoreAnswer: ") and "RESOURCE_DOES_NOT_EXIST" in out["error"], out
    # where the stage looked and the usual cause (a job on a machine that does not share the store)
    assert f"is not in the MLflow store at sqlite:///{tmp_path / 'home' / 'mlflow.db'}" in out["error"], out
    assert "tracking server" in out["error"]
    assert seconds < 45 and out["mlflow_imported"] is False


def test_an_unreachable_store_is_retried_within_its_bound_and_named(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, seconds = run_stage(tmp_path, MLFLOW_TRACKING_URI=f"http://127.0.0.1:{port}", RLHF_STORE_CHECK_S="2",
                             MLFLOW_HTTP_REQUEST_TIMEOUT="1", MLFLOW_HTTP_REQUEST_MAX_RETRIES="0")
    assert out["error"].startswith(f"StoreUnavailable: MLflow at http://127.0.0.1:{port} did not open the stage's "
                                   "run within 2 s (RLHF_STORE_CHECK_S"), out
    assert "last error: StoreFailure: MlflowException" in out["error"] and seconds < 40


def test_a_side_process_that_dies_fails_the_record_within_the_bound_saying_so(tmp_path):
    out, _ = run_stage(tmp_path, KILL_SIDE="1", RLHF_STORE_WAIT_S="2")
    assert "finished" not in out
    assert out["error"].startswith("StoreUnavailable: "), out
    assert f"the MLflow process (pid {out['side_pid']}) is gone" in out["error"]
    assert store(tmp_path).get_run(out["run_id"]).info.status == "RUNNING"  # nothing recorded as finished


@pytest.mark.parametrize(("argv", "env", "expected"), [
    (["train", "sft", "--pretrain", "m"], {}, True),
    (["train", "sft", "--use_mlflow", "false"], {}, False),
    (["train", "sft", "--use_mlflow=False"], {}, False),
    (["train", "sft", "--dry_run"], {}, False),
    (["train", "sft"], {"RANK": "1"}, False),
    (["prep", "--out", "x"], {}, False),
    ([], {}, False),
])
def test_the_command_starts_the_side_process_only_where_it_may_track(argv, env, expected, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert _tracks_here(argv) is expected


INTERRUPTED = """
import faulthandler, sys, time
faulthandler.enable()
from rlhf_core.infra import mlflow_side
mlflow_side.start()
from rlhf_core.infra.tracking import Tracker
t = Tracker(True, "side", "sft", None)
try:  # the Ctrl-C may land while the id is still being printed: inside the stage's try, as in a stage
    print(t.run_id, flush=True)
    time.sleep(120)  # training
except KeyboardInterrupt:  # as a stage does on any BaseException
    t.finish("FAILED")
    print("marked", flush=True)
"""


def test_a_ctrl_c_to_the_command_leaves_the_side_process_to_mark_the_run_failed(tmp_path):
    """A terminal's Ctrl-C signals the whole foreground process group: the side process must not
    die of it before the command has recorded its run's end."""
    import signal

    env = {**os.environ, "RLHF_HOME": str(tmp_path / "home"), "MLFLOW_EXPERIMENT_NAME": "side"}
    for name in ("MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "RLHF_MLFLOW_IN_PROCESS"):
        env.pop(name, None)
    # its own group, as a shell's job, with SIGINT's default disposition as a terminal starts it: a
    # disposition of SIG_IGN is inherited, and a library an earlier test of this worker ran may have
    # set it here (Python then never raises KeyboardInterrupt: the command slept through the Ctrl-C)
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        run_id = proc.stdout.readline().strip()
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:  # what it was doing, from its own stacks (faulthandler on SIGABRT)
        proc.send_signal(signal.SIGABRT)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"the command had not ended 60 s after its Ctrl-C; its stacks:\n{err[-6000:]}")
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "marked" in out, err[-2000:]
    assert store(tmp_path).get_run(run_id).info.status == "FAILED"
