"""`rlhf_sdpa`: PyTorch SDPA, except where its CPU kernel's backward is slow.

PyTorch's CPU flash-attention kernel (what SDPA runs on CPU) has a backward pass that is several
times slower than plain matmul attention when rows are short and the dtype is bf16/fp16, the
shape of CPU fine-tuning runs with packed rows of a few dozen to a few hundred tokens
(`benchmarks/README.md` has the measurements: rows of 64 tokens, 8 heads of 32, bf16: 12 ms
forward+backward per layer with SDPA, 2.6 ms with matmul attention). For long rows, fp32, GPUs
and forward-only passes SDPA stays the better kernel, so this implementation uses matmul
attention only for training passes on CPU in half precision with keys at most
`SHORT_ROWS` long, and hands everything else, unchanged, to transformers' own SDPA function.

It is registered with transformers' attention and mask interfaces under `NAME`, so a model
loaded with `attn_implementation=NAME` gets SDPA's masks (boolean, or None for plain causal) and
this dispatch. The name lives in the loaded model only: `save_pretrained` does not write it, so
saved models load anywhere without this module.
"""

from __future__ import annotations

import torch

NAME = "rlhf_sdpa"
SHORT_ROWS = 256  # keys per row up to which matmul attention beats the CPU kernel (crossover ~512)


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's, where it is on (rotary embeddings hand fp32 queries
    and keys to attention under autocast; SDPA is on autocast's half-precision list)."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def uses_matmul_attention(query: torch.Tensor, key: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and compute_dtype(query) in (torch.bfloat16, torch.float16)
            and key.shape[-2] <= SHORT_ROWS and torch.is_grad_enabled() and query.requires_grad)


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float, causal: bool = True, dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """Softmax attention with SDPA's mask conventions: `(B, H, Tq, D)` -> `(B, Tq, H, D)`.

    `mask` is boolean (True = attend), broadcastable to `(B, H, Tq, Tk)`, or None: then causal
    attention aligned to the last key (queries at the end of their keys, as with a KV cache) when
    `causal`, else none.
    Key/value heads are repeated for grouped-query attention. Softmax runs in fp32.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    q_len, k_len = query.shape[-2], key.shape[-2]
    if mask is None and causal and q_len > 1:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout and training:
        weights = torch.nn.functional.dropout(weights, p=dropout)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def rlhf_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not uses_matmul_attention(query, key) or kwargs.get("position_bias") is not None or kwargs.get("cache"):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0  # an additive float mask: 0 where attended
    dtype = compute_dtype(query)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    return matmul_attention(query, key, value, attention_mask, scale, causal, dropout, module.training), None


def register() -> str:
    """Make `NAME` a valid `attn_implementation` in this process (idempotent); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, rlhf_sdpa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
