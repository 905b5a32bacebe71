"""Rejection sampling (stage `rejection_sampling`) inside the `rlhf` flow: OpenRLHF's
rejection-sampling script as rounds of three jobs.

One round: `rlhf batch_inference --eval_task generate` samples `best_of_n` responses for each of
`n_prompts` training prompts from the current policy (round r takes the r-th window of prompts,
OpenRLHF's `--iter`) -> `rlhf batch_inference --eval_task rm --post_processor rs` scores them with the
run's reward model (or its process reward model, or the task's verifier) and keeps each prompt's best -> `rlhf train sft` of the
current policy on the kept rows (the `sft` section's recipe, at this stage's learning rate and
epochs). The next round starts from the policy the round trained. The last round's model is the
stage's policy (`rejection_sampling`): the evaluation compares it with the others, and it registers
an `rlhf-policy` version that becomes the champion when it beats the current one.

Each job names the one before it as its upstream (`policy`, `data`, `reward`), so lineage links
every round back to SFT.
"""

from __future__ import annotations

import zlib

from flows.jobs import PipelineError, driver_gpus, prep_paths, starting_policy, train_job
from flows.params import PipelineSettings, PrepParams, RejectionSamplingParams
from orchestration.stages import PipelineContext, StageJob, StageOutcome
from rlhf_core.config import SFTConfig, with_updates
from rlhf_core.data.synthetic import get_task
from rlhf_core.infra.manifests import params_hash

STAGE = "rejection_sampling"
# Fields that do not change what a round samples: `rounds` (raising it must not resample round 1),
# `start_from` (the policy is an upstream), the SFT settings (the training job's own key), `seed`
# (the round's seed is in the key) and `reward` (who scores the samples: the scoring job's key).
SAMPLING_NOT_IN_KEY = frozenset({"rounds", "start_from", "learning_rate", "max_epochs", "seed", "reward"})


def sampling_key(prep: PrepParams, params: RejectionSamplingParams, seed: int, round_: int) -> str:
    """The settings part of a round's sampling key (the policy and the prompts are upstream)."""
    return params_hash(params, exclude=SAMPLING_NOT_IN_KEY, task=prep.task, seed=seed, round=round_)


def scoring_key(prep: PrepParams, params: RejectionSamplingParams) -> str:
    """What a round's scoring depends on besides its samples and reward model: the reward source."""
    return params_hash(params, exclude=SAMPLING_NOT_IN_KEY - {"reward"} | {"n_prompts", "best_of_n", "temperature",
                                                                         "num_engines"},
                       task=prep.task)


def scorer_args(params: RejectionSamplingParams, reward: StageOutcome | None, prep: PrepParams) -> list[str]:
    """Who scores a round's samples: the reward model, the process reward model (each line of a sample
    a step, read at the placeholder it was trained with, on the plain prompt), or the verifier."""
    if params.reward == "verifier":  # right or wrong: a prompt with no right sample teaches nothing
        return ["--task", prep.task, "--min_reward", "1"]
    if params.reward == "prm":
        data = reward.manifest.get("config", {}).get("data", {})
        if not data.get("placeholder_token") or not data.get("reward_tokens"):
            raise PipelineError(f"{STAGE}: the process reward model {reward.output_uri} records no placeholder and "
                                "reward tokens in its stage.json; train it again (settings.force_stages: [prm])")
        return ["--pretrain", reward.output_uri, "--input_key", "prompt", "--placeholder_token",
                data["placeholder_token"], "--reward_tokens", *data["reward_tokens"]]
    return ["--pretrain", reward.output_uri]


def job_names(rounds: int) -> list[str]:
    """Every job's name, the last round's training job being the stage's own."""
    names = []
    for r in range(1, rounds + 1):
        names += [f"{STAGE}-generate-round{r}", f"{STAGE}-score-round{r}",
                  STAGE if r == rounds else f"{STAGE}-sft-round{r}"]
    return names


def run_rejection_sampling(ctx: PipelineContext, settings: PipelineSettings, prep: PrepParams, sft: SFTConfig,
                           params: RejectionSamplingParams, need, run, outcomes: dict) -> StageOutcome:
    prep_outcome = need("prep")
    reward = need({"reward_model": "rm", "prm": "prm"}[params.reward]) if params.reward != "verifier" else None
    policy = starting_policy(params.start_from, need("sft"))
    seed = params.seed if params.seed is not None else zlib.crc32(ctx.parent_run_id.encode()) % 2**31
    if STAGE in ctx.force:  # forcing the stage reruns all of its jobs, sampling included
        ctx.force = [*ctx.force, *job_names(params.rounds)]
    if params.n_prompts * params.rounds > prep.n_train:
        raise PipelineError(f"rejection_sampling: {params.rounds} rounds of {params.n_prompts} prompts need "
                            f"{params.n_prompts * params.rounds} training prompts, prep makes {prep.n_train} "
                            "(prep.n_train): fewer rounds or prompts per round, or more prompts")
    prompts = prep_paths(prep_outcome)["prompts"]
    track = ["--mlflow_experiment", ctx.experiment]
    for r in range(1, params.rounds + 1):
        generate_name, score_name, sft_name = job_names(params.rounds)[3 * (r - 1): 3 * r]
        out = ctx.output(generate_name)
        generated = outcomes[generate_name] = run(StageJob(
            "batch_inference", generate_name,
            ["batch_inference", "--eval_task", "generate", "--pretrain", policy.output_uri, "--dataset", prompts,
             "--input_key", "prompt", "--apply_chat_template", "--best_of_n", str(params.best_of_n),
             "--temperature", str(params.temperature), "--max_samples", str(params.n_prompts * r), "--iter",
             str(r - 1), "--rollout_batch_size", str(params.n_prompts), "--max_new_tokens",
             str(get_task(prep.task).new_tokens), "--num_engines", str(params.num_engines),
             "--seed", str(seed + r), "--save_path", out, "--mlflow_run_name", generate_name, *track],
            out, sampling_key(prep, params, seed + r, r), None, prompts, {"policy": policy, "data": prep_outcome},
            num_gpus=driver_gpus(ctx, params.num_engines)))

        out = ctx.output(score_name)
        scorer = scorer_args(params, reward, prep)
        upstream = {"data": generated, **({"reward": reward} if reward is not None else {})}
        scored = outcomes[score_name] = run(StageJob(
            "batch_inference", score_name,
            ["batch_inference", "--eval_task", "rm", *scorer, "--dataset", f"json@{generated.output_uri}",
             "--post_processor", "rs", "--save_path", out, "--mlflow_run_name", score_name, *track],
            out, scoring_key(prep, params), None, None, upstream, num_gpus=ctx.rollout_gpus))

        # The kept rows hold the prompt as the policy saw it (chat template applied): trained as it is.
        # The round's policy is the start and the run's area the output, whatever the `sft` section names.
        cfg = with_updates(sft, **{"pretrain": None, "save_path": None, "ckpt_path": None,
                                   "data.input_key": "input", "data.output_key": "output",
                                   "data.apply_chat_template": False, "data.input_template": None,
                                   "data.truncate": True, "adam.lr": params.learning_rate,
                                   "train.max_epochs": params.max_epochs})
        policy = outcomes[sft_name] = run(train_job(ctx, settings, cfg, need, name=sft_name, model_from=policy,
                                                    data_from=(scored, f"json@{scored.output_uri}")))
    return policy

