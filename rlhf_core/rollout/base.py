"""The generation interface every rollout engine implements, and where inference runs.

An engine takes prompts that are already formatted (chat template applied) and returns, per
prompt, `n` completions: the decoded text (special tokens stripped) and the response token ids
as sampled, up to and including the EOS token when one was generated. Callers that need exact
log-probs of what was sampled (KL, PPO) use the ids; callers that score or store text use the
text. Temperature 0 means greedy decoding; otherwise the model's own distribution at that
temperature, with no top-k/top-p shaping, so samples are draws from the policy itself.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]


class RolloutEngine(abc.ABC):
    @abc.abstractmethod
    def generate(self, prompts: list[str], n: int, temperature: float, max_new_tokens: int,
                 seed: int) -> list[list[Completion]]:
        """`n` completions for each already-formatted prompt: `[len(prompts)][n]`."""

    def close(self) -> None:  # noqa: B027 (optional hook: engines without memory to give back skip it)
        """Release the engine's memory (GPU memory above all) before another model loads."""


def check_request(n: int, temperature: float, max_new_tokens: int) -> None:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")


def inference_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def inference_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPU (models of real size fit next to each other); fp32 on CPU, where it is exact."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def cut_at_eos(token_ids: list[int], eos_ids: set[int]) -> list[int]:
    """The response up to and including its first EOS (what follows is padding)."""
    for i, t in enumerate(token_ids):
        if t in eos_ids:
            return token_ids[: i + 1]
    return token_ids
