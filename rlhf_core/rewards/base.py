"""The RL stage's batched reward interface (OpenRLHF's convention) and its output checks.

A `BatchRewardSource` is called once per rollout batch:

    source(queries, prompts, labels, **kwargs) -> RewardOutput

- `queries`: each prompt + response decoded WITH special tokens (what the policy saw and wrote),
- `prompts`: each formatted prompt text (chat template applied), a prefix of its query,
- `labels`: the dataset's label column (reference answers; None where there is none),
- kwargs the controller may add: `responses` (decoded, without the prompt; for verifiers) and
  `raw_prompts` (before formatting, so a reward model applies its own template). Sources ignore
  kwargs they do not use.

Every answer goes through `as_reward_output`: a `RewardOutput` of float32 CPU tensors `(B,)`, or a
`RewardError` naming the source, so a wrong length, non-number, NaN or inf never reaches an advantage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch


class RewardError(RuntimeError):
    """A reward source failed or answered something unusable; the message names the source."""


@dataclass
class RewardOutput:
    rewards: torch.Tensor  # (B,) float32: what advantages are computed from
    scores: torch.Tensor | None = None  # (B,) float32, usually in [0, 1]: dynamic filtering; defaults to rewards
    extra_logs: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (B,) values to log

    def __post_init__(self):
        if self.scores is None:
            self.scores = self.rewards

    def __len__(self) -> int:
        return len(self.rewards)


@runtime_checkable
class BatchRewardSource(Protocol):
    def __call__(self, queries: list[str], prompts: list[str], labels: list, **kwargs) -> RewardOutput: ...


def check_batch(queries: list, prompts: list, labels: list, where: str) -> int:
    """The batch size, or RewardError when the three columns differ in length."""
    n = len(queries)
    if len(prompts) != n or len(labels) != n:
        raise RewardError(f"{where}: {n} queries, {len(prompts)} prompts and {len(labels)} labels: "
                          "one of each per sample")
    return n


def to_vector(value: Any, n: int, what: str, where: str) -> torch.Tensor:
    """`value` (tensor, list/tuple of numbers, numpy array) as a float32 CPU tensor of shape (n,)."""
    if isinstance(value, (str, bytes, dict)) or value is None:
        raise RewardError(f"{where}: {what} must be a tensor or a list of {n} numbers, got {type(value).__name__}")
    try:
        if isinstance(value, torch.Tensor):
            t = value.detach().to("cpu", torch.float32)
        else:
            if isinstance(value, (list, tuple)) and any(isinstance(v, (str, bytes, type(None))) for v in value):
                raise TypeError("not a number")
            t = torch.as_tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as e:
        raise RewardError(f"{where}: {what} must be a tensor or a list of {n} numbers, "
                          f"got {type(value).__name__} ({e})") from None
    if t.dim() != 1 or t.numel() != n:
        raise RewardError(f"{where}: {what} has shape {tuple(t.shape)}, expected ({n},): one value per sample")
    bad = ~torch.isfinite(t)
    if bad.any():
        i = int(bad.nonzero()[0])
        raise RewardError(f"{where}: {what}[{i}] is {t[i].item()} (NaN or inf in {int(bad.sum())} of {n})")
    return t


def as_reward_output(value: Any, n: int, where: str) -> RewardOutput:
    """Check and convert a source's answer for a batch of `n`: a `RewardOutput`, a dict
    `{"rewards", "scores"?, "extra_logs"?}`, or bare rewards (tensor/list/numpy: older OpenRLHF's form)."""
    if isinstance(value, RewardOutput):
        value = {"rewards": value.rewards, "scores": value.scores, "extra_logs": value.extra_logs}
    if isinstance(value, dict):
        unknown = set(value) - {"rewards", "scores", "extra_logs"}
        if "rewards" not in value:
            raise RewardError(f"{where}: the returned dict has no 'rewards' (keys: {sorted(value)})")
        if unknown:
            raise RewardError(f"{where}: unknown keys {sorted(unknown)} in the returned dict "
                              "(expected rewards, scores, extra_logs)")
        rewards = to_vector(value["rewards"], n, "rewards", where)
        scores = value.get("scores")
        scores = rewards if scores is None else to_vector(scores, n, "scores", where)
        logs = value.get("extra_logs") or {}
        if not isinstance(logs, dict):
            raise RewardError(f"{where}: extra_logs must be a dict of name -> {n} values, got {type(logs).__name__}")
        extra = {}
        for k, v in logs.items():
            if not isinstance(k, str):
                raise RewardError(f"{where}: extra_logs key {k!r} is not a string")
            extra[k] = to_vector(v, n, f"extra_logs[{k!r}]", where)
        return RewardOutput(rewards, scores, extra)
    return RewardOutput(to_vector(value, n, "rewards", where))


def responses_from_queries(queries: list[str], prompts: list[str], where: str) -> list[str]:
    """Each response as its query minus the prompt it starts with (OpenRLHF's query = prompt + response)."""
    out = []
    for i, (q, p) in enumerate(zip(queries, prompts, strict=True)):
        if not isinstance(q, str) or not isinstance(p, str):
            raise RewardError(f"{where}: query and prompt {i} must be text")
        if not q.startswith(p):
            raise RewardError(f"{where}: query {i} does not start with its prompt; pass responses= "
                              "(the decoded responses) to score it")
        out.append(q[len(p):])
    return out
