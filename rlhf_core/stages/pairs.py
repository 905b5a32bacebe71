"""Online / iterative DPO data (`rlhf pairs`): sample the current policy, score, pair best with worst.

Per prompt, `n_samples_per_prompt` responses are scored by a reward source (verifier or reward
model); the best becomes `chosen`, the worst `rejected` (first on ties: deterministic). A prompt
whose scores are all equal is skipped, and blank responses never count: the preference loaders
reject empty texts, and a DPO run must not fail on data this stage wrote.

The output holds `train.jsonl` (`prompt`, `chosen`, `rejected`, `chosen_score`, `rejected_score`;
prompts raw) and `stage.json`, published atomically, for `rlhf train dpo --dataset json@<save_path>`.
When no prompt gives a pair the stage fails (exit 2, NoPairsError), or with `--allow_no_pairs`
publishes an empty `train.jsonl` with `pairs/num_pairs` 0, for a flow that decides what follows.
"""

from __future__ import annotations

import dataclasses
import sys

from rlhf_core.config import PairsConfig, RewardSourceName
from rlhf_core.stages.batch_inference import best_and_worst, checked_window

# The share of prompts that gave a pair; the pipeline's report shows it (orchestration/reports.py).
PAIR_FRACTION = "pairs/pair_fraction"


class NoPairsError(RuntimeError):
    """Every prompt's samples scored the same: there is nothing to prefer."""


def build_pairs(prompts: list, responses_per_prompt: list[list[str]],
                scores_per_prompt: list[list[float]]) -> tuple[list[dict], int]:
    """(best, worst) pair per prompt, and how many prompts were skipped (all scores equal, or < 2 texts).

    Blank responses are never candidates. Rows: prompt, chosen, rejected, chosen_score, rejected_score.
    """
    if not len(prompts) == len(responses_per_prompt) == len(scores_per_prompt):
        raise ValueError(f"{len(prompts)} prompts, {len(responses_per_prompt)} response lists, "
                         f"{len(scores_per_prompt)} score lists")
    rows, skipped = [], 0
    for prompt, responses, scores in zip(prompts, responses_per_prompt, scores_per_prompt, strict=True):
        if len(responses) != len(scores):
            raise ValueError(f"{len(responses)} responses but {len(scores)} scores for prompt {prompt!r}")
        candidates = [(s, r) for r, s in zip(responses, scores, strict=True) if r.strip()]
        pair = best_and_worst(candidates, lambda c: c[0]) if candidates else None
        if pair is None:
            skipped += 1
            continue
        best, worst = pair
        rows.append({"prompt": prompt, "chosen": best[1], "rejected": worst[1], "chosen_score": best[0],
                     "rejected_score": worst[0]})
    return rows, skipped


def reward_source(cfg: PairsConfig):
    from rlhf_core.rewards import RewardModelReward, VerifierReward
    from rlhf_core.trainers.common import local_model_path

    if cfg.reward == RewardSourceName.VERIFIER:
        return VerifierReward(cfg.task)
    return RewardModelReward(local_model_path(cfg.reward_pretrain), cfg.apply_chat_template, cfg.normalize_reward)


def windowed(prompts, cfg: PairsConfig):
    """The prompts `--iter` takes (`batch_inference.prompt_window`): all of them without it."""
    window = checked_window(len(prompts.prompts), cfg)
    if len(window) == len(prompts.prompts):
        return prompts
    return dataclasses.replace(prompts, prompts=[prompts.prompts[i] for i in window],
                               answers=[prompts.answers[i] for i in window])


def run_pairs(cfg: PairsConfig) -> dict:
    """Sample, score and pair; publish `train.jsonl` + `stage.json` to `cfg.save_path`; returns the manifest."""
    from rlhf_core.infra import storage
    from rlhf_core.infra.publishing import publish_output
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rollout import load_prompt_set, make_engine, prompt_formatter
    from rlhf_core.rollout.stage import stage_run
    from rlhf_core.trainers.common import local_model_path

    cfg.check_complete()
    prompts = load_prompt_set(cfg.dataset, "train", cfg.input_key, cfg.label_key,
                              require_answers=cfg.reward == RewardSourceName.VERIFIER, max_samples=cfg.max_samples,
                              seed=cfg.seed, chat=cfg.apply_chat_template)
    prompts = windowed(prompts, cfg)
    with stage_run(cfg, prompts.sources) as tracker:
        policy_path = local_model_path(cfg.pretrain)
        tokenizer = load_tokenizer(policy_path)
        fmt = prompt_formatter(tokenizer, cfg.apply_chat_template)
        texts = [fmt.prompt_text(p) for p in prompts.prompts]
        if cfg.num_engines > 1:
            from rlhf_core.data.examples import prompt_token_ids
            from rlhf_core.rl.engines import generate_on_engines

            ids = [prompt_token_ids(tokenizer, t, cfg.apply_chat_template) for t in texts]
            groups = generate_on_engines(cfg.rollout_backend.value, policy_path, ids, cfg.n_samples_per_prompt, cfg.temperature,
                                         cfg.max_new_tokens, cfg.seed, cfg.num_engines)
            responses = [[tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in g] for g in groups]
        else:
            engine = make_engine(policy_path, cfg.rollout_backend.value, not cfg.apply_chat_template)
            groups = engine.generate(texts, cfg.n_samples_per_prompt, cfg.temperature, cfg.max_new_tokens, cfg.seed)
            engine.close()
            responses = [[c.text for c in group] for group in groups]
        n = cfg.n_samples_per_prompt
        flat = reward_source(cfg).score([p for p in prompts.prompts for _ in range(n)],
                                        [r for group in responses for r in group],
                                        [a for a in prompts.answers for _ in range(n)])
        scores = [flat[i * n : (i + 1) * n] for i in range(len(prompts))]
        rows, skipped = build_pairs(prompts.prompts, responses, scores)
        metrics = {"pairs/mean_reward": sum(flat) / len(flat), "pairs/num_pairs": len(rows),
                   PAIR_FRACTION: len(rows) / len(prompts), "pairs/num_skipped_prompts": skipped,
                   "pairs/mean_response_len": sum(len(c.token_ids) for g in groups for c in g) / len(flat)}
        print(f"[pairs] {len(rows)} pairs from {len(prompts)} prompts ({skipped} skipped: equal scores), mean "
              f"reward {metrics['pairs/mean_reward']:.4f}{'; published without rows (--allow_no_pairs)' if not rows else ''}",
              file=sys.stderr, flush=True)
        if not cfg.allow_no_pairs and not rows:  # the flag read first: every run reads each field
            raise NoPairsError(f"no preference pairs: all {n} samples of each of the {len(prompts)} prompts scored "
                               f"the same (mean reward {metrics['pairs/mean_reward']:.4f}); sample more "
                               "(--n_samples_per_prompt), raise --temperature, or use a reward model")
        text = storage.jsonl_text(rows)
        inputs = {"pretrain": cfg.pretrain, "reward_pretrain": cfg.reward_pretrain, "datasets": prompts.sources}
        return publish_output(cfg, tracker, inputs, metrics, files={"train.jsonl": text})
