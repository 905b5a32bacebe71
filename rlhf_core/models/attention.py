"""`rlhf_sdpa`: PyTorch SDPA, except where its CPU kernel's backward is slow.

SDPA's CPU flash-attention backward is several times slower than matmul attention for short rows in
bf16/fp16 (packed CPU fine-tuning; benchmarks/README.md). So on CPU in half precision, rows of at
most `SHORT_ROWS` keys get matmul attention; everything else (long rows, fp32, GPUs, masks or
options it does not reproduce exactly) goes unchanged to transformers' SDPA function.

The choice depends on device, dtype and shapes, never on grad mode: a frozen reference and the
policy it was copied from run the same kernel, so their log-ratio starts at exactly 0 (DPO, KTO
and PPO rely on it).

Attention-logit soft-capping (Gemma-2's `softcap`) always gets matmul attention: transformers'
SDPA function drops that option without a word, which would train a Gemma-2 policy on another
function than the one vLLM samples from (and plain transformers' eager attention computes).

Registered with transformers' attention and mask interfaces under `NAME` (SDPA's masks: boolean,
or None for plain causal). Transformers does not save the attention implementation, so saved
models load anywhere without this module.
"""

from __future__ import annotations

import torch

NAME = "rlhf_sdpa"
SHORT_ROWS = 256  # keys per row up to which matmul attention beats the CPU kernel (crossover ~512)
# Attention options SDPA honours or rejects that matmul attention would silently ignore.
_SDPA_ONLY_OPTIONS = ("position_bias", "cache", "softcap", "s_aux", "sinks")


def compute_dtype(query: torch.Tensor) -> torch.dtype:
    """The dtype attention runs in: autocast's, where it is on (rotary embeddings hand fp32 queries
    and keys to attention under autocast; SDPA is on autocast's half-precision list)."""
    device = query.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype


def uses_matmul_attention(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, **kwargs) -> bool:
    """Short rows, on CPU, in half precision, with a mask matmul attention reads exactly as SDPA does."""
    if query.device.type != "cpu" or compute_dtype(query) not in (torch.bfloat16, torch.float16):
        return False
    if key.shape[-2] > SHORT_ROWS or any(kwargs.get(k) is not None for k in _SDPA_ONLY_OPTIONS):
        return False
    if mask is None:  # plain causal: SDPA aligns it specially when keys outnumber queries (cache prefill)
        return query.shape[-2] == key.shape[-2]
    return mask.dtype == torch.bool  # float masks may carry biases, not only 0 / -inf


def matmul_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scaling: float, causal: bool = True, dropout: float = 0.0, training: bool = False,
                     softcap: float | None = None) -> torch.Tensor:
    """Softmax attention with SDPA's mask conventions: `(B, H, T, D)` -> `(B, T, H, D)`.

    `mask` is boolean (True = attend) or additive (float), broadcastable to `(B, H, Tq, Tk)`, or
    None: causal attention when `causal` (the last query sees every key), else none. Key/value
    heads are repeated for grouped-query attention. `softcap`: scores become
    `softcap * tanh(scores / softcap)` before the mask (Gemma-2). Softmax runs in fp32.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    queries, keys = query.shape[-2], key.shape[-2]
    if mask is None and causal:
        mask = torch.ones(queries, keys, dtype=torch.bool, device=query.device).tril(keys - queries)
    if mask is not None and mask.dtype != torch.bool:
        scores = scores + mask
    elif mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout and training:
        weights = torch.nn.functional.dropout(weights, p=dropout)
    return torch.matmul(weights, value).transpose(1, 2).contiguous()


def rlhf_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    softcap = kwargs.get("softcap")
    if softcap is None and not uses_matmul_attention(query, key, attention_mask, **kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    dtype = compute_dtype(query)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    causal = kwargs.get("is_causal")
    causal = getattr(module, "is_causal", True) if causal is None else causal
    return matmul_attention(query, key, value, attention_mask, scale, causal, dropout, module.training,
                            softcap), None


def register() -> str:
    """Make `NAME` a valid `attn_implementation` in this process (idempotent); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, rlhf_sdpa_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def batch_mask(attention_mask: torch.Tensor | None, position_ids: torch.Tensor,
               queries: slice | None = None) -> torch.Tensor:
    """The boolean attention mask (True = attend) transformers builds for a batch, `(rows or 1, 1,
    T, T)`: a 4-D mask is used as it is; a 2-D padding mask becomes causal & key padding; no mask
    means samples packed one after another, told apart by their restarted position ids
    (`find_packed_sequence_indices`' rule: a new sample wherever a position is not its
    predecessor's + 1), or one causal sequence per row. `queries`: only those query positions'
    rows, `(rows or 1, 1, len(queries), T)` (a ring rank's, `models/ring.py`)."""
    if attention_mask is not None and attention_mask.dim() == 4:
        mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask.bool()
        return mask if queries is None else mask[:, :, queries]
    t = position_ids.shape[-1]
    keys = torch.arange(t, device=position_ids.device)
    rows = keys if queries is None else keys[queries]
    causal = rows[:, None] >= keys[None, :]
    if attention_mask is not None:
        return (causal & attention_mask.bool()[:, None, :]).unsqueeze(1)
    starts = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1) != 1
    if not bool(starts[:, 1:].any()):
        return causal[None, None]
    segment = starts.cumsum(-1)
    return (causal & (segment[:, rows, None] == segment[:, None, :])).unsqueeze(1)
