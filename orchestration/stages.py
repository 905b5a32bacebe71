"""Prefect tasks for the stages: cache check, lineage-tagged MLflow run, one Ray job, the manifest back.

Every stage goes through `run_job_stage`:

1. its cache key (config hash, upstream cache keys, dataset digests, code version);
2. unless forced, an earlier FINISHED run with that key whose output still exists is reused:
   a child run tagged `rlhf.cached_from` records the reuse, nothing is submitted;
3. otherwise a child run is created with the lineage tags, the stage's config is written next to
   its output (an audit trail, and how the job receives it), the `rlhf` CLI runs as a Ray job
   logging into that run, and the stage's `stage.json` is read back.

The task returns a `StageOutcome` (URIs, run ids, metrics, timings), never weights. Prefect
retries a task only for infrastructure failures: a configuration or data error (exit code 2)
fails at once.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from orchestration import lineage
from orchestration.cache import cache_key, dataset_digest
from orchestration.ray_jobs import RayJobRunner, StageJobError, job_env
from rlhf_core.infra import storage
from rlhf_core.infra.manifests import code_version
from rlhf_core.infra.reachability import StoreUnavailable
from rlhf_core.infra.redaction import redact_text


@dataclass
class PipelineContext:
    """What every stage task of one pipeline run shares."""

    experiment: str
    parent_run_id: str
    flow_run_id: str
    run_root: str  # this pipeline run's output folder (local or s3://)
    ray_address: str
    force: list[str] = field(default_factory=list)
    rollout_gpus: float = 0
    hardware: dict | None = None  # `rlhf hardware` on the cluster, asked for once (see `precision`)

    def output(self, name: str) -> str:
        return f"{self.run_root.rstrip('/')}/{name}"

    def precision(self, requested: str) -> str:
        """What `param_dtype` `requested` resolves to on the cluster's ranks (fp32 is fp32 everywhere)."""
        requested = getattr(requested, "value", requested)
        if requested == "fp32":
            return requested
        if self.hardware is None:
            from orchestration.hardware import probe_cluster

            self.hardware = probe_cluster(self.ray_address, get_run_logger().info)
        return self.hardware["precision"][requested]


@dataclass
class StageOutcome:
    stage: str
    name: str
    output_uri: str
    run_id: str
    cache_key: str
    cached: bool
    metrics: dict
    manifest: dict
    job_seconds: float = 0.0
    task_seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_run(cls, run, name: str | None = None) -> StageOutcome | None:
        """The outcome an earlier MLflow stage run recorded, or None when its output is gone."""
        tags = run.data.tags
        uri = tags.get("rlhf.output_uri")
        manifest = storage.read_manifest(uri) if uri else None
        if manifest is None:
            return None
        return cls(tags.get("rlhf.stage", "?"), name or tags.get("rlhf.stage_name") or tags.get("rlhf.stage", "?"),
                   uri, run.info.run_id, tags.get("rlhf.cache_key", ""), True, manifest.get("metrics", {}), manifest)


@dataclass
class StageJob:
    """One stage to run: the CLI arguments, what its output depends on, where it goes."""

    stage: str  # prep | sft | rm | dpo | ppo | eval | pairs
    name: str  # unique within the pipeline run (e.g. "dpo" or "dpo-round2")
    args: list[str]  # `rlhf <args>`; "{config}" is replaced by the written config's path
    output_uri: str
    config_hash: str
    config_yaml: str | None = None
    datasets: str | None = None  # comma-separated dataset specs to digest
    upstream: dict[str, StageOutcome] = field(default_factory=dict)  # role -> outcome
    external_inputs: dict[str, str] = field(default_factory=dict)  # role -> model/hub URI not made here
    num_gpus: float = 0  # for the job's driver (eval and pairs generate in-process)
    checkpoint_uri: str | None = None  # a checkpoint folder the job resumes from (see orchestration/resume.py)


def _tags(ctx: PipelineContext, job: StageJob, key: str) -> dict[str, str]:
    tags = {"rlhf.pipeline_run_id": ctx.parent_run_id, "rlhf.prefect_flow_run_id": ctx.flow_run_id,
            "rlhf.code_version": code_version(), "rlhf.cache_key": key, "rlhf.stage_name": job.name,
            "rlhf.upstream_run_ids": ",".join(o.run_id for o in job.upstream.values())}
    for role, outcome in job.upstream.items():
        tags[f"rlhf.upstream.{role}.run_id"] = outcome.run_id
        tags[f"rlhf.upstream.{role}.model_uri"] = outcome.output_uri
    for role, uri in job.external_inputs.items():
        tags[f"rlhf.input.{role}"] = uri
    return tags


def stage_cache_key(job: StageJob) -> str:
    upstream = {role: o.cache_key for role, o in job.upstream.items()}
    upstream.update({role: f"uri:{uri}" for role, uri in job.external_inputs.items()})
    return cache_key(job.stage, job.config_hash, upstream, dataset_digest(job.datasets), code_version())


def _retry_infrastructure_only(task_, task_run, state) -> bool:
    try:
        state.result()
    except StageJobError as e:
        return e.retryable
    except TimeoutError:  # settings.stage_timeout_minutes: the job was stopped on the way out
        return True
    except StoreUnavailable:  # MLflow or S3 did not answer within its bound: infrastructure
        return True
    except Exception:  # noqa: BLE001 - anything else (our own bugs, an MLflow answer) is not worth a retry
        return False
    return False


@task(name="stage", cache_policy=NO_CACHE, retry_condition_fn=_retry_infrastructure_only,
      task_run_name="{job.name}")
def run_job_stage(ctx: PipelineContext, job: StageJob) -> StageOutcome:
    logger = get_run_logger()
    started = time.perf_counter()
    key = stage_cache_key(job)
    tags = _tags(ctx, job, key)
    if job.stage not in ctx.force and job.name not in ctx.force:
        earlier = lineage.find_cached(ctx.experiment, key)
        if earlier is not None:
            uri = earlier.data.tags["rlhf.output_uri"]
            run_id = lineage.start_stage_run(ctx.parent_run_id, job.stage, job.name,
                                             {**tags, "rlhf.cached_from": earlier.info.run_id, "rlhf.output_uri": uri})
            manifest = storage.read_manifest(uri) or {}
            lineage.log_metrics(run_id, {k: v for k, v in manifest.get("metrics", {}).items()
                                         if isinstance(v, (int, float))})
            lineage.end_run(run_id)
            logger.info(f"{job.name}: cached - config, inputs and code unchanged; reusing {uri} "
                        f"(run {earlier.info.run_id}), nothing trained")
            return StageOutcome(job.stage, job.name, uri, run_id, key, True, manifest.get("metrics", {}), manifest,
                                0.0, time.perf_counter() - started)

    resuming = False
    if job.checkpoint_uri is not None:
        from orchestration.resume import claim

        resuming = claim(job.checkpoint_uri, key, job.name)  # CheckpointMismatch: not retried
        tags["rlhf.checkpoint_uri"] = job.checkpoint_uri
    run_id = lineage.start_stage_run(ctx.parent_run_id, job.stage, job.name, tags)
    if resuming:
        lineage.set_tags(run_id, {"rlhf.resumed_from_checkpoints": job.checkpoint_uri})
        logger.info(f"{job.name}: an earlier attempt left checkpoints in {job.checkpoint_uri}; resuming there")
    try:
        args = list(job.args)
        if job.config_yaml is not None:
            config_uri = ctx.output(f"configs/{job.name}.yaml")
            write_text(config_uri, job.config_yaml)
            args = [config_uri if a == "{config}" else a for a in args]
        runner = RayJobRunner(ctx.ray_address)
        env = job_env({"MLFLOW_RUN_ID": run_id, "MLFLOW_EXPERIMENT_NAME": ctx.experiment})
        result = runner.run(job.name, args, env, log=lambda line: logger.info(redact_text(line)),
                            entrypoint_num_gpus=job.num_gpus or None)
        manifest = storage.read_manifest(job.output_uri)
        if manifest is None:
            raise RuntimeError(f"{job.name}: the job succeeded but wrote no {storage.MANIFEST} at {job.output_uri}")
        lineage.set_tags(run_id, {"rlhf.output_uri": storage.normalize_uri(job.output_uri),
                                  "rlhf.job_seconds": f"{result.seconds:.1f}",
                                  "rlhf.ray_submission_id": result.submission_id})
        lineage.end_run(run_id)
    except BaseException as e:
        try:  # a store that is away must not hide why the stage failed
            lineage.set_tags(run_id, {"rlhf.error": error_tag(e)})
            lineage.end_run(run_id, "FAILED")
        except Exception as record_error:  # noqa: BLE001
            logger.warning(f"{job.name}: could not mark run {run_id} FAILED: {redact_text(str(record_error))}")
        raise
    outcome = StageOutcome(job.stage, job.name, storage.normalize_uri(job.output_uri), run_id, key, False,
                           manifest.get("metrics", {}), manifest, result.seconds, time.perf_counter() - started)
    logger.info(f"{job.name}: done in {outcome.task_seconds:.1f}s (job {result.seconds:.1f}s) -> {outcome.output_uri}")
    return outcome


def error_tag(error: BaseException, limit: int = 5000) -> str:
    """The `rlhf.error` tag (MLflow caps a tag's value): the headline (what failed: the file and row,
    the rank that died) and as much of the end (the job's last log lines) as fits."""
    text = redact_text(f"{type(error).__name__}: {error}")  # before cutting: a cut secret is no longer found
    if len(text) <= limit:
        return text
    head = text.splitlines()[0][: limit // 2]
    return f"{head}\n[...]\n{text[-(limit - len(head) - 7):]}"


def write_text(uri: str, text: str) -> None:
    if storage.is_remote(uri):
        import fsspec

        with fsspec.open(uri, "w") as f:
            f.write(text)
        return
    from pathlib import Path

    path = Path(uri)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
