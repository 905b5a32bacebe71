"""Iterative (online) DPO rounds inside the `rlhf` flow.

One round: `rlhf pairs` samples several responses per training prompt from the current policy
and keeps (best, worst) by the verifier or the reward model -> `rlhf train dpo` from the current
policy (which is also its reference) on those pairs, at `iterative.learning_rate` -> `rlhf eval`
of the new policy against the SFT model -> registered as a new `rlhf-policy` version, promoted to
`champion` when the promote metric beats the champion's. The next round continues from the
champion.

The round's learning rate is its own: measured from the default pipeline's PPO champion (held-out
sampled accuracy 79.1%; benchmarks/README.md; a 2-core AMD EPYC, Zen 4 class, native bf16, `auto`
in bf16), the `dpo` section's 1e-4 (tuned from SFT) took the round to 72.5% at a KL of 0.31 to
SFT; 2e-5 held it at 78.5% (KL 0.17). Not measured in fp32 (a CPU without native bf16).

A run starts from the `champion` (else SFT, or SFT with `start_from: sft`). Sampling is seeded per
pipeline run unless `iterative.seed` pins it, and the seed also picks which window of `n_prompts`
training prompts a round samples (`prompt_window_index`), so scheduled runs draw fresh pairs on
other prompts. Each round's
stages name the previous policy as their upstream. A round that does not beat the champion ends
the run (`iterative.stop_early`), and the summary says why (`stopped_early`). So does a round whose
samples gave no pair (every prompt's samples scored alike, e.g. a policy the verifier never finds
right): nothing is trained or registered (with `stop_early: false` the next round samples again).
"""

from __future__ import annotations

import zlib

from flows.jobs import driver_gpus, eval_job, policy_metric, prep_paths, starting_policy, train_job
from flows.params import EvalParams, IterativeDPOParams, PipelineSettings, PrepParams
from orchestration import lineage
from orchestration.reports import publish_eval_report
from orchestration.stages import PipelineContext, StageJob
from rlhf_core.config import DPOConfig, with_updates
from rlhf_core.infra.manifests import params_hash

# Fields that do not change a round's pairs: `rounds` (raising it must not resample round 1),
# `start_from` (the policy is in the key as an upstream), `seed` (the round's seed is),
# `learning_rate` (the DPO's), `stop_early` (whether later rounds run). Every other field, present
# or future, is in the pairs cache key.
PAIRS_NOT_IN_KEY = frozenset({"rounds", "start_from", "seed", "learning_rate", "stop_early"})


def pairs_settings_hash(prep: PrepParams, iterative: IterativeDPOParams, round_seed: int) -> str:
    """The settings part of a pairs stage's cache key (policy, reward model and prompts are upstream)."""
    return params_hash(iterative, exclude=PAIRS_NOT_IN_KEY, task=prep.task, seed=round_seed)


def prompt_window_index(prep: PrepParams, iterative: IterativeDPOParams, round_seed: int) -> int:
    """Which window of `n_prompts` training prompts a round samples (`rlhf pairs --iter`): drawn by
    the round's seed, so scheduled runs (a fresh seed each) and the rounds of one run (seed + r)
    walk the training prompts rather than resampling the first `n_prompts` every time."""
    return round_seed % max(1, prep.n_train // iterative.n_prompts)


def run_rounds(ctx: PipelineContext, settings: PipelineSettings, prep: PrepParams, dpo: DPOConfig,
               evaluation: EvalParams, iterative: IterativeDPOParams, need, run, outcomes: dict) -> dict:
    prep_outcome, sft = need("prep"), need("sft")
    reward = need("rm") if iterative.reward == "reward_model" else None
    policy = starting_policy(iterative.start_from, sft)
    seed = iterative.seed if iterative.seed is not None else zlib.crc32(ctx.parent_run_id.encode()) % 2**31
    paths = prep_paths(prep_outcome)
    rounds, stopped = [], None
    for r in range(1, iterative.rounds + 1):
        name = f"pairs-round{r}"
        out = ctx.output(name)
        args = ["pairs", "--pretrain", policy.output_uri, "--dataset", paths["prompts"], "--task", prep.task,
                "--reward", iterative.reward, "--n_samples_per_prompt", str(iterative.n_samples_per_prompt),
                "--temperature", str(iterative.temperature),
                "--iter", str(prompt_window_index(prep, iterative, seed + r)), "--rollout_batch_size", str(iterative.n_prompts),
                "--num_engines", str(iterative.num_engines), "--allow_no_pairs",
                "--seed", str(seed + r), "--save_path", out, "--mlflow_experiment", ctx.experiment,
                "--mlflow_run_name", name]
        upstream = {"policy": policy, "data": prep_outcome}
        if reward is not None:
            args += ["--reward_pretrain", reward.output_uri]
            upstream["reward"] = reward
        pairs = outcomes[name] = run(StageJob("pairs", name, args, out, pairs_settings_hash(prep, iterative, seed + r),
                                              None, paths["prompts"], upstream,
                                              num_gpus=driver_gpus(ctx, iterative.num_engines)))

        if not pairs.metrics.get("pairs/num_pairs"):
            why = (f"round {r} made no preference pair: all {iterative.n_samples_per_prompt} samples of each of its "
                   f"{iterative.n_prompts} prompts scored alike by the {iterative.reward.replace('_', ' ')} (mean "
                   f"reward {pairs.metrics.get('pairs/mean_reward', float('nan')):.4f}), so DPO had nothing to learn "
                   f"from and the policy it started from stays ({policy.output_uri})")
            rounds.append({"round": r, "policy_in": policy.output_uri, "pairs": pairs.metrics, "trained": False,
                           "promoted": False, "skipped": why})
            if iterative.stop_early and r < iterative.rounds:
                stopped = (f"{why}: stopped after round {r} of {iterative.rounds} (iterative.stop_early: false samples "
                           "again in the next round)")
                break
            continue
        # Sampled responses may stop at max_new_tokens without EOS, a few tokens past the
        # prep data's lengths: truncate rather than fail a scheduled round on one long sample.
        trained = outcomes[f"dpo-round{r}"] = run(train_job(
            ctx, settings, with_updates(dpo, truncate=True, **{"adam.lr": iterative.learning_rate}), need,
            name=f"dpo-round{r}", model_from=policy,
            data_from=(pairs, f"json@{pairs.output_uri}"), eval_dataset=paths["preference"]))
        evaluated = outcomes[f"eval-round{r}"] = run(eval_job(ctx, prep, evaluation, prep_outcome, {"dpo": trained},
                                                              sft, reward, name=f"eval-round{r}"))
        report = publish_eval_report(evaluated, evaluation.promote_metric)
        value = policy_metric(evaluated.metrics, "dpo", evaluation.promote_metric)
        version = lineage.register_once("dpo", trained.output_uri, trained.manifest.get("mlflow_run_id")
                                        or trained.run_id)
        promoted, previous = lineage.promote(version.name, version.version, evaluation.promote_metric, value)
        rounds.append({"round": r, "policy_in": policy.output_uri, "policy_out": trained.output_uri,
                       "pairs": pairs.metrics, "metric": evaluation.promote_metric, "value": value,
                       "previous_champion_value": previous, "promoted": promoted, "version": version.version,
                       "markdown": report["markdown"]})
        if promoted:
            policy = trained
        elif iterative.stop_early and previous is not None and r < iterative.rounds:
            stopped = (f"round {r}'s policy ({evaluation.promote_metric} {value:.4f}) did not beat the champion "
                       f"({previous:.4f}), which stays; round {r + 1} would start again from the policy round {r} "
                       f"started from ({policy.output_uri}): stopped after round {r} of {iterative.rounds} "
                       "(iterative.stop_early: false runs every round)")
            break
    return {"rounds": rounds, "final_policy": policy.output_uri, "stopped_early": stopped}
