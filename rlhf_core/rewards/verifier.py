"""Rule-based rewards: a built-in task's exact verifier (1.0 for the right answer, else 0.0)."""

from __future__ import annotations

from rlhf_core.data.synthetic import get_task


class VerifierReward:
    def __init__(self, task_name: str):
        self.task = get_task(task_name)

    def score(self, prompts: list, responses: list[str], answers: list[str | None]) -> list[float]:
        if len(responses) != len(answers):
            raise ValueError(f"{len(responses)} responses for {len(answers)} answers")
        if any(a is None for a in answers):
            raise ValueError(f"the {self.task.name} verifier needs a reference answer for every prompt")
        return [self.task.score(r, a) for r, a in zip(responses, answers, strict=True)]
