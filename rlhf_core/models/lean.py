"""A lean forward for Llama-architecture causal LMs: transformers' `LlamaForCausalLM` math on the
same weights, in a fraction of the operations.

On a CPU with a small model, a forward's time is the number of ops it dispatches; transformers'
Llama runs about sixty small ops per layer. This module computes the same function with fused
q/k/v and gate/up projections (each fused weight cast and concatenated in one pass), a rotary table computed once by the model's own rotary module
(bit-identical entries; `rotate_half(x) * sin` as `roll(x) * sin_signed`), one additive mask per
forward, matmul attention (`models/attention.py`), autocast as explicit casts (so no-grad passes
cast the weights once: `reusing_weights`), and a static KV cache for generation.

Same results up to rounding (tests compare logits, gradients and sampled tokens with
transformers'). Every RL pass (generation aside) runs it, so a policy and its frozen copy give
exactly equal log-probs. `lean_model` returns None (callers use transformers' forward) for other
architectures, LoRA, ZeRO-3, gradient checkpointing, rotary scaling, biases;
`RLHF_LEAN_FORWARD=0` turns it off.
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlhf_core.models.attention import NAME as RLHF_SDPA
from rlhf_core.models.attention import batch_mask

ENV = "RLHF_LEAN_FORWARD"
_LEAN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def unwrap(model):
    """The Hugging Face model inside a DeepSpeed engine (or the model itself)."""
    inner = model.__dict__.get("_modules", {}).get("module")
    return inner if inner is not None and type(model).__name__ == "DeepSpeedEngine" else model


def supported(model) -> str | None:
    """Why the lean forward does not apply to `model`, or None when it does."""
    from transformers import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM:
        return f"{type(model).__name__} is not a plain LlamaForCausalLM"
    cfg = model.config
    rope = getattr(cfg, "rope_parameters", None) or {}
    checks = {
        "hidden_act is not silu": cfg.hidden_act != "silu",
        "attention or MLP biases": bool(getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False)),
        "rotary scaling": rope.get("rope_type", "default") != "default",
        "pretraining_tp > 1": getattr(cfg, "pretraining_tp", 1) != 1,
        "attention dropout": bool(getattr(cfg, "attention_dropout", 0.0)),
        "attention implementation": getattr(cfg, "_attn_implementation", None) not in ("sdpa", RLHF_SDPA),
        "partitioned (ZeRO-3) weights": partitioned(model),
        "rotary attention scaling": getattr(model.model.rotary_emb, "attention_scaling", 1.0) != 1.0,
        "Liger kernels (--ds.use_liger_kernel)": getattr(model, "_rlhf_liger", False),
        "4-bit weights (--ds.load_in_4bit)": bool(getattr(model, "is_loaded_in_4bit", False)),
        "tensor-parallel layers (--ds.tensor_parallel_size)": tensor_parallel(model),
    }
    reasons = [k for k, bad in checks.items() if bad]
    return ", ".join(reasons) if reasons else None


def partitioned(model) -> bool:
    """Whether ZeRO-3 partitions `model`'s weights (it marks each with a `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def tensor_parallel(model) -> bool:
    """Whether DeepSpeed's AutoTP sharded `model`'s linear layers (`--ds.tensor_parallel_size`: each
    rank holds a slice; their forward gathers or all-reduces, which only the modules' own calls do).
    DeepSpeed marks the model when it replaces them."""
    return bool(getattr(model, "ds_autotp_parsed", False))


def lean_model(model) -> LeanLlama | None:
    """The lean forward of `model` (a Llama causal LM, possibly inside a DeepSpeed engine), or None
    where it does not apply (the caller then runs transformers' forward)."""
    if os.environ.get(ENV, "1") == "0":
        return None
    model = unwrap(model)
    try:
        lean = _LEAN[model]
    except (KeyError, TypeError):
        lean = LeanLlama(model) if supported(model) is None else None
        try:
            _LEAN[model] = lean
        except TypeError:
            pass
    if lean is None or _checkpointing(model) or tensor_parallel(model):  # sharded after it was cached
        return None
    return lean


def _checkpointing(model) -> bool:
    flag = getattr(model, "is_activation_checkpointing", None)  # transformers >= 5.x's name
    return bool(getattr(model, "is_gradient_checkpointing", False) if flag is None else flag)


def forward_report(role: str, model, sequence_classifier: bool = False) -> tuple[str, str]:
    """Which forward `model`'s passes run and why, for the stage's log: `(choice, line)`, the choice
    `lean (...)` or `transformers (<why not lean>)` (the rules of `lean_model`), the line
    `forward (<role>, <class>): <choice>`. A sequence classifier (reward model, critic) always runs
    transformers' body: its score head reads the last token. In a ring (`models/ring.py`), the
    choice names it, and its tensor-parallel layers where AutoTP split them too."""
    from rlhf_core.models import ring

    inner = unwrap(model)
    mine = ring.current()
    if mine is not None:
        choice = (f"transformers with ring attention ({mine.size} ranks split each row; keys and values gathered "
                  f"{mine.head_stride} head(s) at a time)"
                  + (" and tensor-parallel layers (--ds.tensor_parallel_size)" if tensor_parallel(inner) else ""))
        return choice, f"forward ({role}, {type(inner).__name__}): {choice}"
    if sequence_classifier:
        why = "a sequence classifier"
    elif os.environ.get(ENV, "1") == "0":
        why = f"{ENV}=0"
    else:
        why = supported(inner) or ("gradient checkpointing" if _checkpointing(inner) else None)
    choice = ("lean (a plain Llama: fused projections, loss-position head, static KV cache)" if why is None
              else f"transformers ({why})")
    return choice, f"forward ({role}, {type(inner).__name__}): {choice}"


@dataclass
class _Layer:
    ln1: torch.Tensor
    qkv: torch.Tensor  # (q_heads + 2 kv_heads) * head_dim, hidden
    o: torch.Tensor
    ln2: torch.Tensor
    gate_up: torch.Tensor  # 2 * intermediate, hidden
    down: torch.Tensor


@dataclass
class _Weights:
    embed: torch.Tensor
    layers: list[_Layer]
    norm: torch.Tensor
    head: torch.Tensor
    mm: torch.dtype  # the dtype of the matmuls (linears, attention)


@dataclass
class DecodeState:
    """A generation's KV cache: per layer, keys and values `(B, kv_heads, capacity, head_dim)`
    filled up to `length`, and the additive mask of the cached positions `(B, 1, 1, capacity)`
    (0 where a row attends to that position)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    key_mask: torch.Tensor
    length: int

    def repeat_interleave(self, repeats: int) -> None:
        self.keys = [k.repeat_interleave(repeats, 0) for k in self.keys]
        self.values = [v.repeat_interleave(repeats, 0) for v in self.values]
        self.key_mask = self.key_mask.repeat_interleave(repeats, 0)

    def select(self, rows: torch.Tensor) -> None:
        self.keys = [k[rows] for k in self.keys]
        self.values = [v[rows] for v in self.values]
        self.key_mask = self.key_mask[rows]


class _CastCat(torch.autograd.Function):
    """`torch.cat(weights).to(dtype)` in one pass: each weight is read once and written once, in
    `dtype`, into its rows of the result (a cat then a cast writes the concatenation twice, in the
    weights' dtype and again in `dtype`). The backward hands each weight its rows of the gradient
    in the weight's dtype, as cat's and cast's backwards do."""

    @staticmethod
    def forward(ctx, dtype: torch.dtype, *weights: torch.Tensor) -> torch.Tensor:
        ctx.sizes = [w.shape[0] for w in weights]
        ctx.dtypes = [w.dtype for w in weights]
        out = torch.empty((sum(ctx.sizes), *weights[0].shape[1:]), dtype=dtype, device=weights[0].device)
        for rows, w in zip(out.split(ctx.sizes), weights, strict=True):
            rows.copy_(w)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *(g.to(dtype) for g, dtype in zip(grad.split(ctx.sizes), ctx.dtypes, strict=True)))


class LeanLlama:
    """The lean forward of one `LlamaForCausalLM` (its live parameters: training updates show)."""

    def __init__(self, model):
        cfg = model.config
        self._model = weakref.ref(model)
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size, self.eps = cfg.hidden_size, cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._reused: dict[torch.dtype, _Weights] | None = None
        self._kept: tuple[tuple, _Weights] | None = None  # a frozen CPU model's weights, as last built

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise RuntimeError("the model of this lean forward was freed")
        return model

    # -- weights ----------------------------------------------------------------------------
    def weights(self, mm: torch.dtype) -> _Weights:
        """The weights as the forward uses them: projections concatenated, matmul weights in `mm`.
        Differentiable (built from the parameters at every call) unless `reusing_weights` is on
        and gradients are off."""
        if self._reused is not None and not torch.is_grad_enabled():
            if mm not in self._reused:
                self._reused[mm] = self._build(mm)
            return self._reused[mm]
        if not torch.is_grad_enabled():
            stamp = self._frozen_on_cpu_stamp(mm)
            if stamp is not None:
                if self._kept is None or self._kept[0] != stamp:
                    self._kept = (stamp, self._build(mm))
                return self._kept[1]
        return self._build(mm)

    def _frozen_on_cpu_stamp(self, mm: torch.dtype) -> tuple | None:
        """For a frozen model on a CPU (a DPO reference, a reward model), what its built weights
        depend on: each parameter's storage and in-place version. Its cast weights are then kept
        between forwards (a cast per forward was ~6% of a DPO step on a small model); on a GPU the
        cast costs little and the copy would hold device memory. None: build them every time."""
        params = list(self.model.parameters())
        if not params or params[0].device.type != "cpu" or any(p.requires_grad for p in params):
            return None
        return (mm, *((p.data_ptr(), p._version) for p in params))

    def _build(self, mm: torch.dtype) -> _Weights:
        body = self.model.model

        def cast(w):
            return w if w.dtype == mm else w.to(mm)

        layers = []
        for layer in body.layers:
            a, m = layer.self_attn, layer.mlp
            layers.append(_Layer(
                layer.input_layernorm.weight,
                _CastCat.apply(mm, a.q_proj.weight, a.k_proj.weight, a.v_proj.weight), cast(a.o_proj.weight),
                layer.post_attention_layernorm.weight,
                _CastCat.apply(mm, m.gate_proj.weight, m.up_proj.weight), cast(m.down_proj.weight)))
        return _Weights(body.embed_tokens.weight, layers, body.norm.weight, cast(self.model.lm_head.weight), mm)

    @contextlib.contextmanager
    def reusing_weights(self):
        """Inside, no-grad forwards concatenate and cast the weights once, not at every call: for
        a pass over many batches with weights that do not change (experience, generation)."""
        outer = self._reused
        self._reused = {} if outer is None else outer
        try:
            yield self
        finally:
            self._reused = outer

    # -- pieces -----------------------------------------------------------------------------
    def dtypes(self, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
        """`(activations, matmuls)`: under autocast (fp32 weights) the residual stream, norms and
        rotary stay in the weights' dtype and linears and attention run in autocast's dtype."""
        param = self.model.model.embed_tokens.weight.dtype
        if torch.is_autocast_enabled(device.type):
            mm = torch.get_autocast_dtype(device.type)
            if param == torch.float32:
                return param, mm
        return param, param

    def rotary(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`(cos, sin_signed)` for `positions (...)`: `(..., head_dim)` in `dtype`."""
        needed = int(positions.max()) + 1 if positions.numel() else 1
        key = (positions.device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].shape[0] < needed:
            rotary = self.model.model.rotary_emb
            size = max(needed, getattr(self.model.config, "max_position_embeddings", 0) or 0, 64)
            probe = torch.zeros((), dtype=torch.float32, device=positions.device)
            cos, sin = rotary(probe, torch.arange(size, device=positions.device).unsqueeze(0))
            cos, sin = cos[0], sin[0]
            half = sin.shape[-1] // 2
            sin = torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)  # roll(x) * this = rotate_half(x) * sin
            table = self._tables[key] = (cos.to(dtype), sin.to(dtype))
        return table[0][positions], table[1][positions]

    def norm(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`LlamaRMSNorm`: fp32 statistics, the weight applied in the input's dtype."""
        if h.dtype == torch.float32 and weight.dtype == torch.float32:
            if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
                return _RMSNorm.apply(h, weight, self.eps)
            return _rms_norm(h, weight, self.eps)[0]  # the same numbers, without a graph
        x = h.float()
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(h.dtype)

    def attention(self, q, k, v, bias: torch.Tensor) -> torch.Tensor:
        """Softmax attention `(B, H, Tq, D)` -> `(B, Tq, H * D)` in the dtype of `v` (the matmuls'),
        with an additive mask `bias` (0 where a query sees a key, the dtype's lowest value
        elsewhere; every query sees at least itself). Not SDPA: its CPU kernel is slow for a decoded
        token and in half-precision backward (`models/attention.py`)."""
        mm = v.dtype
        q, k = q.to(mm), k.to(mm)
        b, _, t, _ = q.shape
        if self.kv_heads != self.heads:
            k = k.repeat_interleave(self.heads // self.kv_heads, dim=1)
            v = v.repeat_interleave(self.heads // self.kv_heads, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)).mul_(self.scale).add_(bias)
        # fp32 softmax rounded once to the matmuls' dtype, as `models/attention.py` does (and
        # faster than the bf16 softmax kernel on CPU).
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(mm)
        return torch.matmul(weights, v).transpose(1, 2).reshape(b, t, self.heads * self.head_dim)

    def layer(self, h, w: _Layer, cos, sin, bias, mm, cache: tuple | None = None):
        """One decoder layer on `h (B, T, hidden)`; `cache = (keys, values, start, end)` writes this
        call's keys and values at `start` and attends to the cache's first `end` positions (`bias`
        masks those not written yet)."""
        b, t, _ = h.shape
        heads, kv, d = self.heads, self.kv_heads, self.head_dim
        x = self.norm(h, w.ln1)
        qkv = F.linear(x if x.dtype == mm else x.to(mm), w.qkv).view(b, t, heads + 2 * kv, d).transpose(1, 2)
        qk = qkv[:, : heads + kv]
        qk = qk * cos + qk.roll(d // 2, -1) * sin  # rotary: (x * cos) + (rotate_half(x) * sin)
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + kv :]
        if cache is not None:
            keys, values, start, end = cache
            keys[:, :, start : start + t] = k
            values[:, :, start : start + t] = v
            k, v = (keys, values) if end == keys.shape[2] else (keys[:, :, :end], values[:, :, :end])
        out = self.attention(q, k, v.to(mm), bias)
        h = h + F.linear(out, w.o)
        x = self.norm(h, w.ln2)
        gate, up = F.linear(x if x.dtype == mm else x.to(mm), w.gate_up).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, w.down)

    # -- whole passes -----------------------------------------------------------------------
    def hidden_states(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None) -> torch.Tensor:
        """The final-normed hidden states `(rows, T, hidden)` of a training batch (`data/batching.Batch`
        layouts): what `LlamaModel(...).last_hidden_state` returns."""
        device = input_ids.device
        act, mm = self.dtypes(device)
        bias = additive(batch_mask(attention_mask, position_ids), mm)
        with _no_autocast(device):
            w = self.weights(mm)
            cos, sin = self.rotary(position_ids, act)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            h = F.embedding(input_ids, w.embed)
            for layer in w.layers:
                h = self.layer(h, layer, cos, sin, bias, mm)
            return self.norm(h, w.norm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head on final hidden states, in the matmul dtype (autocast's, where it is on)."""
        device = hidden.device
        _, mm = self.dtypes(device)
        with _no_autocast(device):
            reused = self._reused.get(mm) if self._reused is not None and not torch.is_grad_enabled() else None
            head = reused.head if reused is not None else self.model.lm_head.weight
            return F.linear(hidden if hidden.dtype == mm else hidden.to(mm), head if head.dtype == mm else head.to(mm))

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                capacity: int) -> tuple[torch.Tensor, DecodeState]:
        """Left-padded prompts `(B, L)` into a new cache of `capacity` positions; returns the last
        position's logits `(B, vocab)` and the cache."""
        device = input_ids.device
        act, mm = self.dtypes(device)
        b, length = input_ids.shape
        if length > capacity:
            raise ValueError(f"prompts of {length} tokens do not fit a cache of {capacity}")
        real = attention_mask.bool()
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
        diagonal = torch.eye(length, dtype=torch.bool, device=device)
        bias = additive((causal & (real.unsqueeze(1) | diagonal)).unsqueeze(1), mm)  # padding sees itself only
        with _no_autocast(device):
            w = self.weights(mm)
            cos, sin = self.rotary(position_ids, act)
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
            h = F.embedding(input_ids, w.embed)
            keys, values = [], []
            for layer in w.layers:
                # Cached in the matmul dtype attention casts keys to: same numbers, not recast per token.
                # Zeros, not garbage: decoding attends over the whole buffer, and a masked NaN
                # would still poison the softmax.
                keys.append(torch.zeros((b, self.kv_heads, capacity, self.head_dim), dtype=mm, device=device))
                values.append(torch.zeros((b, self.kv_heads, capacity, self.head_dim), dtype=mm, device=device))
                h = self.layer(h, layer, cos, sin, bias, mm, cache=(keys[-1], values[-1], 0, length))
            key_mask = torch.full((b, 1, 1, capacity), torch.finfo(mm).min, dtype=mm, device=device)
            key_mask[:, 0, 0, :length].masked_fill_(real, 0.0)
            last = self.norm(h[:, -1:], w.norm)
            return F.linear(last if last.dtype == mm else last.to(mm), w.head)[:, 0], \
                DecodeState(keys, values, key_mask, length)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, attends: torch.Tensor,
               state: DecodeState) -> torch.Tensor:
        """One token per row (`tokens`, `positions`: `(B,)`) appended to the cache; `attends (B,)`
        whether later tokens see it (False for the padding fed to finished rows). Returns the
        next logits `(B, vocab)`."""
        device = tokens.device
        act, mm = self.dtypes(device)
        start = state.length
        if start >= state.key_mask.shape[-1]:
            raise RuntimeError(f"KV cache of {state.key_mask.shape[-1]} positions is full")
        state.key_mask[:, 0, 0, start] = torch.where(attends, 0.0, torch.finfo(state.key_mask.dtype).min)
        # Attention over the whole cache, unwritten positions masked (weight exactly 0): the filled
        # part would be a strided view the matmul kernel copies first.
        bias = state.key_mask
        with _no_autocast(device):
            w = self.weights(mm)
            cos, sin = self.rotary(positions, act)
            cos, sin = cos[:, None, None], sin[:, None, None]
            h = F.embedding(tokens.unsqueeze(-1), w.embed)
            for layer, keys, values in zip(w.layers, state.keys, state.values, strict=True):
                h = self.layer(h, layer, cos, sin, bias, mm, cache=(keys, values, start, keys.shape[2]))
            state.length = start + 1
            h = self.norm(h, w.norm)
            return F.linear(h if h.dtype == mm else h.to(mm), w.head)[:, 0]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(y, x_hat, r)`: transformers' `LlamaRMSNorm` in fp32, `y = weight * x_hat`, `x_hat = x * r`,
    `r = rsqrt(mean(x^2) + eps)` per row."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
    x_hat = x * r
    return x_hat * weight, x_hat, r


class _RMSNorm(torch.autograd.Function):
    """RMSNorm (fp32) with a hand-written backward (autograd's, through pow/mean/rsqrt and two
    broadcast products, is many times the forward's cost):
    dx = r * (g w - x_hat * mean(g w x_hat)), dweight = sum over rows of g * x_hat."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, x_hat, r = _rms_norm(x, weight, eps)
        ctx.save_for_backward(x_hat, r, weight)
        return y

    @staticmethod
    def backward(ctx, grad):
        x_hat, r, weight = ctx.saved_tensors
        scaled = grad * weight
        dx = (scaled - x_hat * (scaled * x_hat).mean(-1, keepdim=True)) * r if ctx.needs_input_grad[0] else None
        dweight = (grad * x_hat).reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return dx, dweight, None


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = attend) as an additive one: 0, or `dtype`'s lowest value."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


def _no_autocast(device: torch.device):
    """Autocast off inside (the lean forward casts explicitly); a no-op where it is off already."""
    if torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()
