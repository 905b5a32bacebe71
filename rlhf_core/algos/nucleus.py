"""Top-k and top-p (nucleus) filtering of logits: the distribution a rollout samples from.

`filter_logits(logits, top_k, top_p)` keeps, per row, the `top_k` largest logits (every logit equal
to the k-th is kept too), then, of what is left, the smallest set of the most likely tokens whose
probability (renormalised over the kept ones) reaches `top_p`: a token is dropped when the total
probability of the tokens below it and itself is at most `1 - top_p`; the most likely token is
always kept. Everything dropped becomes `-inf`, so `log_softmax` of the result is the processed
distribution, renormalised over the kept tokens. This is vLLM's rule (`apply_top_k_top_p`: top-k,
then top-p on the top-k distribution), so both engines sample, and report log-probs of, the same
distribution for the same logits (docs/sampling.md).

`top_k <= 0` and `top_p >= 1` are off. Pure tensor functions; no model, no I/O.
"""

from __future__ import annotations

import torch
from torch import Tensor


def filtering(top_k: int, top_p: float) -> bool:
    """Whether `(top_k, top_p)` drop anything at all."""
    return top_k > 0 or top_p < 1.0


def filter_logits(logits: Tensor, top_k: int = -1, top_p: float = 1.0) -> Tensor:
    """`logits (..., vocab)` with the tokens outside the top-k / top-p set at `-inf` (a new tensor;
    the input is unchanged). Logits already at `-inf` stay there."""
    if not filtering(top_k, top_p):
        return logits
    vocab = logits.shape[-1]
    if top_k > 0 and top_k < vocab and top_p >= 1.0:  # top-k alone: no sort of the whole vocabulary
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        return logits.masked_fill(logits < kth, float("-inf"))
    ordered, order = logits.sort(dim=-1)  # ascending
    if 0 < top_k < vocab:
        kth = ordered[..., vocab - top_k : vocab - top_k + 1]
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_p < 1.0:
        below = ordered.softmax(dim=-1, dtype=torch.float32).cumsum(dim=-1) <= 1.0 - top_p
        below[..., -1] = False  # the most likely token stays
        ordered = ordered.masked_fill(below, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)
