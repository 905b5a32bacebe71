"""`rlhf prune` on a fake output tree recorded in a real (SQLite) MLflow store, through the CLI in-process.

The tree has outputs that something refers to (a registered model version and its upstream
inputs, a cache entry of the current code version, the newest run, a RUNNING run, a recent folder
the store does not know) and outputs nothing refers to (an old run's unregistered output, its
checkpoints and config, a stale cache entry of another code version, an old unknown folder), plus
files the project did not write. The dry run must list exactly the unreferenced items and delete
nothing; `--yes` must delete exactly those.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
import uuid
from pathlib import Path

import pytest

DAY_MS = 86_400_000


def _output(path: Path, stage: str, size: int = 2048) -> Path:
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"\0" * size)
    (path / "stage.json").write_text(json.dumps({"stage": stage}))
    return path


def _checkpoints(path: Path) -> Path:
    (path / "global_step2").mkdir(parents=True)
    (path / "global_step2" / "state.pt").write_bytes(b"\0" * 4096)
    (path / "rlhf-checkpoints.json").write_text(json.dumps({"tags": {}}))
    return path


def _snapshot(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in root.rglob("*")}


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """The fake `.rlhf/pipelines` and its MLflow records, in a store of its own (the newest runs of a
    shared store would be other tests'); returns (root, expected deletions, kept paths)."""
    import mlflow
    from mlflow import MlflowClient

    before = mlflow.get_tracking_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")

    from rlhf_core.infra.manifests import code_version
    from rlhf_core.infra.mlflow_ops import ensure_experiment
    from rlhf_core.infra.settings import tracking_uri

    client = MlflowClient(tracking_uri())
    experiment = ensure_experiment(f"prune-{uuid.uuid4().hex[:8]}")
    now = int(time.time() * 1000)
    root = tmp_path / "pipelines"

    def pipeline(age_days: float, status: str = "FINISHED") -> str:
        run = client.create_run(experiment, start_time=now - int(age_days * DAY_MS), tags={"rlhf.kind": "pipeline"})
        if status != "RUNNING":
            client.set_terminated(run.info.run_id, status, end_time=now - int(age_days * DAY_MS) + 1000)
        (root / run.info.run_id).mkdir(parents=True)
        return run.info.run_id

    def stage(parent: str, name: str, age_days: float, code: str | None = None, **tags) -> str:
        out = root / parent / name
        run = client.create_run(experiment, start_time=now - int(age_days * DAY_MS), tags={
            "mlflow.parentRunId": parent, "rlhf.stage": name, "rlhf.stage_name": name,
            "rlhf.cache_key": f"sha256:{uuid.uuid4().hex}", "rlhf.code_version": code or "0.0.1+src.old",
            "rlhf.output_uri": str(out), **tags})
        client.set_terminated(run.info.run_id, "FINISHED")
        return run.info.run_id

    # Old run A: SFT is registered (with its prep as upstream); RM, checkpoints and RM's config are not.
    a = pipeline(30)
    prep_a = _output(root / a / "prep", "prep")
    sft_a = _output(root / a / "sft", "sft")
    rm_a = _output(root / a / "rm", "rm")
    ckpt_a = _checkpoints(root / a / "checkpoints" / "sft")
    (root / a / "configs").mkdir()
    (root / a / "configs" / "sft.yaml").write_text("max_steps: 2\n")
    (root / a / "configs" / "rm.yaml").write_text("max_steps: 2\n")
    (root / a / "pipeline_summary.json").write_text(json.dumps({"pipeline_run_id": a}))
    (root / a / "notes.txt").write_text("mine")  # not written by the project
    (root / a / "mine").mkdir()
    (root / a / "mine" / "weights.bin").write_bytes(b"\1" * 100)
    stage(a, "prep", 30)
    sft_run = stage(a, "sft", 30, **{"rlhf.upstream.data.model_uri": str(prep_a / "data" / "sft"),
                                      "rlhf.upstream.model.model_uri": str(prep_a / "base")})
    stage(a, "rm", 30)
    name = f"prune-test-{uuid.uuid4().hex[:8]}"
    client.create_registered_model(name)
    client.create_model_version(name, source=f"runs:/{sft_run}/stage.json", run_id=sft_run,
                                tags={"rlhf.output_uri": str(sft_a)})

    # Old run B: DPO is the newest output of a cache key of this code version; eval of an older version.
    b = pipeline(20)
    dpo_b = _output(root / b / "dpo", "dpo")
    eval_b = _output(root / b / "eval", "eval")
    stage(b, "dpo", 20, code=code_version())
    stage(b, "eval", 20)
    (root / b / "pipeline_summary.json").write_text(json.dumps({"pipeline_run_id": b}))

    # Newest run C (kept by --keep_last 1).
    c = pipeline(10)
    sft_c = _output(root / c / "sft", "sft")
    stage(c, "sft", 10)

    # Old run D still RUNNING: its checkpoints stay.
    d = pipeline(40, status="RUNNING")
    ckpt_d = _checkpoints(root / d / "checkpoints" / "ppo")

    # Run folders no run in the store knows: an old one (goes), a fresh one (stays); a folder not named
    # like a run is not the flow's, however old (someone's `rlhf train --save_path` output).
    past = time.time() - 30 * 86400
    old_unknown = _output(root / uuid.uuid4().hex / "sft", "sft")
    theirs = _output(root / "work" / "sft", "sft")
    for p in [*old_unknown.parent.rglob("*"), old_unknown.parent, *theirs.parent.rglob("*"), theirs.parent]:
        os.utime(p, (past, past))
    new_unknown = _output(root / uuid.uuid4().hex / "sft", "sft")

    deleted = {rm_a, ckpt_a, root / a / "configs" / "rm.yaml", eval_b, old_unknown}
    kept = {prep_a, sft_a, root / a / "configs" / "sft.yaml", root / a / "pipeline_summary.json",
            root / a / "notes.txt", root / a / "mine" / "weights.bin", dpo_b, root / b / "pipeline_summary.json",
            sft_c, ckpt_d, new_unknown, theirs}
    yield {"root": root, "deleted": deleted, "kept": kept, "client": client, "model": name,
            "registered_sft": {prep_a, sft_a, root / a / "configs" / "sft.yaml", root / a / "pipeline_summary.json"},
            "cached_dpo": {dpo_b, root / b / "pipeline_summary.json"}}
    mlflow.set_tracking_uri(before)


def old_unknown_folder(deleted: set[Path]) -> Path:
    return next(p.parent for p in deleted if p.name == "sft")


def _prune(*args: str) -> tuple[int, str]:
    from rlhf_core.cli import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["prune", *args])
    return code, printed.getvalue()


def _listed(text: str) -> set[Path]:
    """The paths of the `would delete` / `deleting` section."""
    section = text.split("kept ", 1)[0]
    return {Path(line.split()[2]) for line in section.splitlines()[1:] if line.startswith("  ")}


def test_dry_run_lists_exactly_the_unreferenced_and_deletes_nothing_then_yes_deletes_them(tree):
    root, deleted, kept = tree["root"], tree["deleted"], tree["kept"]
    before = _snapshot(root)
    flags = ["--output_root", str(root), "--keep_last", "1", "--keep_days", "7"]

    code, text = _prune(*flags)
    assert code == 0, text
    assert _listed(text) == deleted, text
    assert "would delete 5 item(s)" in text and "--yes" in text
    from orchestration.prune import human

    size = sum(f.stat().st_size for p in deleted for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())
    assert f"total: {human(size)} to delete" in text and human(size).endswith("KiB")
    assert _snapshot(root) == before, "a dry run deleted something"

    code, text = _prune(*flags, "--yes")
    assert code == 0, text
    assert _listed(text) == deleted, text
    for path in deleted:
        assert not path.exists(), path
    for path in kept:
        assert path.exists(), path
    assert not old_unknown_folder(deleted).exists(), "a folder the deletions left empty is removed"

    code, text = _prune(*flags)  # nothing left to delete
    assert _listed(text) == set() and "would delete 0 item(s)" in text


def test_an_output_root_given_through_a_symlink_keeps_what_is_referenced(tree):
    """The flow records resolved paths; a root named through a symlink (a linked home, macOS's
    /tmp) must still match them, or every registered and cached output would look unreferenced."""
    root, deleted = tree["root"], tree["deleted"]
    link = root.parent / "linked-pipelines"
    link.symlink_to(root, target_is_directory=True)
    code, text = _prune("--output_root", str(link), "--keep_last", "1", "--keep_days", "7")
    assert code == 0, text
    assert _listed(text) == deleted, text


def test_registered_only_with_an_alias_and_no_cache_entries(tree):
    root, deleted = tree["root"], tree["deleted"]
    flags = ["--output_root", str(root), "--keep_last", "1", "--keep_days", "7", "--keep_registered", "aliased",
             "--keep_cache", "none"]
    code, text = _prune(*flags)
    assert code == 0, text
    # The registered SFT has no alias: it goes with its inputs and files, and so does the cache entry.
    assert _listed(text) == deleted | tree["registered_sft"] | tree["cached_dpo"], text

    tree["client"].set_registered_model_alias(tree["model"], "champion", "1")
    code, text = _prune(*flags)
    assert _listed(text) == deleted | tree["cached_dpo"], text
    assert "registered " + tree["model"] + " v1 @champion" in text


@pytest.mark.parametrize("flags, message", [
    (["--keep_last", "-1"], "--keep_last must be >= 0"),
    (["--output_root", "s3://bucket/rlhf"], "local output root only"),
])
def test_bad_flags_exit_2_naming_the_flag(flags, message, capsys):
    from rlhf_core.cli import main

    assert main(["prune", *flags]) == 2
    assert message in capsys.readouterr().err


def test_what_a_kept_output_was_trained_from_is_kept_whatever_role_named_it(tmp_path):
    """A registered DPO policy took its reference from an old run's SFT folder (`rlhf.input.reference`)
    and two datasets (one tag, comma-separated): all of them are kept with it."""
    from orchestration.prune import StoreView, references

    root = tmp_path / "pipelines"
    dpo, ref, d1, d2 = (root / "r2" / "dpo", root / "r1" / "sft", root / "r1" / "prep" / "a", root / "r1" / "prep" / "b")
    view = StoreView(
        runs={"r1": {"start_ms": 0, "status": "FINISHED", "stages": {}},
              "r2": {"start_ms": 1, "status": "FINISHED", "stages": {}}},
        stage_runs=[{"parent": "r2", "name": "dpo", "status": "FINISHED", "start_ms": 1,
                     "tags": {"rlhf.output_uri": str(dpo), "rlhf.input.reference": str(ref),
                              "rlhf.input.data": f"json@{d1},{d2}"}}],
        registered=[{"name": "policy", "version": "1", "output_uri": str(dpo), "aliases": []}])
    refs = references(view, root, now_ms=10**13, keep_last=0, keep_days=0, keep_registered="all",
                      keep_cache="none", code_version="x")
    assert {dpo, ref, d1, d2} <= set(refs), refs
    assert refs[ref].startswith("input of dpo")
