"""`rlhf_sdpa`: matmul attention is SDPA's math, and the dispatch takes it only where it should."""


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
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None)
    return out.transpose(1, 2)


@pytest.mark.parametrize("case", ["packed", "causal", "bidirectional", "gqa"])
def test_matmul_attention_matches_sdpa_in_fp32(case):
    kwargs = {"gqa": {"heads": 4, "kv_heads": 2}}.get(case, {})
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


def test_sdpa_keeps_what_matmul_attention_would_not_reproduce_or_speed_up():
    q, k, _ = _qkv(q_len=12, k_len=12, dtype=torch.bfloat16)
    short_mask = _packed_mask([5, 7])
    assert attention.uses_matmul_attention(q, k, short_mask) and attention.uses_matmul_attention(q, k, None)
    with torch.no_grad():  # grad mode never matters: a frozen reference runs the policy's kernel
        assert attention.uses_matmul_attention(q.detach(), k.detach(), short_mask)
    q32, k32, _ = _qkv(dtype=torch.float32)
    assert not attention.uses_matmul_attention(q32, k32, short_mask)  # fp32: SDPA is faster
    with torch.autocast("cpu", torch.bfloat16):
        assert attention.uses_matmul_attention(q32, k32, short_mask)  # autocast decides the dtype
    assert not attention.uses_matmul_attention(q, k, torch.zeros(2, 1, 12, 12, dtype=torch.bfloat16))  # may hold biases
    q3, k20, _ = _qkv(q_len=3, k_len=20, dtype=torch.bfloat16)
    assert not attention.uses_matmul_attention(q3, k20, None)  # SDPA aligns its causal mask specially here
    assert not attention.uses_matmul_attention(q, k, short_mask, softcap=30.0)
    long_q, long_k, _ = _qkv(q_len=attention.SHORT_ROWS + 1, k_len=attention.SHORT_ROWS + 1, batch=1,
                             dtype=torch.bfloat16)
    assert not attention.uses_matmul_attention(long_q, long_k, None)


def test_a_frozen_copy_gives_a_log_ratio_of_exactly_zero(prepared):
    """Policy (grad) and reference (no grad) of the same weights run the same kernel: DPO, KTO and
    PPO start from log-ratios of exactly 0."""
    from rlhf_core.data.batching import pack_batch
    from rlhf_core.models.forward import sequence_logprobs

    model = load_causal_lm(prepared["base"])
    seqs = [list(range(3, 3 + n)) for n in (9, 14, 7)]
    batch = pack_batch(seqs, [[1] * len(s) for s in seqs])
    with torch.autocast("cpu", torch.bfloat16):
        policy = sequence_logprobs(model, batch)
        with torch.no_grad():
            reference = sequence_logprobs(model, batch)
    assert policy.requires_grad and torch.equal(policy.detach(), reference)


def test_gemma2_soft_capping_is_applied_where_transformers_sdpa_drops_it():
    """Gemma-2 caps attention logits (`softcap`); transformers' SDPA function ignores the option, so
    `rlhf_sdpa` takes matmul attention with the cap: the same logits as transformers' eager attention
    (what vLLM computes too), not SDPA's uncapped ones."""
    from rlhf_core.models.families import build_family_model, get_family, train_family_tokenizer

    family = get_family("gemma")
    tok = train_family_tokenizer(family, ["sort: QWERTY", "EQRTWY"] * 20, 300)
    model = build_family_model(family, tok, seed=0).eval()
    with torch.no_grad():  # attention logits of +-hundreds: the cap of 50 decides the softmax
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(40.0)
            layer.self_attn.k_proj.weight.mul_(40.0)
    ids = torch.tensor([tok("sort: QWERTY EQRTWY", add_special_tokens=False)["input_ids"]])
    logits = {}
    for impl in ("eager", "sdpa", attention.register()):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            logits[impl] = model(ids).logits
    assert torch.allclose(logits[attention.NAME], logits["eager"], atol=1e-5)
    assert (logits["sdpa"] - logits["eager"]).abs().max() > 1e-2  # the cap matters here: the test can fail
