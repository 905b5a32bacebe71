"""The `rlhf` flow: prep -> SFT -> reward model -> PPO and/or DPO -> a distilled student -> evaluation
(and iterative DPO rounds).

Orchestration only: each stage is a task submitting the `rlhf` CLI as a Ray job
(`orchestration/stages.py`, jobs built in `flows/jobs.py`); this module decides what runs, in which
order, on whose outputs, and records the pipeline run in MLflow.

- `settings.stages` run in lifecycle order; a needed stage not run comes from `settings.from_run`
  (read, never modified).
- Outputs go to `<output_root>/<pipeline run id>/<stage>` (local or s3://).
- Embedded default: a local Ray is started for the flow run and stopped at the end; with
  `RAY_ADDRESS` the jobs go to that cluster.
- Policy stages (DPO, PPO) train from the same SFT and reward model; one `rlhf eval` job compares
  them with SFT. Each registers an `rlhf-policy` version; `champion` moves to the best of them and
  the current champion by `evaluation.promote_metric`.
- `rejection_sampling` (`flows/rejection.py`): rounds of best-of-N sampling, the best kept, SFT on
  them; its policy is evaluated and registered like DPO's and PPO's.
- `conditional_sft` (`flows/conditional.py`): the SFT rows scored by the reward model, the score
  written into each prompt, the base trained on them; generation asks for a high score through the
  saved chat template. A policy like the others.
- `distill` trains a smaller student (prep's student base) on the SFT rows with the run's policy
  (PPO, else DPO, else rejection sampling, else SFT) as its teacher; the
  evaluation compares it beside the policies, and it registers an `rlhf-student` version tagged with its teacher (never the policy champion).
- Per stage, the task's wall time and the Ray job's run time are recorded (the difference is the
  orchestration overhead).
"""

from __future__ import annotations

import json
import time

from prefect import flow, get_run_logger
from prefect.runtime import flow_run

from flows import embedded, user_errors
from flows.jobs import PipelineError, eval_job, policy_metric, ppo_job, prep_job, prep_made, train_job
from flows.params import (
    EVALUATED_STAGES,
    POLICY_STAGES,
    TEACHER_STAGES,
    ConditionalSFTParams,
    EvalParams,
    IterativeDPOParams,
    OnlineRLParams,
    PipelineDPOConfig,
    PipelineKDConfig,
    PipelinePPOConfig,
    PipelinePRMConfig,
    PipelineRMConfig,
    PipelineSettings,
    PipelineSFTConfig,
    PrepParams,
    RejectionSamplingParams,
    Stage,
)
from orchestration import lineage
from orchestration.lifeline import lifeline
from orchestration.ray_jobs import ray_cluster
from orchestration.reports import publish_eval_report, publish_pipeline_report, summary_table
from orchestration.stages import PipelineContext, StageJob, StageOutcome, run_job_stage, write_text
from rlhf_core.infra.manifests import code_version
from rlhf_core.infra.redaction import redact_text, refuse_inline_secrets
from rlhf_core.infra.settings import state_dir

embedded.make_prefect_home()  # the embedded default's Prefect home, before any flow starts a server
user_errors.install()

ORDER = [Stage.PREP, Stage.SFT, Stage.RM, Stage.PRM, Stage.DPO, Stage.PPO, Stage.REJECTION_SAMPLING, Stage.CONDITIONAL_SFT,
         Stage.DISTILL, Stage.EVAL, Stage.ITERATIVE_DPO, Stage.ONLINE_RL]


def _close_orphans(experiment: str, logger) -> None:
    """Runs a killed flow or job of this machine left RUNNING are marked KILLED (orchestration/lineage.py)
    before this run starts, so the MLflow UI and `rlhf prune` stop counting them as running."""
    from rlhf_core.infra.reachability import StoreUnavailable

    try:
        closed = lineage.close_orphans_of(experiment)
    except StoreUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - a tidy-up: say why it did not happen, and run the pipeline
        logger.warning("could not look for MLflow runs left RUNNING by killed processes: %s: %s",
                       type(e).__name__, redact_text(str(e))[:300])
        return
    if closed:
        logger.warning("marked %d MLflow run(s) KILLED that a killed process of this machine had left RUNNING: %s",
                       len(closed), ", ".join(closed))


@flow(name="rlhf", log_prints=True, validate_parameters=True)
def rlhf(settings: PipelineSettings = PipelineSettings(), prep: PrepParams = PrepParams(),  # noqa: B008
         sft: PipelineSFTConfig = PipelineSFTConfig(), rm: PipelineRMConfig = PipelineRMConfig(),  # noqa: B008
         dpo: PipelineDPOConfig = PipelineDPOConfig(), ppo: PipelinePPOConfig = PipelinePPOConfig(),  # noqa: B008
         evaluation: EvalParams = EvalParams(), iterative: IterativeDPOParams = IterativeDPOParams(),  # noqa: B008
         online: OnlineRLParams = OnlineRLParams(), distill: PipelineKDConfig = PipelineKDConfig(),  # noqa: B008
         rejection_sampling: RejectionSamplingParams = RejectionSamplingParams(),  # noqa: B008
         conditional_sft: ConditionalSFTParams = ConditionalSFTParams(),  # noqa: B008
         prm: PipelinePRMConfig = PipelinePRMConfig(),  # noqa: B008
         ) -> dict:
    """Run the RLHF lifecycle; returns per-stage outcomes, timings and the evaluation summary."""
    refuse_inline_secrets({"settings": settings.model_dump(mode="json"), "prep": prep.model_dump(mode="json"),
                           "sft": sft.model_dump(mode="json"), "rm": rm.model_dump(mode="json"),
                           "dpo": dpo.model_dump(mode="json"), "ppo": ppo.model_dump(mode="json"),
                           "evaluation": evaluation.model_dump(mode="json"),
                           "iterative": iterative.model_dump(mode="json"), "online": online.model_dump(mode="json"),
                           "distill": distill.model_dump(mode="json"),
                           "rejection_sampling": rejection_sampling.model_dump(mode="json"),
                           "conditional_sft": conditional_sft.model_dump(mode="json"),
                           "prm": prm.model_dump(mode="json")},
                          "flow parameters")
    logger = get_run_logger()
    started = time.perf_counter()
    stages = [s for s in ORDER if s in set(settings.stages)]
    flow_run_id = str(flow_run.id or "local")
    earlier = _earlier_outcomes(settings) if settings.from_run else {}
    if Stage.PREP not in stages and "prep" in earlier:  # the data is from_run's: so are its settings
        prep = prep_made(earlier["prep"], prep)
    _close_orphans(settings.experiment, logger)
    parent = lineage.start_pipeline_run(
        settings.experiment, name=f"pipeline-{flow_run.name or 'local'}",
        tags={"rlhf.prefect_flow_run_id": flow_run_id, "rlhf.code_version": code_version(),
              "rlhf.stages": ",".join(s.value for s in stages), "rlhf.from_run": settings.from_run or ""},
        params={"stages": ",".join(s.value for s in stages), **{f"prep.{k}": v for k, v in prep.model_dump().items()}})
    root = settings.output_root or str(state_dir() / "pipelines")
    outcomes: dict[str, StageOutcome] = {}
    summary: dict = {"pipeline_run_id": parent, "prefect_flow_run_id": flow_run_id, "stages": {}}
    try:
        with lifeline(), ray_cluster() as address:
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
                where = (f"nor found in from_run {settings.from_run!r}" if settings.from_run
                         else "and no from_run names an earlier run that has it")
                raise PipelineError(f"stage {name!r} is needed but not run here ({', '.join(s.value for s in stages)}) "
                                    f"{where}; add {name!r} to settings.stages or pass from_run")

            for stage in stages:
                if stage == Stage.PREP:
                    # a student base only where a distill stage will start from it
                    distills = Stage.DISTILL in stages and distill.pretrain is None
                    outcomes["prep"] = run(prep_job(ctx, prep, distills=distills))
                elif stage in (Stage.SFT, Stage.RM, Stage.PRM, Stage.DPO):
                    cfg = {"sft": sft, "rm": rm, "prm": prm, "dpo": dpo}[stage.value]
                    outcomes[stage.value] = run(train_job(ctx, settings, cfg, need))
                elif stage == Stage.PPO:
                    outcomes["ppo"] = run(ppo_job(ctx, settings, prep, ppo, need))
                elif stage == Stage.REJECTION_SAMPLING:
                    from flows.rejection import run_rejection_sampling

                    outcomes["rejection_sampling"] = run_rejection_sampling(ctx, settings, prep, sft,
                                                                            rejection_sampling, need, run, outcomes)
                elif stage == Stage.CONDITIONAL_SFT:
                    from flows.conditional import run_conditional_sft

                    outcomes["conditional_sft"] = run_conditional_sft(ctx, settings, prep, sft, conditional_sft, need,
                                                                      run, outcomes)
                elif stage == Stage.DISTILL:
                    teacher = (distill_teacher(stages, outcomes, earlier, need) if distill.teacher_pretrain is None
                               else None)
                    outcomes["distill"] = run(train_job(ctx, settings, distill, need, name="distill",
                                                        teacher_from=teacher))
                elif stage == Stage.EVAL:
                    policies = evaluated_policies(stages, outcomes, earlier, need, settings)
                    # Without a reward model in the run or from_run: the verifier's metrics only.
                    reward = need("rm") if Stage.RM in stages or "rm" in earlier else None
                    if reward is None and evaluation.promote_metric in ("reward", "win_rate"):
                        raise PipelineError(f"evaluation.promote_metric {evaluation.promote_metric!r} needs a reward "
                                            "model, and this run has none (add rm to settings.stages, or promote "
                                            "by sampled_accuracy)")
                    outcomes["eval"] = run(eval_job(ctx, prep, evaluation, need("prep"), policies, need("sft"),
                                                    reward, name="eval"))
                    summary["evaluation"] = publish_eval_report(outcomes["eval"], evaluation.promote_metric)
                    summary["evaluation"]["policies"] = list(policies)
                elif stage == Stage.ITERATIVE_DPO:
                    from flows.iterative import run_rounds

                    summary["iterative"] = run_rounds(ctx, settings, prep, dpo, evaluation, iterative, need, run,
                                                      outcomes)
                    if summary["iterative"]["stopped_early"]:
                        logger.warning(f"iterative_dpo: {summary['iterative']['stopped_early']}")
                elif stage == Stage.ONLINE_RL:
                    from flows.online import run_online

                    summary["online"] = run_online(ctx, settings, prep, ppo, evaluation, online, need, run, outcomes)
            if settings.register_models:
                summary["registry"] = _register(outcomes, evaluation, summary.get("evaluation", {}).get("policies", []))
            summary["report"] = publish_pipeline_report(parent, outcomes, outcomes.get("eval"),
                                                        evaluation.promote_metric)
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
        version = lineage.alias_version(lineage.POLICY_MODEL, lineage.CHAMPION)
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


def evaluated_policies(stages: list[Stage], outcomes: dict[str, StageOutcome], earlier: dict[str, StageOutcome],
                       need, settings: PipelineSettings) -> dict[str, StageOutcome]:
    """The policies one eval job compares: the policy stages this run trained, else (an eval-only
    rerun) those of `from_run`. Names are the stage names (`dpo`, `ppo`)."""
    ran = [s.value for s in stages if s in EVALUATED_STAGES]
    names = ran or [s.value for s in EVALUATED_STAGES if s.value in earlier]
    if not names:
        raise PipelineError("stage 'eval' needs a policy: add dpo, ppo or distill to settings.stages, or pass a "
                            f"from_run that trained one ({settings.from_run!r} has none)")
    return {name: outcomes[name] if name in outcomes else need(name) for name in names}


def distill_teacher(stages: list[Stage], outcomes: dict[str, StageOutcome], earlier: dict[str, StageOutcome],
                    need) -> StageOutcome:
    """The run's policy a distilled student learns from: the first of PPO, DPO, rejection sampling
    and SFT that this run trained, else that `from_run` has (SFT is needed, and named, when none is
    found). An output this run only took from `from_run` ranks with `from_run`'s."""
    for stage in TEACHER_STAGES:
        if stage in stages and stage.value in outcomes:
            return outcomes[stage.value]
    for stage in TEACHER_STAGES:
        if stage.value in earlier:
            return need(stage.value)
    return need(Stage.SFT.value)


def _register(outcomes: dict[str, StageOutcome], evaluation: EvalParams, policies: list[str]) -> dict:
    """Register this run's final models (once per trained output); promote the best evaluated policy.

    Every evaluated policy stage registers a version of `rlhf-policy`; `candidate` points at the
    run's best, and `champion` moves to it when it beats the current champion on the metric.
    """
    registered: dict = {}
    for stage in ("sft", "rm", "prm"):
        if stage in outcomes:
            o = outcomes[stage]
            version = lineage.register_once(stage, o.output_uri, o.manifest.get("mlflow_run_id") or o.run_id)
            registered[stage] = {"model": version.name, "version": version.version}
    if "distill" in outcomes:
        o = outcomes["distill"]
        teacher = o.manifest.get("inputs", {}).get("teacher_model", "")
        version = lineage.register_once("distill", o.output_uri, o.manifest.get("mlflow_run_id") or o.run_id,
                                        tags={"rlhf.teacher_uri": teacher})
        registered["student"] = {"model": version.name, "version": version.version, "uri": o.output_uri,
                                 "teacher_uri": teacher}
    trained = [s.value for s in POLICY_STAGES if s.value in outcomes]
    if not trained:
        return registered
    registered["policies"] = {}
    for name in trained:
        o = outcomes[name]
        version = lineage.register_once(name, o.output_uri, o.manifest.get("mlflow_run_id") or o.run_id)
        registered["policies"][name] = {"model": version.name, "version": version.version, "uri": o.output_uri}
    evaluated = [name for name in trained if name in policies and "eval" in outcomes]
    if not evaluated:
        return registered
    metric = evaluation.promote_metric
    for name in evaluated:
        registered["policies"][name]["value"] = policy_metric(outcomes["eval"].metrics, name, metric)
    # Ascending, so the champion ends on the best of the run and the champion it had.
    ordered = sorted(evaluated, key=lambda n: registered["policies"][n]["value"])
    previous_value = None
    for i, name in enumerate(ordered):
        entry = registered["policies"][name]
        promoted, previous = lineage.promote(lineage.POLICY_MODEL, entry["version"], metric, entry["value"])
        entry["champion"] = promoted
        if i == 0:
            previous_value = previous
    best = registered["policies"][ordered[-1]]
    lineage.set_alias(lineage.POLICY_MODEL, lineage.CANDIDATE, best["version"])
    champion = lineage.alias_version(lineage.POLICY_MODEL, lineage.CHAMPION)
    registered["policy"] = {"model": lineage.POLICY_MODEL, "best": ordered[-1], "version": best["version"],
                            "metric": metric, "value": best["value"],
                            "champion": champion is not None and champion.version == best["version"],
                            "previous_champion_value": previous_value,
                            "champion_version": champion.version if champion else None,
                            "champion_uri": champion.tags.get("rlhf.output_uri") if champion else None}
    return registered
