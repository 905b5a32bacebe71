"""When the RL stage evaluates during training, and on which held-out prompts (pure).

Evaluations during training serve the reward-hacking guard (`rl/guard.py`) and the choice of the
policy the stage publishes (the best by `--ckpt.best_metric_key`). Both read a held-out check, so
where one is watched (a verifier, `--eval.task`; a gold reward model, `--eval.reward_model_name_or_path`)
and `--eval.steps` is left at -1, the stage evaluates every tenth of the run. A policy chosen on
the prompts its results are reported on would report a number biased upwards by the choice, so
those evaluations take a selection share of the held-out prompts (`--eval.selection_fraction`)
and the evaluations before and after training, the reported ones, the rest.
"""

from __future__ import annotations

import math
import random

DEFAULT_EVALUATIONS = 10  # evaluations over a run when `--eval.steps` is left at -1 and a check is watched
MIN_SELECTION = 4  # held-out prompts a choice is made on, at least (fewer: no selection share)


def eval_every(steps: int, rollout_steps: int, watched: bool) -> int:
    """Steps between evaluations during training: `--eval.steps` where given (> 0); else, where a
    held-out check is watched, a tenth of the run (none in runs of fewer than ten steps); else 0
    (the evaluations before and after training only)."""
    if steps > 0:
        return steps
    return math.ceil(rollout_steps / DEFAULT_EVALUATIONS) if watched and rollout_steps >= DEFAULT_EVALUATIONS else 0


def selection_split(num_prompts: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(selection, report): the held-out prompt indices, a seeded `fraction` of them for selection
    and the rest for reporting, each in order. No selection (all reported) where it would hold fewer
    than `MIN_SELECTION` prompts or leave none to report on."""
    k = round(num_prompts * fraction)
    if k < MIN_SELECTION or k >= num_prompts:
        return [], list(range(num_prompts))
    order = list(range(num_prompts))
    random.Random(f"{seed}-selection").shuffle(order)
    return sorted(order[:k]), sorted(order[k:])


def responses_per_evaluation(prompts: int, metric: str, n_samples_per_prompt: int) -> int:
    """The responses an evaluation of `metric` on `prompts` prompts scores: one each for a greedy
    metric, `n_samples_per_prompt` each for a sampled one (the noise `beats_the_last` weighs)."""
    return prompts * (1 if "greedy" in metric else n_samples_per_prompt)


def beats_the_last(best: float, last: float, metric: str, samples: int,
                   spreads: tuple[float, float] | None = None) -> bool:
    """Whether the best evaluation beat the last one by more than their noise, so that publishing
    the best is a choice rather than a draw: by more than twice the standard error of the
    difference of two means over `samples` responses each. An accuracy's spread is its own
    (p(1 - p)); another metric's (a gold reward model's score) is `spreads`, the standard
    deviation of each evaluation's per-response values; without them, by anything at all."""
    if samples <= 0:
        return best > last
    if metric.endswith("_accuracy"):
        return best - last > 2 * math.sqrt((best * (1 - best) + last * (1 - last)) / samples)
    if spreads is None or any(s is None for s in spreads):
        return best > last
    return best - last > 2 * math.sqrt((spreads[0] ** 2 + spreads[1] ** 2) / samples)


def spread_of(metrics: dict[str, float], metric: str) -> float | None:
    """The per-response standard deviation an evaluation logged beside `metric` (`<metric>_std`)."""
    return metrics.get(f"{metric}_std")
