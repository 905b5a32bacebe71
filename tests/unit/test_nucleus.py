"""Top-k / top-p filtering (`algos/nucleus.py`): the rule, checked against a definition written
from scratch per row. That vLLM filters the same way is checked on its engine
(tests/integration/test_vllm_cpu.py: its `processed_logprobs` are this filter's log-probs)."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.algos.nucleus import filter_logits, filtering


def by_definition(row: torch.Tensor, top_k: int, top_p: float) -> set[int]:
    """The kept token ids of one row: the k largest (ties with the k-th kept), then the most likely
    tokens, in order, until their renormalised mass reaches top_p."""
    values = row.tolist()
    kept = range(len(values))
    if 0 < top_k < len(values):
        kth = sorted(values, reverse=True)[top_k - 1]
        kept = [i for i in kept if values[i] >= kth]
    probs = torch.softmax(torch.tensor([values[i] for i in kept], dtype=torch.float64), -1).tolist()
    chosen, mass = [], 0.0
    for p, i in sorted(zip(probs, kept, strict=True), reverse=True):
        if top_p < 1.0 and mass >= top_p - 1e-12:
            break
        chosen.append(i)
        mass += p
    return set(chosen)


CASES = [(-1, 1.0), (1, 1.0), (3, 1.0), (-1, 0.5), (-1, 0.9), (4, 0.7), (0, 0.3), (50, 0.95)]


@pytest.mark.parametrize("top_k, top_p", CASES)
def test_the_kept_tokens_are_the_top_k_then_the_nucleus(top_k, top_p):
    logits = torch.randn(6, 20, generator=torch.Generator().manual_seed(top_k + int(100 * top_p)))
    out = filter_logits(logits, top_k, top_p)
    for row, filtered in zip(logits, out, strict=True):
        assert set(filtered.isfinite().nonzero().squeeze(-1).tolist()) == by_definition(row, top_k, top_p)
        kept = filtered.isfinite()
        assert torch.equal(filtered[kept], row[kept]), "kept logits are unchanged"
    assert filtering(top_k, top_p) == (top_k > 0 or top_p < 1.0)


def test_off_is_the_logits_themselves_and_the_input_is_never_changed():
    logits = torch.randn(2, 3, 9)
    before = logits.clone()
    assert filter_logits(logits) is logits and filter_logits(logits, 0, 1.0) is logits
    filter_logits(logits, 2, 0.5)
    assert torch.equal(logits, before)
    assert filter_logits(logits, 2, 1.0).shape == logits.shape  # any leading dimensions
