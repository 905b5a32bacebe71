"""The per-sample reward sources (`score(prompts, responses, answers)`) as batched RL sources,
and several sources combined into one.

- `VerifierSource`: needs `responses=` (decoded, special tokens skipped); labels are the answers.
- `RewardModelSource`: with `raw_prompts=` and `responses=`, scores exactly the tokens its trainer
  built (its own chat template); without them (a batch over HTTP), the formatted prompt as it is
  and the response as query minus prompt, as OpenRLHF's reward server does.
- `CombinedReward`: several reward models, summed as in OpenRLHF (or averaged); each source's
  rewards are also logged as `extra_logs["reward_{i}"]`.
"""

from __future__ import annotations

import torch

from rlhf_core.rewards.base import (
    RewardError,
    RewardOutput,
    as_reward_output,
    check_batch,
    responses_from_queries,
)
from rlhf_core.rewards.reward_model import RewardModelReward
from rlhf_core.rewards.verifier import VerifierReward


def _responses(kwargs: dict, n: int, where: str) -> list[str] | None:
    responses = kwargs.get("responses")
    if responses is not None and len(responses) != n:
        raise RewardError(f"{where}: {len(responses)} responses for {n} queries")
    return None if responses is None else list(responses)


class VerifierSource:
    def __init__(self, verifier: VerifierReward | str):
        self.verifier = VerifierReward(verifier) if isinstance(verifier, str) else verifier
        self.name = f"the {self.verifier.task.name} verifier"

    def __call__(self, queries: list[str], prompts: list[str], labels: list, **kwargs) -> RewardOutput:
        n = check_batch(queries, prompts, labels, self.name)
        responses = _responses(kwargs, n, self.name)
        if responses is None:
            raise RewardError(f"{self.name}: needs responses= (the decoded responses without special tokens)")
        try:
            values = self.verifier.score(list(prompts), responses, [None if a is None else str(a) for a in labels])
        except ValueError as e:
            raise RewardError(f"{self.name}: {e}") from None
        return as_reward_output(values, n, self.name)

    def __repr__(self) -> str:
        return f"VerifierSource({self.verifier.task.name!r})"


class RewardModelSource:
    def __init__(self, model: RewardModelReward, name: str = "reward model"):
        self.model = model
        self.name = name

    def __call__(self, queries: list[str], prompts: list[str], labels: list, **kwargs) -> RewardOutput:
        n = check_batch(queries, prompts, labels, self.name)
        responses = _responses(kwargs, n, self.name)
        raw = kwargs.get("raw_prompts")
        if raw is not None:
            if responses is None:
                raise RewardError(f"{self.name}: raw_prompts= needs responses= as well")
            if len(raw) != n:
                raise RewardError(f"{self.name}: {len(raw)} raw_prompts for {n} queries")
            seqs = self.model.sequences(list(raw), responses)
        else:
            if responses is None:
                responses = self._responses_from_queries(queries, prompts)
            seqs = self.model.sequences_from_text(list(prompts), responses)
        return as_reward_output(self.model.score_sequences(seqs), n, self.name)

    def _responses_from_queries(self, queries: list[str], prompts: list[str]) -> list[str]:
        responses = responses_from_queries(queries, prompts, self.name)
        tok = self.model.tokenizer
        pad = tok.pad_token if tok.pad_token and tok.pad_token != tok.eos_token else None
        if pad:  # a padded decode: the response ends at its EOS (kept: it is the scored token)
            responses = [_strip_suffix(r, pad) for r in responses]
        return responses

    def __repr__(self) -> str:
        return f"RewardModelSource({self.name!r})"


def _strip_suffix(text: str, suffix: str) -> str:
    while text.endswith(suffix):
        text = text[: -len(suffix)]
    return text


class CombinedReward:
    """Several sources as one: rewards (and scores) summed, or averaged with `reduce="mean"`."""

    def __init__(self, sources: list, reduce: str = "sum"):
        if not sources:
            raise ValueError("CombinedReward needs at least one source")
        if reduce not in ("sum", "mean"):
            raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")
        self.sources, self.reduce = list(sources), reduce

    def __call__(self, queries: list[str], prompts: list[str], labels: list, **kwargs) -> RewardOutput:
        n = check_batch(queries, prompts, labels, "combined reward")
        outs = [as_reward_output(s(queries, prompts, labels, **kwargs), n, repr(s)) for s in self.sources]
        combine = (lambda ts: torch.stack(ts).sum(0)) if self.reduce == "sum" else (lambda ts: torch.stack(ts).mean(0))
        logs = {}
        for i, o in enumerate(outs):
            logs[f"reward_{i}"] = o.rewards
            logs.update({f"reward_{i}/{k}": v for k, v in o.extra_logs.items()})
        return RewardOutput(combine([o.rewards for o in outs]), combine([o.scores for o in outs]), logs)

    def __repr__(self) -> str:
        return f"CombinedReward({self.sources!r}, reduce={self.reduce!r})"
