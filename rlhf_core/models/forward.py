"""Forward passes that turn a `Batch` into the quantities losses need.

Token log-probs are aligned with `input_ids`: position t holds log p(x_t | x_<t) and position 0
holds 0 (nothing predicts the first token; the loss mask is 0 there). Per-sample reductions go
through `seq_ids`, so padded and packed batches give the same per-sample numbers. Every forward of
a model that is not a plain Llama tells `models/moe.py` which of its tokens are real (`note_tokens`),
for an MoE model's load-balancing loss.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from rlhf_core.algos.losses import gather_token_logprobs
from rlhf_core.data.batching import Batch
from rlhf_core.models.lean import lean_model, partitioned, unwrap
from rlhf_core.models.lean_train import selected_hidden
from rlhf_core.models.loading import backbone
from rlhf_core.models.moe import note_tokens
from rlhf_core.models.ring import at_positions
from rlhf_core.models.ring import current as current_ring
from rlhf_core.models.shapes import gathered_rows


def token_logprobs(model, batch: Batch) -> torch.Tensor:
    """Log-prob of each input token under `model`: `(rows, T)`, float32.

    A token is predicted by the position before it, except where `batch.predecessors` names
    another (the first token of a rejected response after its shared prompt, see `pack_pairs`).
    """
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, use_cache=False)
    note_tokens(model, batch.seq_ids >= 0)
    logprobs = F.pad(gather_token_logprobs(out.logits[:, :-1], batch.input_ids[:, 1:]), (1, 0))
    if batch.predecessors is not None and len(batch.predecessors):
        rows, cols, preds = batch.predecessors.unbind(-1)
        jumped = gather_token_logprobs(out.logits[rows, preds].unsqueeze(0), batch.input_ids[rows, cols].unsqueeze(0))
        logprobs = logprobs.index_put((rows, cols), jumped.squeeze(0))
    return logprobs


def loss_token_logprobs(model, batch: Batch) -> torch.Tensor:
    """`token_logprobs` where `batch.loss_mask` is nonzero (on real tokens), 0 elsewhere: `(rows, T)`
    float32, for the supervised losses. Llama models run the lean forward (`models/lean_train.py`:
    head and log-softmax only at loss positions); others (see `lean.lean_model`) `token_logprobs`; in
    a ring (`models/ring.py`) each rank the log-probs of the tokens it predicts, summed over the ring."""
    rows, width = batch.input_ids.shape
    ring = current_ring()
    if ring is not None:
        targets = loss_positions(batch).reshape(-1).nonzero().squeeze(-1)
        labels = batch.input_ids.reshape(-1)[targets]
        head = _logits_head(model)

        def label_logprobs(hidden: torch.Tensor, which: torch.Tensor) -> torch.Tensor:
            return gather_token_logprobs(head(hidden), labels[which]).unsqueeze(-1)

        logprobs = at_positions(ring, batch, predicting_index(batch, targets),
                                lambda shard: backbone_hidden(model, shard), label_logprobs, which=True).squeeze(-1)
    elif lean_model(model) is None:
        return token_logprobs(model, batch).masked_fill(~loss_positions(batch), 0.0)
    else:
        targets, logits = loss_logits(model, batch)
        logprobs = gather_token_logprobs(logits, batch.input_ids.reshape(-1)[targets])
    return logprobs.new_zeros(rows * width).index_put((targets,), logprobs).reshape(rows, width)


def loss_positions(batch: Batch) -> torch.Tensor:
    """`(rows, T)` bool: the tokens a supervised loss covers (nonzero loss mask, real tokens)."""
    return (batch.loss_mask != 0) & (batch.seq_ids >= 0)


def loss_logits(model, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """`(targets, logits)`: the flat positions (into `rows * T`) of the loss tokens (nonzero
    `batch.loss_mask` on real tokens), and the logits that predict each of them, `(len(targets),
    vocab)`: what a loss over whole next-token distributions needs (knowledge distillation). Only
    those positions go through the LM head; Llama models run the lean forward (`lean_train.py`)."""
    targets = loss_positions(batch).reshape(-1).nonzero().squeeze(-1)
    lean = lean_model(model)
    if lean is None:
        return targets, response_logits(model, batch, targets)
    select = predicting_index(batch, targets)
    rows = gathered_rows(select, lean.dtypes(select.device)[1])  # few shapes for oneDNN (models/shapes.py)
    hidden = selected_hidden(lean, batch.input_ids, batch.position_ids, batch.attention_mask, rows)
    return targets, lean.logits(hidden)[: len(select)]


def backbone_hidden(model, batch: Batch) -> torch.Tensor:
    """The last hidden states of `model`'s backbone (no head): `(rows, T, hidden)`.

    Under ZeRO-3 the whole model runs (its head's output unused) and the backbone's output is taken
    on the way: DeepSpeed's hooks on the top module start each forward step of its parameter
    coordinator, and a backbone called alone skips them (a reward model trained so took other steps
    than under ZeRO-2, measured)."""
    body = backbone(model)
    inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
              "position_ids": batch.position_ids, "use_cache": False}
    if not partitioned(model):
        hidden = body(**inputs).last_hidden_state
    else:
        taken = []
        handle = body.register_forward_hook(lambda module, args, out: taken.append(out.last_hidden_state))
        try:
            model(**inputs, **_last_logit_only(model))
        finally:
            handle.remove()
        (hidden,) = taken
    note_tokens(model, batch.seq_ids >= 0)
    return hidden


def _last_logit_only(model) -> dict:
    """`logits_to_keep=1` where the model's forward takes it (a causal LM's head then runs on one
    position, not on every position's whole vocabulary)."""
    inner = unwrap(model)
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
    return {"logits_to_keep": 1} if _takes_logits_to_keep(type(inner)) else {}


@functools.cache
def _takes_logits_to_keep(cls) -> bool:
    """Read once per model class: this runs at every forward under ZeRO-3."""
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def per_sample_sum(values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Sum `values * loss_mask` over each sample's tokens: `(rows, T)` -> `(num_samples,)`."""
    flat_ids = batch.seq_ids.reshape(-1)
    weighted = (values * batch.loss_mask).reshape(-1) * (flat_ids >= 0)
    out = torch.zeros(batch.num_samples, dtype=values.dtype, device=values.device)
    return out.index_add(0, flat_ids.clamp(min=0), weighted)


def sequence_logprobs(model, batch: Batch) -> torch.Tensor:
    """Summed response log-probs per sample: `(num_samples,)`."""
    return per_sample_sum(loss_token_logprobs(model, batch), batch)


def reward_scores(model, batch: Batch) -> torch.Tensor:
    """Scalar reward per sample from a sequence classifier, read at its last token: `(num_samples,)`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    ring = current_ring()
    if ring is not None:
        return at_positions(ring, batch, batch.last_token_index, lambda shard: backbone_hidden(model, shard),
                            base.score).squeeze(-1).float()
    hidden = backbone_hidden(model, batch)
    values = base.score(hidden).squeeze(-1).float()
    return values.reshape(-1)[batch.last_token_index]


# --- RL: per-token quantities of each sample's response, laid out `(num_samples, T)` -------------


def response_index(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each sample's response tokens (its loss-masked tokens, in order) sit in the batch.

    Returns `(index, mask)`, both `(num_samples, T_max)`: `index[i, t]` is the flat position
    (into `rows * T`) of response token t of sample i, `mask[i, t]` is 1 where sample i has a
    token t. The same for padded and packed batches, so RL tensors never depend on the layout.
    """
    seq = batch.seq_ids.reshape(-1)
    flat = torch.arange(seq.numel(), device=seq.device)
    keep = (batch.loss_mask.reshape(-1) > 0) & (seq >= 0)
    owner, where = seq[keep], flat[keep]
    order = torch.sort(owner, stable=True).indices  # positions are increasing within a sample
    owner, where = owner[order], where[order]
    counts = torch.bincount(owner, minlength=batch.num_samples)
    starts = torch.cumsum(counts, 0) - counts
    t = torch.arange(owner.numel(), device=seq.device) - starts[owner]
    width = int(counts.max().item()) if owner.numel() else 0
    index = torch.zeros((batch.num_samples, width), dtype=torch.long, device=seq.device)
    mask = torch.zeros((batch.num_samples, width), dtype=torch.float32, device=seq.device)
    index[owner, t] = where
    mask[owner, t] = 1.0
    return index, mask


def predicting_index(batch: Batch, index: torch.Tensor) -> torch.Tensor:
    """The flat position whose output predicts each token of `index` (same shape): p - 1 (a
    response always follows its prompt in the same row), or the earlier position
    `batch.predecessors` names (a response packed after a sibling that shares its prompt)."""
    rows, width = batch.input_ids.shape
    source = torch.arange(rows * width, device=index.device) - 1
    if batch.predecessors is not None and len(batch.predecessors):
        row, col, pred = batch.predecessors.to(index.device).unbind(-1)
        source[row * width + col] = row * width + pred
    return source.clamp(min=0)[index]


def response_logits(model, batch: Batch, index: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The logits that predict each response token, divided by `temperature`: `(num_samples, T, vocab)`.

    Only the positions that predict response tokens (`predicting_index`) go through the LM head; no
    `(rows, T, vocab)` log-softmax is formed. Llama models run the lean forward (`models/lean.py`).
    """
    return _tempered(position_logits(model, batch, predicting_index(batch, index)), temperature)


def position_logits(model, batch: Batch, index: torch.Tensor) -> torch.Tensor:
    """The model's logits at the flat positions `index` (into `rows * T`), any shape: `(*index.shape,
    vocab)`; only those positions go through the LM head (a process reward model's read at each
    step's placeholder token). Llama models run the lean forward (`models/lean.py`)."""
    lean = lean_model(model)
    if lean is not None:
        hidden = lean.hidden_states(batch.input_ids, batch.position_ids, batch.attention_mask)
        flat = index.reshape(-1)
        rows = gathered_rows(flat, lean.dtypes(flat.device)[1])  # few shapes for oneDNN (models/shapes.py)
        logits = lean.logits(hidden.reshape(-1, hidden.shape[-1])[rows])
        return logits[: flat.numel()].reshape(*index.shape, logits.shape[-1])
    head = _logits_head(model)
    ring = current_ring()
    if ring is not None:
        return at_positions(ring, batch, index, lambda shard: backbone_hidden(model, shard), head)
    hidden = backbone_hidden(model, batch)
    return head(hidden.reshape(-1, hidden.shape[-1])[index])


def _logits_head(model):
    """`hidden -> logits`: the model's output embedding, with Gemma's final soft-capping (which its
    forward applies)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    cap = getattr(base.config, "final_logit_softcapping", None)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = base.get_output_embeddings()(hidden)
        return torch.tanh(logits / cap) * cap if cap else logits

    return head


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits / temperature if temperature != 1.0 else logits


def response_logprobs(model, batch: Batch, index: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Log-prob of each response token at `temperature`: `(num_samples, T)` float32 (0 where masked out)."""
    targets = batch.input_ids.reshape(-1)[index]
    return gather_token_logprobs(response_logits(model, batch, index, temperature), targets)


def response_values(critic, batch: Batch, index: torch.Tensor) -> torch.Tensor:
    """A value model's estimate before each response token (read at the position that predicts
    it, as the log-probs are): `(num_samples, T)` float32."""
    base = critic.get_base_model() if hasattr(critic, "get_base_model") else critic
    ring = current_ring()
    if ring is not None:
        return at_positions(ring, batch, predicting_index(batch, index), lambda shard: backbone_hidden(critic, shard),
                            base.score).squeeze(-1).float()
    hidden = backbone_hidden(critic, batch)
    hidden = hidden.reshape(-1, hidden.shape[-1])[predicting_index(batch, index)]
    return base.score(hidden).squeeze(-1).float()
