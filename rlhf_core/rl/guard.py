"""The reward-hacking guard of the RL stage: the training reward rises while a held-out check falls.

A policy that learns to please its reward model (or a flawed reward function) rather than to solve
the task shows it in two numbers that part ways: the reward it is trained on keeps rising, and a
check the training never sees falls: the task's verifier on held-out prompts (`--eval.task`), or
a gold reward model, one other than the rewards trained against (`--eval.reward_model_name_or_path`).
`reward_hacking` (pure) reads a run's evaluations for that; `HackingGuard` keeps them as the run
goes (part of the RL checkpoint, so a resumed run keeps its window) and says when it fires. The
controller warns once, tags the MLflow run and, with `--eval.stop_on_hacking`, stops training.

Each evaluation is paired with the training reward of the policies around it: the mean
`rollout/reward_mean` of the steps since the evaluation before (for the evaluation before training,
the first step's rollout, sampled from the initial policy). A fall of the held-out check counts
where it is beyond the noise of two evaluations on that many responses (an accuracy's from its
own value; a gold reward model's from the spread of its scores, logged beside its mean): a run
trained against the task's own verifier, which cannot be hacked, fired on a fall of 2 responses
in 100 before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

from rlhf_core.rl.selection import beats_the_last, spread_of


@dataclass(frozen=True)
class Evaluation:
    step: int
    reward: float | None  # the training reward of the policies since the previous evaluation
    metric: float  # the held-out check (higher is better)
    spread: float | None = None  # the per-response standard deviation of a reward check (None: an accuracy)


@dataclass(frozen=True)
class Hacking:
    """Over the evaluations from `since_step` to `step`, the training reward rose by `reward_rise`
    while the held-out metric fell by `metric_drop`."""

    since_step: int
    step: int
    reward_rise: float
    metric_drop: float

    def message(self, metric: str) -> str:
        return (f"reward hacking: from step {self.since_step} to step {self.step} the training reward rose by "
                f"{self.reward_rise:.4g} while held-out {metric} fell by {self.metric_drop:.4g}")


def reward_hacking(evaluations: Sequence[Evaluation], window: int, min_drop: float, metric: str = "",
                   responses: int = 0) -> Hacking | None:
    """Pure: whether the last `window` evaluations after `evaluations[-window - 1]` show the training
    reward up (any rise) and the held-out metric down by at least `min_drop` (absolute) and, with
    `responses` responses an evaluation, by more than the noise of two such evaluations
    (`selection.beats_the_last`: twice the standard error of their difference); None
    while fewer than `window + 1` evaluations, or their rewards, are known."""
    if window < 1 or len(evaluations) < window + 1:
        return None
    first, last = evaluations[-window - 1], evaluations[-1]
    if first.reward is None or last.reward is None:
        return None
    rise, drop = last.reward - first.reward, first.metric - last.metric
    if rise > 0 and drop >= min_drop and (responses <= 0 or beats_the_last(
            first.metric, last.metric, metric, responses, (first.spread, last.spread))):
        return Hacking(first.step, last.step, rise, drop)
    return None


class HackingGuard:
    """A run's evaluations and the rewards between them; `evaluated` says when `reward_hacking` fires."""

    def __init__(self, metric: str, window: int, min_drop: float, responses: int = 0):
        self.metric, self.window, self.min_drop = metric, window, min_drop
        self.responses = responses  # of each evaluation: a drop must exceed their noise (0: not known)
        self.evaluations: list[Evaluation] = []
        self.rewards: list[float] = []  # rollout rewards since the last evaluation
        self.fired: Hacking | None = None  # the first detection (said once)

    def rollout(self, reward_mean: float) -> None:
        if self.evaluations and self.evaluations[-1].reward is None:  # the evaluation before training
            self.evaluations[-1] = replace(self.evaluations[-1], reward=reward_mean)
        self.rewards.append(reward_mean)

    def evaluated(self, step: int, metrics: dict[str, float]) -> Hacking | None:
        """Record an evaluation; returns the detection, if this one shows hacking (None also where
        the evaluation has no `metric`: no held-out check, no guard)."""
        if self.metric not in metrics:
            return None
        reward = sum(self.rewards) / len(self.rewards) if self.rewards else None
        self.rewards = []
        self.evaluations.append(Evaluation(step, reward, metrics[self.metric], spread_of(metrics, self.metric)))
        found = reward_hacking(self.evaluations, self.window, self.min_drop, self.metric, self.responses)
        if found is not None and self.fired is None:
            self.fired = found
        return found

    def state_dict(self) -> dict:
        return {"metric": self.metric, "evaluations": [asdict(e) for e in self.evaluations],
                "rewards": list(self.rewards), "fired": None if self.fired is None else asdict(self.fired)}

    def load_state_dict(self, state: dict | None) -> None:
        if not state or state.get("metric") != self.metric:  # a resume watching another metric starts afresh
            return
        self.evaluations = [Evaluation(**e) for e in state["evaluations"]]
        self.rewards = list(state["rewards"])
        self.fired = Hacking(**state["fired"]) if state.get("fired") else None
