"""What the in-process generation stages (`rlhf eval`, `rlhf pairs`) share around their work.

They run in the calling process (under an orchestrator, that process is already a Ray job's
driver): no worker group, no DeepSpeed. Like the trainers they open one MLflow run (resuming
the orchestrator's `MLFLOW_RUN_ID` when there is one) and end with the stage-output contract:
the output directory is built locally, then published with `storage.publish_dir`, which writes
`stage.json` last, so nothing half-written ever looks finished, locally or on S3. `stage_run`
first checks that the output may go to `save_path` (`storage.check_stage_output`).
"""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

from rlhf_core.infra import storage
from rlhf_core.infra.manifests import code_version, stage_manifest
from rlhf_core.infra.tracking import Tracker


@contextmanager
def stage_run(cfg, sources: list[dict]):
    """An MLflow run for the stage with its params and datasets; FAILED if the body raises.

    ConfigError, before the run opens, when the output may not go to `cfg.save_path`."""
    storage.check_stage_output(cfg)
    tracker = Tracker(cfg.use_mlflow, cfg.mlflow_experiment, cfg.mlflow_run_name or cfg.stage,
                      cfg.mlflow_parent_run_id, tags={"rlhf.stage": cfg.stage, "rlhf.code_version": code_version()})
    try:
        tracker.log_params(cfg.model_dump(mode="json"))
        tracker.log_datasets(sources, "evaluation" if cfg.stage == "eval" else "training")
        yield tracker
    except BaseException:
        tracker.finish("FAILED")
        raise
    tracker.finish("FINISHED")


def publish_stage(cfg, tracker: Tracker, files: dict[str, str], metrics: dict, inputs: dict) -> dict:
    """Write `files` (name -> text) and `stage.json` to `cfg.save_path` atomically; returns the manifest."""
    manifest = {**stage_manifest(cfg, inputs, metrics, tracker.run_id),
                "output_uri": storage.normalize_uri(cfg.save_path)}
    local_parent = None if storage.is_remote(cfg.save_path) else Path(manifest["output_uri"]).parent
    if local_parent is not None:
        local_parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=local_parent, prefix=".rlhf-save-") as tmp, storage.saving(
            "--save_path", cfg.save_path, f"output of {cfg.stage}", "the previous output there is as it was"):
        out = Path(tmp) / "out"
        out.mkdir()
        for name, text in files.items():
            (out / name).write_text(text, encoding="utf-8")
        tracker.await_store(f"nothing was published at {cfg.save_path}")  # see trainers.common.publish_model
        storage.publish_dir(out, cfg.save_path, manifest, storage.stage_inputs(cfg))
        tracker.published(manifest["output_uri"], cfg.stage)
    tracker.log_metrics(manifest["metrics"], step=0)
    tracker.set_tags({"rlhf.output_uri": manifest["output_uri"], "rlhf.config_hash": manifest["config_hash"]})
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in {**files, storage.MANIFEST: json.dumps(manifest, indent=2, sort_keys=True)}.items():
            if name.endswith(".json"):
                (Path(tmp) / name).write_text(text, encoding="utf-8")
                tracker.log_artifact(str(Path(tmp) / name))
    return manifest
