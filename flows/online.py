"""Online RL inside the `rlhf` flow: continue PPO from the champion policy on fresh prompts.

`rlhf train ppo` from the `champion` (else SFT, or SFT with `start_from: sft`) with SFT as the
reference (the KL keeps the policy near SFT however many runs continue it) and the run's reward
model (or, with `online.reward: verifier`, prep's task verifier) -> `rlhf eval` against SFT -> a
new `rlhf-policy` version, promoted to `champion` only when `evaluation.promote_metric` beats it,
so the schedule can run unattended. The training seed is drawn per pipeline run unless
`online.seed` pins it: fresh prompts, never the previous run's cache. The round stops where the reward-hacking guard fires (`online.stop_on_hacking`, default on): from
the default pipeline's champion, a round against the run's reward model trained the held-out
accuracy down while its reward rose (benchmarks/README.md, "Scheduled rounds from the champion").
"""

from __future__ import annotations

import zlib

from flows.jobs import PipelineError, eval_job, policy_metric, ppo_job, starting_policy
from flows.params import EvalParams, OnlineRLParams, PipelinePPOConfig, PipelineSettings, PrepParams
from orchestration import lineage
from orchestration.reports import publish_eval_report
from orchestration.stages import PipelineContext


def run_online(ctx: PipelineContext, settings: PipelineSettings, prep: PrepParams, ppo: PipelinePPOConfig,
               evaluation: EvalParams, online: OnlineRLParams, need, run, outcomes: dict) -> dict:
    prep_outcome, sft = need("prep"), need("sft")
    policy = starting_policy(online.start_from, sft)
    seed = online.seed if online.seed is not None else zlib.crc32(ctx.parent_run_id.encode()) % 2**31
    values = _with_seed(ppo, seed)
    if online.reward == "verifier":
        if ppo.reward.sources:
            raise PipelineError(f"online.reward verifier: the `ppo` section names its own reward "
                                f"({', '.join(ppo.reward.sources)}); give one of them")
        values["reward"]["task"] = prep.task  # right or wrong by the task's verifier, not the reward model
    cfg = PipelinePPOConfig.model_validate(values)
    trained = outcomes["ppo-online"] = run(ppo_job(ctx, settings, prep, cfg, need, name="ppo-online",
                                                   actor_from=policy, reference_from=sft,
                                                   stop_on_hacking=online.stop_on_hacking))
    evaluated = outcomes["eval-online"] = run(eval_job(ctx, prep, evaluation, prep_outcome, {"ppo": trained}, sft,
                                                       need("rm"), name="eval-online"))
    report = publish_eval_report(evaluated, evaluation.promote_metric)
    value = policy_metric(evaluated.metrics, "ppo", evaluation.promote_metric)
    version = lineage.register_once("ppo", trained.output_uri, trained.manifest.get("mlflow_run_id") or trained.run_id)
    promoted, previous = lineage.promote(version.name, version.version, evaluation.promote_metric, value)
    stopped = trained.metrics.get("guard/stopped_step")
    return {"policy_in": policy.output_uri, "policy_out": trained.output_uri, "seed": seed,
            "metric": evaluation.promote_metric, "value": value, "previous_champion_value": previous,
            "promoted": promoted, "version": version.version, "markdown": report["markdown"],
            "stopped_on_hacking_at_step": None if stopped is None else int(stopped)}


def _with_seed(ppo: PipelinePPOConfig, seed: int) -> dict:
    values = ppo.model_dump(mode="json")
    values["train"]["seed"] = seed
    return values
