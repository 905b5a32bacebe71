"""`build_reward_source`: the reward of an RL run (PPO/GRPO) from its flags, as one batched source.

- `remote_url` ending in `.py`: a reward file (`load_reward_file`);
- `remote_url` http(s)://... (several comma-separated: the batch is shared between them): a
  `RemoteReward` client (token from RLHF_RM_TOKEN at call time);
- `model_paths` (one or more reward models, local or s3://): each a `RewardModelSource`, several
  summed by `CombinedReward` (OpenRLHF's default), or averaged with `reduce="mean"`;
- `task`: the built-in task's exact verifier (the call must carry `responses=`).

Exactly one of the three; anything else is a `ConfigError` naming the flags.
"""

from __future__ import annotations

import torch

from rlhf_core.infra.settings import ConfigError, state_dir
from rlhf_core.rewards.base import BatchRewardSource


def build_reward_source(model_paths: list[str] | str | None = None, remote_url: str | None = None,
                        task: str | None = None, *, reduce: str = "sum", apply_chat_template: bool = True,
                        normalize: bool = False, batch_size: int = 32, device: torch.device | None = None,
                        dtype: torch.dtype | None = None, timeout: float = 180.0, retries: int = 4,
                        backoff: float = 1.0, chunk_size: int | None = None) -> BatchRewardSource:
    if isinstance(model_paths, str):
        model_paths = model_paths.split(",")
    model_paths = [p.strip() for p in model_paths or [] if p.strip()]
    given = [name for name, v in (("--reward.model_name_or_path", model_paths), ("--reward.remote_url", remote_url),
                                  ("--task", task)) if v]
    if len(given) != 1:
        raise ConfigError("give exactly one reward: --reward.model_name_or_path DIR[,DIR...], "
                          "--reward.remote_url FILE.py|http(s)://HOST:PORT/get_reward, or --task NAME"
                          + (f" (got {' and '.join(given)})" if given else ""))
    if normalize and not model_paths:
        raise ConfigError("--normalize_reward applies to reward models (--reward.model_name_or_path)")
    if remote_url:
        return _remote(remote_url.strip(), timeout, retries, backoff, chunk_size)
    if task:
        from rlhf_core.rewards.adapters import VerifierSource

        try:
            return VerifierSource(task)
        except ValueError as e:
            raise ConfigError(f"--task: {e}") from None
    from rlhf_core.infra import storage
    from rlhf_core.rewards.adapters import CombinedReward, RewardModelSource
    from rlhf_core.rewards.reward_model import RewardModelReward

    if reduce not in ("sum", "mean"):
        raise ConfigError(f"reward reduce must be sum or mean, got {reduce!r}")
    sources = []
    for path in model_paths:
        local = storage.local_copy(path, state_dir() / "cache")
        try:
            rm = RewardModelReward(local, apply_chat_template, normalize, batch_size, device=device, dtype=dtype)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--reward.model_name_or_path {path}: {e}") from None
        sources.append(RewardModelSource(rm, name=f"reward model {path}"))
    return sources[0] if len(sources) == 1 else CombinedReward(sources, reduce)


def _remote(url: str, timeout: float, retries: int, backoff: float, chunk_size: int | None) -> BatchRewardSource:
    if url.endswith(".py"):
        from rlhf_core.rewards.reward_file import load_reward_file

        return load_reward_file(url)
    from rlhf_core.rewards.remote import RemoteReward

    try:
        return RemoteReward(url, timeout=timeout, retries=retries, backoff=backoff, chunk_size=chunk_size)
    except ValueError as e:
        raise ConfigError(f"--reward.remote_url: {e}") from None
