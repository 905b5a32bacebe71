"""The lean Llama forward (`models/lean.py`) for the supervised passes (SFT, DPO, KTO): hidden
states only where a loss token is predicted.

In the last layer, a position that predicts no loss token is needed only for its keys and values:
its output projection, MLP, final norm and LM head are dead work. `selected_hidden` runs every
layer's attention over all positions, then gathers the selected positions and runs the rest of
the last layer, the norm and the head on those alone. Rows are independent after the gather, so
the values equal the full forward's up to matmul rounding (tests/unit/test_lean_train.py
compares log-probs and gradients with transformers).

`lean_model` decides where the lean forward applies (plain Llama, no LoRA, no gradient
checkpointing, no ZeRO-3...); callers fall back to transformers' forward elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rlhf_core.models.attention import batch_mask
from rlhf_core.models.lean import LeanLlama, _no_autocast, additive


def selected_hidden(lean: LeanLlama, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    attention_mask: torch.Tensor | None, select: torch.Tensor) -> torch.Tensor:
    """The final-normed hidden states at the flat positions `select` (into `rows * T`) of a
    training batch: `(len(select), hidden)`, what `LlamaModel(...).last_hidden_state` holds there."""
    device = input_ids.device
    act, mm = lean.dtypes(device)
    mask = batch_mask(attention_mask, position_ids)
    # fp32: SDPA, as transformers' forward (`rlhf_sdpa` hands fp32 to it), and the faster kernel
    # there. Half precision: matmul attention (SDPA's CPU backward is slow: models/attention.py).
    bias = None if mm == torch.float32 else additive(mask, mm)
    with _no_autocast(device):
        w = lean.weights(mm)
        cos, sin = lean.rotary(position_ids, act)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        h = F.embedding(input_ids, w.embed)
        *body, last = w.layers
        for layer in body:
            out = _attention_block(lean, h, layer, cos, sin, mask, bias, mm)
            h = _mlp_block(lean, h + F.linear(out, layer.o), layer, mm)
        b, t, _ = h.shape
        out = _attention_block(lean, h, last, cos, sin, mask, bias, mm).reshape(b * t, -1)[select]
        h = _mlp_block(lean, h.reshape(b * t, -1)[select] + F.linear(out, last.o), last, mm)
        return lean.norm(h, w.norm)


def _attention_block(lean: LeanLlama, h: torch.Tensor, w, cos, sin, mask, bias, mm) -> torch.Tensor:
    """A decoder layer's attention on `h (B, T, hidden)` up to its output projection: `(B, T, heads * head_dim)`.
    `LeanLlama.layer`'s math; the slices are `split`s (one gradient copy in the backward, not one per slice)."""
    b, t, _ = h.shape
    heads, kv, d = lean.heads, lean.kv_heads, lean.head_dim
    x = lean.norm(h, w.ln1)
    qkv = F.linear(x if x.dtype == mm else x.to(mm), w.qkv).view(b, t, heads + 2 * kv, d).transpose(1, 2)
    qk, v = qkv.split([heads + kv, kv], dim=1)
    qk = qk * cos + qk.roll(d // 2, -1) * sin  # rotary: (x * cos) + (rotate_half(x) * sin)
    q, k = qk.split([heads, kv], dim=1)
    if bias is not None:
        return lean.attention(q, k, v, bias)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=lean.scale, enable_gqa=kv != heads)
    return out.transpose(1, 2).reshape(b, t, heads * d)


def _mlp_block(lean: LeanLlama, h: torch.Tensor, w, mm) -> torch.Tensor:
    x = lean.norm(h, w.ln2)
    gate, up = F.linear(x if x.dtype == mm else x.to(mm), w.gate_up).chunk(2, dim=-1)
    return h + F.linear(F.silu(gate) * up, w.down)
