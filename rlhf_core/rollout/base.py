"""The generation interface every rollout engine implements, and where inference runs.

`generate_ids` takes prompt token ids and returns, per prompt, `n` `Sample`s: response ids as
sampled (through EOS, if generated) and the engine's log-prob of each under the distribution it
was drawn from, which RL compares with the trainer's own. `max_new_tokens` is one budget for every
prompt or one per prompt (an agent's episodes each have their own room left; each stops at its
own). `generate` is its text view (`rlhf eval`, `rlhf pairs`). Temperature 0 is greedy;
otherwise the model's distribution at that temperature, filtered by `top_k` / `top_p` where they
are set (`algos/nucleus.py`: vLLM's rule, in both engines) and renormalised; off by default, so
samples are draws from the policy itself. A policy's engine also takes
new weights (`update_weights`) and frees its memory while the trainer runs (`sleep` / `wake_up`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class Sample:
    """One sampled response: its token ids, the engine's log-prob of each, whether it ended with EOS."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finished: bool


Budget = int | Sequence[int]  # new tokens at most: for every prompt, or per prompt


def token_budgets(max_new_tokens: Budget, n_prompts: int) -> list[int]:
    """Each prompt's budget (pure): one number for all, or the per-prompt list checked for length."""
    if isinstance(max_new_tokens, int):
        return [max_new_tokens] * n_prompts
    budgets = [int(m) for m in max_new_tokens]
    if len(budgets) != n_prompts:
        raise ValueError(f"max_new_tokens: {len(budgets)} budgets for {n_prompts} prompts")
    return budgets


def budget_slice(max_new_tokens: Budget, indices) -> Budget:
    """The budget of some prompts (by their indices): the same number, or their entries."""
    return max_new_tokens if isinstance(max_new_tokens, int) else [max_new_tokens[i] for i in indices]


class RolloutEngine(abc.ABC):
    tokenizer: object
    add_special_tokens: bool  # a raw prompt gets the tokenizer's special tokens; a chat template writes its own

    @abc.abstractmethod
    def generate_ids(self, prompt_ids: list[list[int]], n: int, temperature: float, max_new_tokens: Budget,
                     seed: int, top_k: int = -1, top_p: float = 1.0) -> list[list[Sample]]:
        """`n` samples for each prompt (token ids): `[len(prompt_ids)][n]`."""

    def generate(self, prompts: list[str], n: int = 1, temperature: float = 0.0, max_new_tokens: int = 64,
                 seed: int = 0) -> list[list[Completion]]:
        """`n` completions for each already-formatted prompt: `[len(prompts)][n]`."""
        ids = [self.tokenizer(p, add_special_tokens=self.add_special_tokens)["input_ids"] for p in prompts]
        return [[Completion(self.tokenizer.decode(s.token_ids, skip_special_tokens=True), s.token_ids) for s in group]
                for group in self.generate_ids(ids, n, temperature, max_new_tokens, seed)]

    @abc.abstractmethod
    def update_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load the policy's current weights (names as in its Hugging Face `state_dict`)."""

    def sleep(self) -> None:  # noqa: B027 (engines with nothing to release keep the default)
        """Give the engine's accelerator memory back while the trainer runs (no-op where there is none)."""

    def wake_up(self) -> None:  # noqa: B027
        """Take the memory back before the next generation."""

    def close(self) -> None:  # noqa: B027 (optional hook: engines without memory to give back skip it)
        """Release the engine's memory (GPU memory above all) before another model loads."""


def check_request(n_prompts: int, n: int, temperature: float, max_new_tokens: Budget, top_k: int = -1,
                  top_p: float = 1.0) -> list[int]:
    """Refuses a request no engine can answer; returns each of the `n_prompts` prompts' budget."""
    budgets = token_budgets(max_new_tokens, n_prompts)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if min(budgets, default=1) < 1 or (isinstance(max_new_tokens, int) and max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < -1:
        raise ValueError(f"top_k must be -1 (off), 0 (off) or >= 1, got {top_k}")
    return budgets


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
