"""The `rlhf` flow: prep -> SFT -> reward model -> DPO -> evaluation (and iterative DPO rounds).

Orchestration only: each stage is a task that submits the `rlhf` CLI as a Ray job (see
`tasks/stages.py`); this module decides what runs, in which order, on whose outputs, and records
the pipeline run in MLflow. Choices:

- `settings.stages` picks the stages; they always run in lifecycle order. A stage that is not
  run but is needed downstream comes from `settings.from_run` (an earlier pipeline run, by MLflow
  parent run id or Prefect flow run id), so one stage can be rerun against earlier outputs,
  which are read and never modified.
- Stage outputs, prep's data and base model included, go to `<output_root>/<pipeline run
  id>/<stage>` (local or s3://; jobs read s3:// data through a local cache).
- Embedded default: a local Ray with its dashboard is started for the flow run and stopped at
  the end; with `RAY_ADDRESS` the jobs go to that cluster.
- The return value and the parent run hold, per stage, the task's wall time and the Ray job's own
  run time; their difference is the orchestration overhead.
"""

from __future__ import annotations

import json
import time

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows.params import (
    EvalParams,
    IterativeDPOParams,
    PipelineDPOConfig,
    PipelineRMConfig,
    PipelineSettings,
    PipelineSFTConfig,
    PrepParams,
    Stage,
)
from rlhf_core.config import TrainConfig, state_dir, with_updates
from rlhf_core.version import code_version, config_hash, params_hash
from tasks import lineage
from tasks.ray_jobs import ray_cluster
from tasks.reports import publish_eval_report, summary_table
from tasks.stages import PipelineContext, StageJob, StageOutcome, run_job_stage, write_text

ORDER = [Stage.PREP, Stage.SFT, Stage.RM, Stage.DPO, Stage.EVAL, Stage.ITERATIVE_DPO]


class PipelineError(ValueError):
    """A pipeline-level configuration problem (missing upstream, bad from_run)."""


@flow(name="rlhf", log_prints=True, validate_parameters=True)
def rlhf(settings: PipelineSettings = PipelineSettings(), prep: PrepParams = PrepParams(),  # noqa: B008
         sft: PipelineSFTConfig = PipelineSFTConfig(), rm: PipelineRMConfig = PipelineRMConfig(),  # noqa: B008
         dpo: PipelineDPOConfig = PipelineDPOConfig(),  # noqa: B008
         evaluation: EvalParams = EvalParams(), iterative: IterativeDPOParams = IterativeDPOParams(),  # noqa: B008
         ) -> dict:
    """Run the RLHF lifecycle; returns per-stage outcomes, timings and the evaluation summary."""
    logger = get_run_logger()
    started = time.perf_counter()
    stages = [s for s in ORDER if s in set(settings.stages)]
    flow_run_id = str(flow_run.id or "local")
    earlier = _earlier_outcomes(settings) if settings.from_run else {}
    parent = lineage.start_pipeline_run(
        settings.experiment, name=f"pipeline-{flow_run.name or 'local'}",
        tags={"rlhf.prefect_flow_run_id": flow_run_id, "rlhf.code_version": code_version(),
              "rlhf.stages": ",".join(s.value for s in stages), "rlhf.from_run": settings.from_run or ""},
        params={"stages": ",".join(s.value for s in stages), **{f"prep.{k}": v for k, v in prep.model_dump().items()}})
    root = settings.output_root or str(state_dir() / "pipelines")
    outcomes: dict[str, StageOutcome] = {}
    summary: dict = {"pipeline_run_id": parent, "prefect_flow_run_id": flow_run_id, "stages": {}}
    try:
        with ray_cluster() as address:
            ctx = PipelineContext(settings.experiment, parent, flow_run_id, f"{root.rstrip('/')}/{parent}", address,
                                  force=[s.value for s in settings.force_stages] if not settings.force
                                  else [s.value for s in Stage], rollout_gpus=settings.rollout_gpus)
            run = _runner(ctx, settings)

            def need(name: str) -> StageOutcome:
                if name in outcomes:
                    return outcomes[name]
                if name in earlier:
                    outcomes[name] = record_reuse(ctx, earlier[name])
                    return outcomes[name]
                raise PipelineError(f"stage {name!r} is needed but neither run here nor found in from_run "
                                    f"({settings.from_run!r}); add it to settings.stages or pass from_run")

            for stage in stages:
                if stage == Stage.PREP:
                    outcomes["prep"] = run(_prep_job(ctx, prep))
                elif stage in (Stage.SFT, Stage.RM, Stage.DPO):
                    cfg = {"sft": sft, "rm": rm, "dpo": dpo}[stage.value]
                    outcomes[stage.value] = run(_train_job(ctx, settings, cfg, need))
                elif stage == Stage.EVAL:
                    outcomes["eval"] = run(_eval_job(ctx, prep, evaluation, need("prep"), need("dpo"), need("sft"),
                                                     need("rm"), name="eval"))
                    summary["evaluation"] = publish_eval_report(outcomes["eval"], evaluation.promote_metric)
                elif stage == Stage.ITERATIVE_DPO:
                    from flows.iterative import run_rounds

                    summary["iterative"] = run_rounds(ctx, settings, prep, dpo, evaluation, iterative, need, run,
                                                      outcomes)
            if settings.register_models:
                summary["registry"] = _register(outcomes, evaluation)
    except BaseException:
        lineage.end_run(parent, "FAILED")
        raise
    wall = time.perf_counter() - started
    summary["stages"] = {name: _timing(o) for name, o in outcomes.items()}
    summary["wall_seconds"] = round(wall, 1)
    summary["job_seconds"] = round(sum(o.job_seconds for o in outcomes.values()), 1)
    summary["overhead_seconds"] = round(wall - summary["job_seconds"], 1)
    summary["outputs"] = {name: o.output_uri for name, o in outcomes.items()}
    lineage.log_metrics(parent, {"pipeline/wall_seconds": wall, "pipeline/overhead_seconds": summary["overhead_seconds"],
                                 **{f"overhead/{n}_seconds": t["overhead_seconds"]
                                    for n, t in summary["stages"].items()}})
    summary["summary_uri"] = ctx.output("pipeline_summary.json")
    write_text(summary["summary_uri"], json.dumps(summary, indent=2, default=str))
    lineage.end_run(parent)
    logger.info("\n" + summary_table(summary))
    return summary


def _runner(ctx: PipelineContext, settings: PipelineSettings):
    timeout = settings.stage_timeout_minutes * 60 if settings.stage_timeout_minutes else None
    backoff = [settings.retry_delay_seconds * 2**i for i in range(settings.retries)]  # exponential
    task = run_job_stage.with_options(retries=settings.retries, retry_delay_seconds=backoff or 0,
                                      timeout_seconds=timeout)

    def run(job: StageJob) -> StageOutcome:
        return task(ctx, job)

    return run


def _timing(o: StageOutcome) -> dict:
    overhead = o.task_seconds - o.job_seconds
    return {"cached": o.cached, "task_seconds": round(o.task_seconds, 1), "job_seconds": round(o.job_seconds, 1),
            "overhead_seconds": round(overhead, 1), "run_id": o.run_id, "stage": o.stage,
            "metrics": {k: v for k, v in o.metrics.items() if isinstance(v, (int, float))}}


def record_reuse(ctx: PipelineContext, earlier: StageOutcome) -> StageOutcome:
    """A child run in this pipeline run for an output taken from `from_run`, so lineage stays whole."""
    tags = {"rlhf.cached_from": earlier.manifest.get("mlflow_run_id") or earlier.run_id,
            "rlhf.reused_from_run": earlier.run_id, "rlhf.output_uri": earlier.output_uri,
            "rlhf.cache_key": earlier.cache_key, "rlhf.stage_name": earlier.name,
            "rlhf.pipeline_run_id": ctx.parent_run_id, "rlhf.prefect_flow_run_id": ctx.flow_run_id}
    run_id = lineage.start_stage_run(ctx.parent_run_id, earlier.stage, earlier.name, tags)
    lineage.end_run(run_id)
    get_run_logger().info(f"{earlier.name}: reusing {earlier.output_uri} from the earlier run {earlier.run_id}")
    return StageOutcome(earlier.stage, earlier.name, earlier.output_uri, run_id, earlier.cache_key, True,
                        earlier.metrics, earlier.manifest)


def _earlier_outcomes(settings: PipelineSettings) -> dict[str, StageOutcome]:
    """Stage outcomes of `from_run`: a pipeline run id, a Prefect flow run id, or `champion`
    (the pipeline run that trained the current champion policy)."""
    ref = settings.from_run
    if ref == "champion":
        version = lineage.alias_version(lineage.REGISTERED_NAMES["dpo"], lineage.CHAMPION)
        if version is None:
            raise PipelineError("from_run 'champion': no rlhf-policy version has the champion alias yet; run the "
                                "full pipeline first")
        ref = lineage.get_run(version.run_id).data.tags.get("rlhf.pipeline_run_id", "")
    try:
        parent = lineage.find_pipeline_run(settings.experiment, ref)
    except ValueError as e:
        raise PipelineError(str(e)) from None
    outcomes = {}
    for name, run in lineage.stage_runs(parent.info.run_id).items():
        outcome = StageOutcome.from_run(run, name)
        if outcome is not None:
            outcomes[name] = outcome
    return outcomes


def _prep_job(ctx: PipelineContext, prep: PrepParams) -> StageJob:
    out = ctx.output("prep")
    args = ["prep", "--out", out, "--task", prep.task, "--seed", str(prep.seed), "--model_size", prep.model_size,
            "--n_train", str(prep.n_train), "--n_test", str(prep.n_test)]
    return StageJob("prep", "prep", args, out, params_hash(prep))


def prep_paths(prep_outcome: StageOutcome) -> dict[str, str]:
    root = prep_outcome.output_uri.rstrip("/")  # a local path or an s3:// URI: join as strings
    return {"base": f"{root}/base", "sft": f"json@{root}/data/sft", "preference": f"json@{root}/data/preference",
            "prompts": f"json@{root}/data/prompts"}


UPSTREAM = {"sft": ("prep", "sft"), "rm": ("sft", "preference"), "dpo": ("sft", "preference")}


def _train_job(ctx: PipelineContext, settings: PipelineSettings, cfg: TrainConfig, need,
               name: str | None = None, model_from: StageOutcome | None = None,
               data_from: tuple[StageOutcome, str] | None = None, eval_dataset: str | None = None) -> StageJob:
    """A training stage whose missing inputs come from upstream outcomes (prep data, SFT model)."""
    import yaml

    stage = cfg.stage
    name = name or stage
    model_role, data_kind = UPSTREAM[stage]
    upstream: dict[str, StageOutcome] = {}
    external: dict[str, str] = {}
    updates: dict = {"mlflow_experiment": ctx.experiment, "mlflow_parent_run_id": ctx.parent_run_id,
                     "mlflow_run_name": name}
    if cfg.pretrain is None:
        source = model_from or need(model_role)
        upstream["model"] = source
        updates["pretrain"] = prep_paths(source)["base"] if source.stage == "prep" else source.output_uri
    else:
        external["model"] = cfg.pretrain
    reference = given_reference(cfg)
    if reference is not None:
        external["reference"] = reference
    if data_from is not None:
        upstream["data"], updates["dataset"] = data_from
    elif cfg.data.dataset is None:
        prep_outcome = need("prep")
        upstream.setdefault("data", prep_outcome)
        updates["dataset"] = prep_paths(prep_outcome)[data_kind]
    if eval_dataset is not None:
        updates["eval_dataset"] = eval_dataset
    if cfg.save_path is None:
        updates["save_path"] = ctx.output(name)
    filled = with_updates(cfg, **updates)
    filled.check_complete()
    datasets = ",".join(d for d in (filled.data.dataset, filled.data.eval_dataset) if d)
    # The key holds the precision the ranks will train in, never `auto`; the job gets the config as asked.
    hashed = with_updates(filled, param_dtype=ctx.precision(filled.param_dtype))
    return StageJob(stage, name, ["train", stage, "--config", "{config}"], filled.save_path, config_hash(hashed),
                    yaml.safe_dump(filled.model_dump(mode="json"), sort_keys=True), datasets, upstream, external)


def given_reference(cfg: TrainConfig) -> str | None:
    """The reference model a DPO/KTO config names apart from its start model; None when derived.

    Their validators fill `ref_pretrain` from `pretrain`, and `with_updates` (or any dump and
    validate) turns that derived value into a set field, so the field alone cannot say who chose
    it. A reference equal to `pretrain` is already in the cache key as the model; a missing one is
    filled from the upstream model, also in the key. Only a different one is a further input.
    """
    reference = getattr(cfg, "ref_pretrain", None)
    return reference if reference is not None and reference != cfg.pretrain else None


def _eval_job(ctx: PipelineContext, prep: PrepParams, params: EvalParams, prep_outcome: StageOutcome,
              policy: StageOutcome, reference: StageOutcome, reward: StageOutcome | None, name: str) -> StageJob:
    """`rlhf eval` of `policy` against `reference` on prep's held-out prompts."""
    out = ctx.output(name)
    prompts = prep_paths(prep_outcome)["prompts"]
    args = ["eval", "--pretrain", policy.output_uri, "--ref_pretrain", reference.output_uri, "--dataset", prompts,
            "--task", prep.task, "--max_samples", str(params.max_samples), "--n_kl_samples", str(params.n_kl_samples),
            "--save_path", out, "--mlflow_experiment", ctx.experiment, "--mlflow_run_name", name]
    upstream = {"policy": policy, "reference": reference, "data": prep_outcome}
    if reward is not None:
        args += ["--reward_pretrain", reward.output_uri]
        upstream["reward"] = reward
    return StageJob("eval", name, args, out, eval_settings_hash(prep, params), None, prompts, upstream,
                    num_gpus=ctx.rollout_gpus)


# EvalParams fields that never reach the eval job: `promote_metric` only decides, after the job,
# what its metrics promote. Every other field, present or future, is in the eval cache key.
EVAL_NOT_IN_KEY = frozenset({"promote_metric"})


def eval_settings_hash(prep: PrepParams, params: EvalParams) -> str:
    """The settings part of an eval stage's cache key (models and prompts enter as upstream keys)."""
    return params_hash(params, exclude=EVAL_NOT_IN_KEY, task=prep.task)


def _register(outcomes: dict[str, StageOutcome], evaluation: EvalParams) -> dict:
    """Register this run's final models (once per trained output); promote the policy on its evaluation."""
    registered = {}
    for stage in ("sft", "rm", "dpo"):
        if stage in outcomes:
            o = outcomes[stage]
            version = lineage.register_once(stage, o.output_uri, o.manifest.get("mlflow_run_id") or o.run_id)
            registered[stage] = {"model": version.name, "version": version.version}
    if "dpo" in registered and "eval" in outcomes:
        value = outcomes["eval"].metrics.get(evaluation.promote_metric)
        if value is None:
            raise PipelineError(f"evaluation.promote_metric {evaluation.promote_metric!r} is not among the "
                                f"evaluation metrics {sorted(outcomes['eval'].metrics)}")
        promoted, previous = lineage.promote(registered["dpo"]["model"], registered["dpo"]["version"],
                                             evaluation.promote_metric, float(value))
        champion = lineage.alias_version(registered["dpo"]["model"], lineage.CHAMPION)
        registered["dpo"].update({"champion": promoted, "metric": evaluation.promote_metric, "value": value,
                                  "previous_champion_value": previous,
                                  "champion_uri": champion.tags.get("rlhf.output_uri") if champion else None})
    return registered
