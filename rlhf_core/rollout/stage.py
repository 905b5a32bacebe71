"""What the in-process generation stages (`rlhf eval`, `rlhf pairs`) share around their work.

They run in the calling process (under an orchestrator, already a Ray job's driver): no worker
group, no DeepSpeed. Like the trainers they open one MLflow run (resuming the orchestrator's
`MLFLOW_RUN_ID` when there is one) and publish with `rlhf_core.infra.publishing.publish_output`.
"""

from __future__ import annotations

from contextlib import contextmanager

from rlhf_core.infra import storage
from rlhf_core.infra.manifests import code_version
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

