"""`rlhf_sdpa`: matmul attention is SDPA's math, and the dispatch takes it only where it should."""

import json

import pytest
import torch
import torch.nn.functional as F

from rlhf_core.models import attention
from rlhf_core.models.loading import load_causal_lm


def _qkv(heads=4, kv_heads=4, q_len=12, k_len=12, batch=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, q_len, 8, generator=g, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads, k_len, 8, generator=g, dtype=dtype) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _packed_mask(lengths, batch=2):
    """Block-diagonal causal mask of samples packed into one row, as transformers builds it."""
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    return (causal & (ids[:, None] == ids[None, :]))[None, None].expand(batch, 1, -1, -1)


def _sdpa(q, k, v, mask, causal):
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    if mask is None and causal and q.shape[-2] != k.shape[-2]:  # SDPA's is_causal aligns to the first key
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(k.shape[-2] - q.shape[-2])
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
    return out.transpose(1, 2)


@pytest.mark.parametrize("case", ["packed", "causal", "kv_cache", "bidirectional", "gqa"])
def test_matmul_attention_matches_sdpa_in_fp32(case):
    kwargs = {"kv_cache": {"q_len": 3}, "gqa": {"heads": 4, "kv_heads": 2}}.get(case, {})
    mask = _packed_mask([5, 4, 3]) if case == "packed" else None
    causal = case != "bidirectional"
    q, k, v = _qkv(**kwargs)
    ours = attention.matmul_attention(q, k, v, mask, 8 ** -0.5, causal)
    grads = torch.autograd.grad(ours.square().sum(), (q, k, v))
    ref = _sdpa(q, k, v, mask, causal)
    ref_grads = torch.autograd.grad(ref.square().sum(), (q, k, v))
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _count_matmul_attention(monkeypatch) -> list:
    calls = []
    real = attention.matmul_attention
    monkeypatch.setattr(attention, "matmul_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


def _packed_inputs(lengths):
    ids = torch.randint(3, 40, (1, sum(lengths)), generator=torch.Generator().manual_seed(1))
    return ids, torch.cat([torch.arange(n) for n in lengths])[None]


def test_bf16_training_pass_on_short_rows_takes_matmul_attention_and_matches_sdpa(prepared, monkeypatch):
    from transformers import AutoModelForCausalLM

    ours = load_causal_lm(prepared["base"])
    assert ours.config._attn_implementation == attention.NAME
    plain = AutoModelForCausalLM.from_pretrained(prepared["base"], dtype=torch.float32, attn_implementation="sdpa")
    ids, pos = _packed_inputs([9, 14, 7])
    calls = _count_matmul_attention(monkeypatch)
    logits = {}
    for name, model in (("ours", ours), ("plain", plain)):
        with torch.autocast("cpu", torch.bfloat16):
            logits[name] = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()
    assert len(calls) == ours.config.num_hidden_layers  # every layer, ours only
    # Same attention up to bf16 rounding; a leak across the packed samples would move logits by far more.
    torch.testing.assert_close(logits["ours"], logits["plain"], atol=0.05, rtol=0.02)
    second_alone = plain(input_ids=ids[:, 9:23], use_cache=False).logits
    assert (logits["ours"][0, 9:23] - second_alone[0]).abs().max() < 0.05


def test_sdpa_keeps_what_it_does_well(prepared, monkeypatch):
    """fp32, forward-only passes and rows longer than SHORT_ROWS stay on SDPA."""
    model = load_causal_lm(prepared["base"])
    calls = _count_matmul_attention(monkeypatch)
    ids, pos = _packed_inputs([9, 14])
    model(input_ids=ids, position_ids=pos, use_cache=False)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        model(input_ids=ids, position_ids=pos, use_cache=False)
    long_ids, long_pos = _packed_inputs([attention.SHORT_ROWS // 2 + 1] * 2)
    assert long_ids.shape[1] > attention.SHORT_ROWS
    with torch.autocast("cpu", torch.bfloat16):
        model(input_ids=long_ids, position_ids=long_pos, use_cache=False)
    assert calls == []


def test_saved_models_do_not_name_our_attention(prepared, tmp_path):
    model = load_causal_lm(prepared["base"])
    model.save_pretrained(tmp_path)
    assert attention.NAME not in (tmp_path / "config.json").read_text()
    assert "attn_implementation" not in json.loads((tmp_path / "config.json").read_text())
