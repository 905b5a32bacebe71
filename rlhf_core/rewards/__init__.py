"""Reward sources behind one interface: `score(prompts, responses, answers) -> list[float]`.

Prompts are raw (each source formats them as it was trained to), responses are decoded text,
answers are the reference answers (None where a source does not need them). Built-in verifiers
check answers exactly; reward models score the formatted conversation at its last token.
"""

from __future__ import annotations

from typing import Protocol

from rlhf_core.rewards.reward_model import RewardModelReward
from rlhf_core.rewards.verifier import VerifierReward


class RewardSource(Protocol):
    def score(self, prompts: list, responses: list[str], answers: list[str | None]) -> list[float]: ...


__all__ = ["RewardModelReward", "RewardSource", "VerifierReward"]
