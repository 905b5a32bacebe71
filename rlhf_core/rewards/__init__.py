"""Reward sources.

Per sample (eval, pairs): `score(prompts, responses, answers) -> list[float]`. Prompts are raw
(each source formats them as it was trained to), responses are decoded text, answers are the
reference answers (None where a source does not need them). Built-in verifiers check answers
exactly; reward models score the formatted conversation at its last token.

Batched (the RL stage, OpenRLHF's convention; see `base`): `source(queries, prompts, labels,
**kwargs) -> RewardOutput`, built by `build_reward_source` from a reward file, a remote reward
server (`rlhf serve-rm`), reward models or a task verifier.
"""

from __future__ import annotations

from typing import Protocol

from rlhf_core.rewards.adapters import CombinedReward, RewardModelSource, VerifierSource
from rlhf_core.rewards.base import BatchRewardSource, RewardError, RewardOutput, as_reward_output
from rlhf_core.rewards.factory import build_reward_source
from rlhf_core.rewards.remote import RankToken, RemoteReward, read_token, token_for_ranks
from rlhf_core.rewards.reward_file import RewardFile, load_reward_file
from rlhf_core.rewards.reward_model import RewardModelReward
from rlhf_core.rewards.server import RewardServer, add_serve_rm_arguments, serve_reward, serve_rm_main
from rlhf_core.rewards.verifier import VerifierReward


class RewardSource(Protocol):
    def score(self, prompts: list, responses: list[str], answers: list[str | None]) -> list[float]: ...


__all__ = ["BatchRewardSource", "CombinedReward", "RankToken", "RemoteReward", "RewardError", "RewardFile",
           "RewardModelReward", "RewardModelSource", "RewardOutput", "RewardServer", "RewardSource",
           "VerifierReward", "VerifierSource", "add_serve_rm_arguments", "as_reward_output",
           "build_reward_source", "load_reward_file", "read_token", "serve_reward", "serve_rm_main",
           "token_for_ranks"]
