"""A trained process reward model (`rlhf train prm`) as a scorer of responses written in steps.

Each (prompt, response) becomes the text the PRM learnt on (`data/steps.prm_text`: the prompt, then
each line of the response followed by the placeholder token), tokenized as it is. A step's score is
the probability of the first reward token (a right step) against the others at its placeholder,
as OpenRLHF's PRMLoss trains it; a response's score is its weakest step's (`aggregate`), since one
wrong step spoils what follows. A response with no step scores 0.
"""

from __future__ import annotations

import contextlib
import math

import torch

from rlhf_core.data.steps import prm_text
from rlhf_core.data.token_budget import budget_chunks
from rlhf_core.rollout.base import inference_device, inference_dtype

AGGREGATE = {"min": min, "prod": math.prod, "last": lambda s: s[-1], "mean": lambda s: sum(s) / len(s)}


def aggregate(step_scores: list[float], how: str = "min") -> float:
    """One score for a response from its steps' (0 without steps); `how` one of STEP_AGGREGATES."""
    return float(AGGREGATE[how](step_scores)) if step_scores else 0.0


class ProcessRewardModel:
    def __init__(self, tokenizer, model, placeholder_token: str, reward_tokens: list[str], batch_size: int = 32,
                 max_len: int | None = None, forward_context=contextlib.nullcontext, max_tokens: int | None = None):
        """A loaded PRM (`load` loads one). `reward_tokens`: two or more (the config checks it), the
        first meaning a right step. `max_len`: longer texts keep their first tokens, and the steps
        whose placeholder is among them. `forward_context`: entered around each forward (autocast).
        `max_tokens`: each forward takes consecutive texts whose padded batch (rows x the longest)
        stays within that many tokens (a longer text alone) instead of `batch_size` texts."""
        from rlhf_core.data.examples import single_token_id

        self.tokenizer, self.model = tokenizer, model
        self.placeholder_token = placeholder_token
        self.placeholder = single_token_id(tokenizer, placeholder_token, "--placeholder_token")
        self.reward_ids = [single_token_id(tokenizer, t, "--reward_tokens") for t in reward_tokens]
        self.batch_size, self.max_len, self.forward_context = batch_size, max_len, forward_context
        self.max_tokens = max_tokens

    @classmethod
    def load(cls, path: str, placeholder_token: str, reward_tokens: list[str], batch_size: int = 32,
             max_len: int | None = None, device: torch.device | None = None, dtype: torch.dtype | None = None,
             use_fast: bool = True) -> ProcessRewardModel:
        from rlhf_core.models.loading import load_causal_lm, load_tokenizer

        device = device or inference_device()
        model = load_causal_lm(path, dtype=dtype or inference_dtype(device)).to(device).eval()
        return cls(load_tokenizer(path, use_fast=use_fast), model, placeholder_token, reward_tokens, batch_size,
                   max_len)

    def texts(self, prompts: list[str], responses: list[str]) -> list[str]:
        return [prm_text(p, r, self.placeholder_token) for p, r in zip(prompts, responses, strict=True)]

    @torch.no_grad()
    def step_scores(self, prompts: list[str], responses: list[str]) -> list[list[float]]:
        """P(right) at each step's placeholder, per response: the read `rlhf train prm` trains
        (`forward.position_logits` at the placeholders only, the LM head nowhere else)."""
        from rlhf_core.data.batching import pad_batch
        from rlhf_core.models.forward import position_logits, response_index

        seqs = [self.tokenizer(t, add_special_tokens=False)["input_ids"][: self.max_len]
                for t in self.texts(prompts, responses)]
        device = next(self.model.parameters()).device
        out: list[list[float]] = []
        for chunk in self.chunks(seqs):
            marks = [[int(t == self.placeholder) for t in s] for s in chunk]
            batch = pad_batch(chunk, marks, self.tokenizer.pad_token_id).to(device)
            index, mask = response_index(batch)  # each response's placeholders, in order
            with self.forward_context():
                logits = position_logits(self.model, batch, index[mask.bool()])
            right = torch.softmax(logits[:, self.reward_ids].float(), dim=-1)[:, 0].tolist()
            for n in (sum(m) for m in marks):
                out.append(right[:n])
                right = right[n:]
        return out


    def chunks(self, seqs: list[list[int]]) -> list[list[list[int]]]:
        """The forwards' batches, in order: `batch_size` texts, or by `max_tokens` padded tokens."""
        if self.max_tokens is None:
            return [seqs[i : i + self.batch_size] for i in range(0, len(seqs), self.batch_size)]
        return [[seqs[i] for i in run] for run in budget_chunks(list(map(len, seqs)), self.max_tokens, padded=True)]


def step_end_tokens(decode, response_ids: list[int]) -> list[int]:
    """Where each step of a sampled response ends, as indices into `response_ids`: the token that
    writes the newline closing a step (a non-empty line, as `data.steps.split_steps` reads them),
    and the response's last token for the last step, so a step reward lands where its step is
    complete and the last one where an outcome reward would. `decode(ids)`: the tokenizer's text
    of `ids`, without special tokens.

    Only tokens whose own text holds a newline can close a line; the prefix ending at each of them
    is decoded to count the lines before it exactly (a token's own text need not be its text in
    context)."""
    if not response_ids:
        return []
    lines = decode(response_ids).split("\n")
    steps = [i for i, line in enumerate(lines) if line.strip()]
    closing = []  # closing[j]: the token that writes newline j
    for k, token in enumerate(response_ids):
        if "\n" in decode([token]):
            closing += [k] * (decode(response_ids[: k + 1]).count("\n") - len(closing))
    last = len(response_ids) - 1
    return [closing[i] if i < len(closing) and i != steps[-1] else last for i in steps]
