"""Autoregressive sampling with a KV cache that returns each sampled token's log-prob.

RL needs each response's ids exactly as sampled and the sampler's log-prob of each (the engine
side of the rollout/trainer mismatch check); `transformers.generate` gives per-step logits only
through a `(steps, batch, vocab)` copy and its logits processors. This loop:

- left-pads prompts, position ids from the attention mask (a padded row computes what it would alone);
- runs one prefill per prompt and repeats its cache and logits for the `repeats` samples (the
  same draws as repeating the prompts first);
- samples T > 0 from softmax(filter(logits / T)), `filter` the top-k / top-p rule
  (`algos/nucleus.py`, vLLM's), recording the drawn token's log-prob under that processed
  distribution (off by default: log softmax(logits / T), which the trainer recomputes with the same
  T); T = 0 is greedy (untempered log-probs);
- writes the KV cache in place (`kv_cache`) and draws by inverse CDF (`inverse_cdf_draw`), both
  cheaper than the per-step cat and `torch.multinomial`;
- runs a Llama's lean forward (`models/lean.py`), others their own; both draw the same tokens
  (tests/unit/test_lean_forward.py);
- seeds a `torch.Generator` per call (same seed, same samples; global RNG untouched);
- stops a row at its first EOS (kept); finished rows get padding and, once a quarter of the
  running batch has finished, leave it with their cache rows.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from rlhf_core.algos.nucleus import filter_logits
from rlhf_core.models.lean import lean_model


class _PreallocatedLayer(DynamicLayer):
    """A KV-cache layer writing each step's keys and values into buffers of `capacity` positions,
    not `DynamicLayer`'s `torch.cat` of the whole cache every step. Attention reads a view of the
    filled part."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        self._keys = key_states.new_empty((b, h, self.capacity, dk))
        self._values = value_states.new_empty((b, h, self.capacity, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache of {self.capacity} positions overflowed ({end})")
        self._keys[:, :, self.length : end] = key_states
        self._values[:, :, self.length : end] = value_states
        self.length = end
        self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._keys = self._keys.repeat_interleave(repeats, dim=0)
            self._values = self._values.repeat_interleave(repeats, dim=0)
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[:, :, : self.length], self._values[:, :, : self.length]


def kv_cache(model, capacity: int):
    """A cache for `capacity` positions: preallocated for models whose every layer attends to the
    whole past (Llama and the like), transformers' own `DynamicCache` for any other."""
    config = model.config
    cache = DynamicCache(config=config)
    full = all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])
    if full and getattr(config, "sliding_window", None) is None and \
            all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [_PreallocatedLayer(capacity) for _ in cache.layers]
    return cache


def inverse_cdf_draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One draw per row of `probs (B, V)`: the first index whose cumulative probability reaches a
    uniform u in (0, 1] (scaled by the row's total, so rounding never runs past the end). Exact
    sampling with one uniform per row, where `torch.multinomial` draws one per vocabulary entry."""
    cdf = probs.cumsum(-1)
    u = 1.0 - torch.rand((probs.shape[0], 1), generator=generator, device=probs.device, dtype=cdf.dtype)
    return torch.searchsorted(cdf, u * cdf[:, -1:]).squeeze(-1).clamp(max=probs.shape[-1] - 1)


class _TransformersDecoder:
    """Prefill and decode steps through the model's own forward (any causal LM)."""

    def __init__(self, model, input_ids, attention_mask, positions, capacity):
        self.model, self.attention = model, attention_mask.clone()
        out = model(input_ids=input_ids, attention_mask=self.attention, position_ids=positions,
                    past_key_values=kv_cache(model, capacity), use_cache=True, logits_to_keep=1)
        self.cache, self.first_logits = out.past_key_values, out.logits[:, -1]

    def repeat_interleave(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)
        self.attention = self.attention.repeat_interleave(repeats, 0)

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.attention = self.attention[rows]

    def step(self, token: torch.Tensor, position: torch.Tensor, attends: torch.Tensor) -> torch.Tensor:
        self.attention = torch.cat([self.attention, attends.long().unsqueeze(-1)], dim=-1)
        out = self.model(input_ids=token.unsqueeze(-1), attention_mask=self.attention,
                         position_ids=position.unsqueeze(-1), past_key_values=self.cache, use_cache=True)
        self.cache = out.past_key_values
        return out.logits[:, -1]


class _LeanDecoder:
    """The same steps through a Llama's lean forward (`models/lean.py`): a static cache, the rotary
    table looked up, the weights prepared once for the whole generation."""

    def __init__(self, lean, input_ids, attention_mask, positions, capacity):
        self.lean = lean
        self.first_logits, self.state = lean.prefill(input_ids, attention_mask, positions, capacity)

    def repeat_interleave(self, repeats: int) -> None:
        self.state.repeat_interleave(repeats)

    def select(self, rows: torch.Tensor) -> None:
        self.state.select(rows)

    def step(self, token: torch.Tensor, position: torch.Tensor, attends: torch.Tensor) -> torch.Tensor:
        return self.lean.decode(token, position, attends, self.state)


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, max_new_tokens: int | list[int],
           temperature: float, eos_ids: list[int], pad_id: int, generator: torch.Generator | None = None,
           repeats: int = 1, top_k: int = -1, top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample `repeats` continuations of each left-padded prompt.

    input_ids, attention_mask: `(P, L)`, padding on the left. B = P x repeats rows come back, the
    samples of prompt i in rows `i * repeats ... (i + 1) * repeats - 1`.
    `max_new_tokens`: one budget, or one per prompt (a row stops at its own).
    Returns `(tokens (B, N), logprobs (B, N) float32, lengths (B,))` with N <= the largest budget:
    row i's response is `tokens[i, :lengths[i]]` (its EOS included when it produced one); entries
    past a row's length are `pad_id` and 0.
    """
    lean = lean_model(model)
    with lean.reusing_weights() if lean is not None else contextlib.nullcontext():
        return _sample(model, lean, input_ids, attention_mask, max_new_tokens, temperature, eos_ids, pad_id,
                       generator, repeats, top_k, top_p)


def _sample(model, lean, input_ids, attention_mask, max_new_tokens, temperature, eos_ids, pad_id, generator, repeats,
            top_k, top_p):
    device = input_ids.device
    budgets = [max_new_tokens] * input_ids.shape[0] if isinstance(max_new_tokens, int) else list(max_new_tokens)
    max_new_tokens = max(budgets)
    limits = torch.tensor(budgets, device=device).repeat_interleave(repeats)  # per output row
    eos = torch.tensor(sorted(set(eos_ids)), device=device)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    capacity = input_ids.shape[1] + max_new_tokens
    decoder = (_LeanDecoder(lean, input_ids, attention_mask, positions, capacity) if lean is not None
               else _TransformersDecoder(model, input_ids, attention_mask, positions, capacity))
    logits = decoder.first_logits
    if repeats > 1:
        decoder.repeat_interleave(repeats)
        logits, positions = logits.repeat_interleave(repeats, 0), positions.repeat_interleave(repeats, 0)
    batch = logits.shape[0]
    tokens = torch.full((batch, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((batch, max_new_tokens), dtype=torch.float32, device=device)
    lengths = torch.zeros(batch, dtype=torch.long, device=device)
    rows = torch.arange(batch, device=device)  # which output row each row of the running batch is
    next_position = positions[:, -1] + 1
    done = torch.zeros(batch, dtype=torch.bool, device=device)  # rows of the running batch that ended
    steps = 0
    for step in range(max_new_tokens):
        logits = logits.float()
        if temperature > 0:
            tempered = logits / temperature if temperature != 1.0 else logits
            log_dist = torch.log_softmax(filter_logits(tempered, top_k, top_p), dim=-1)
            token = inverse_cdf_draw(log_dist.exp(), generator)
        else:
            log_dist = torch.log_softmax(logits, dim=-1)
            token = log_dist.argmax(-1)
        logprob = log_dist.gather(-1, token.unsqueeze(-1)).squeeze(-1)
        live = ~done
        tokens[rows[live], step] = token[live]
        logprobs[rows[live], step] = logprob[live]
        lengths[rows[live]] += 1
        steps = step + 1
        done = done | (live & torch.isin(token, eos)) | (lengths[rows] >= limits[rows])
        if bool(done.all()) or steps == max_new_tokens:
            break
        if int(done.sum()) * 4 >= len(done):  # a quarter of the batch has ended: drop those rows
            keep = (~done).nonzero().squeeze(-1)
            decoder.select(keep)
            rows, next_position, token, done = rows[keep], next_position[keep], token[keep], done[keep]
        token = torch.where(done, torch.full_like(token, pad_id), token)
        logits = decoder.step(token, next_position, ~done)
        next_position = next_position + 1
    return tokens[:, :steps], logprobs[:, :steps], lengths
