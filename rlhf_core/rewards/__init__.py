"""Reward sources.

Per sample (eval, pairs): `score(prompts, responses, answers) -> list[float]`, prompts raw (each
source formats them as it was trained to), answers None where not needed.

Batched (the RL stage, OpenRLHF's convention; see `base`): `source(queries, prompts, labels,
**kwargs) -> RewardOutput`, from `build_reward_source`.

Names load on first use: the CLI's parser imports `rlhf_core.rewards.cli`, which must not bring torch.
"""

from __future__ import annotations

import importlib
from typing import Protocol


class RewardSource(Protocol):
    def score(self, prompts: list, responses: list[str], answers: list[str | None]) -> list[float]: ...


_WHERE = {
    "CombinedReward": "adapters", "RewardModelSource": "adapters", "VerifierSource": "adapters",
    "BatchRewardSource": "base", "RewardError": "base", "RewardOutput": "base", "as_reward_output": "base",
    "build_reward_source": "factory",
    "RankToken": "remote", "RemoteReward": "remote", "read_token": "remote", "token_for_ranks": "remote",
    "RewardFile": "reward_file", "load_reward_file": "reward_file",
    "RewardModelReward": "reward_model",
    "ProcessRewardModel": "process",
    "RewardServer": "server", "serve_reward": "server", "write_token_file": "server",
    "add_serve_rm_arguments": "cli", "serve_rm_main": "cli",
    "VerifierReward": "verifier",
}


def __getattr__(name: str):
    if name in _WHERE:
        value = getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["RewardSource", *sorted(_WHERE)]
