"""What one rollout produces and what the roles compute on it, sample by sample.

A `RolloutSample` is one response to one prompt: the token ids, the engine's log-probs and,
filled in by the controller, the reward, the old policy's and the reference's log-probs, the
critic's values, the advantages and returns. Per-token tensors are `(T_i,)`, one entry per
trained response token, so samples shard across ranks by plain slicing and nothing depends on
padding. A single-turn response trains on all its tokens; a multi-turn episode (`rl/agents.py`)
interleaves the policy's actions with the environment's feedback, and `action_mask` marks the
action tokens: only they carry loss, KL, values and advantages, and `T_i` counts them.

`collate` turns samples into a training `Batch` (padded, or packed with each prompt computed once
per group) plus the `(N, T_max)` layout of their response tokens (`models.forward.response_index`);
`stack` pads per-sample tensors into that layout.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np
import torch

from rlhf_core.algos.losses import kl_penalty
from rlhf_core.data.batching import Batch, make_batch, pack_shared_prefix
from rlhf_core.models.forward import response_index


@dataclass
class RolloutSample:
    prompt_ids: list[int]
    response_ids: list[int]
    prompt_index: int  # which prompt of the prompt set (its label, its group)
    rollout_logprobs: torch.Tensor  # (T,) the engine's log-probs of the sampled tokens
    finished: bool  # ended with EOS (not cut at max_new_tokens)
    reward: float = 0.0  # the source's reward with the overlong penalty (group shaping and clipping come later)
    score: float = 0.0  # the reward source's score (dynamic filtering, accuracy)
    old_logprobs: torch.Tensor | None = None  # (T,) the policy that sampled, recomputed by the trainer
    ref_logprobs: torch.Tensor | None = None  # (T,)
    values: torch.Tensor | None = None  # (T,) critic, gae only
    advantages: torch.Tensor | None = None  # (T,)
    returns: torch.Tensor | None = None  # (T,)
    extra: dict = field(default_factory=dict)
    action_mask: list[int] | None = None  # per response token, 1 where the policy sampled it (None: all)

    def __getstate__(self) -> dict:
        return {k: to_wire(v) for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update({k: from_wire(v) for k, v in state.items()})

    @property
    def response_len(self) -> int:
        """Trained tokens: the length of every per-token tensor."""
        return len(self.response_ids) if self.action_mask is None else sum(self.action_mask)

    @property
    def sequence_len(self) -> int:
        """Tokens the models read: prompt and whole response."""
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def loss_mask(self) -> list[int]:
        """Per response token: 1 where it is trained."""
        return [1] * len(self.response_ids) if self.action_mask is None else list(self.action_mask)


class _Wired:
    """A CPU tensor in transit: its values as a numpy array (`dtype`: the tensor's, where numpy
    has none, e.g. bfloat16, whose bits travel as int16)."""

    __slots__ = ("array", "dtype")

    def __init__(self, array: np.ndarray, dtype: torch.dtype | None):
        self.array, self.dtype = array, dtype

    def __reduce__(self):
        return _Wired, (self.array, self.dtype)


_BITS = {torch.bfloat16: torch.int16}


def to_wire(value):
    """What crosses a process boundary (Ray's calls between the controller and the roles) for a
    sample's field: a CPU tensor as a numpy array, which pickles in microseconds (torch's own
    pickling of a small tensor writes a whole serialized file per storage: for a step's samples
    tens of milliseconds each way); anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.device.type != "cpu" or value.requires_grad:
        return value
    bits = _BITS.get(value.dtype)
    view = value.contiguous() if bits is None else value.contiguous().view(bits)
    return _Wired(view.numpy(), None if bits is None else value.dtype)


def from_wire(value):
    """The inverse of `to_wire`: a tensor of its own memory (a received array may be a read-only
    view of Ray's object store)."""
    if not isinstance(value, _Wired):
        return value
    tensor = torch.from_numpy(np.array(value.array, copy=True))
    return tensor if value.dtype is None else tensor.view(value.dtype)


class TensorRows(list):
    """A list of tensors (per-sample log-probs or values, as the roles return them) that pickles
    through `to_wire`."""

    def __reduce__(self):
        return _rows, ([to_wire(t) for t in self],)


def _rows(wired: list) -> list[torch.Tensor]:
    return [from_wire(w) for w in wired]


class Samples(list):
    """RolloutSamples (a role's share of a step) that cross a process boundary column by column:
    each per-token tensor field of every sample in one array with the samples' lengths, the other
    fields as lists. A step's 128 samples pickle in a fraction of the time they take one by one
    (each small array has its own fixed cost); they arrive as `RolloutSample`s equal to the sent."""

    def __reduce__(self):
        if any(vars(s).keys() != vars(self[0]).keys() for s in self):  # not one layout: sample by sample
            return Samples, (list(self),)
        return _samples, (len(self), _columns(self))


class _Column:
    """One field's 1-D CPU tensors of every sample, concatenated (`to_wire`), and their lengths."""

    __slots__ = ("lengths", "values")

    def __init__(self, values, lengths: list[int]):
        self.values, self.lengths = values, lengths

    def __reduce__(self):
        return _Column, (self.values, self.lengths)


def _columns(samples: list[RolloutSample]) -> dict:
    """Each field of samples that share one layout: a `_Column`, or the samples' values (`to_wire`)."""
    out = {}
    for name in vars(samples[0]) if samples else ():
        values = [vars(s)[name] for s in samples]
        if all(isinstance(v, torch.Tensor) and v.dim() == 1 and v.device.type == "cpu" and not v.requires_grad
               and v.dtype == values[0].dtype for v in values):
            out[name] = _Column(to_wire(torch.cat(values)), [len(v) for v in values])
        else:
            out[name] = [to_wire(v) for v in values]
    return out


def _samples(count: int, columns: dict) -> list[RolloutSample]:
    fields = {}
    for name, column in columns.items():
        if isinstance(column, _Column):
            fields[name] = list(from_wire(column.values).split(column.lengths))  # views of one buffer of its own
        else:
            fields[name] = [from_wire(v) for v in column]
    out = []
    for i in range(count):
        sample = RolloutSample.__new__(RolloutSample)
        sample.__dict__.update({name: values[i] for name, values in fields.items()})
        out.append(sample)
    return Samples(out)


class TensorDict(dict):
    """Tensors by name (a model's weights, as the actor sends them to the engines through Ray's
    object store) that pickle through `to_wire`: a small model's hundred tensors otherwise cost
    a serialized file each, every weight sync."""

    def __reduce__(self):
        return _named, ({k: to_wire(v) for k, v in self.items()},)


def _named(wired: dict) -> dict[str, torch.Tensor]:
    return {k: from_wire(w) for k, w in wired.items()}


def prompt_groups(samples: list[RolloutSample]) -> list[list[int]]:
    """Indices of `samples` grouped by prompt (same prompt index and ids), in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault((s.prompt_index, tuple(s.prompt_ids)), []).append(i)
    return list(groups.values())


# The last few collated micro-batches, by content: the actor's log-probs, the reference's and
# training collate the same chunks (`StepPlan.experience_order`), so each is packed once.
_COLLATED: OrderedDict = OrderedDict()
COLLATE_CACHE_SIZE = 32


def collate(samples: list[RolloutSample], pad_id: int, packing: bool, row_capacity: int | None,
            width_multiple: int = 1) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    """`(batch, index, mask)`: the samples' prompt+response sequences with the response tokens
    under the loss mask, and where those tokens sit (`index`, `mask`: `(N, T_max)`).

    Cached by content (tokens, prompt indices, arguments): the same samples collated again get
    the same tensors back, which callers must not modify.

    Packed, the samples of one prompt share its tokens (`pack_shared_prefix`), so a group computes
    its prompt once. Rows are at most twice the longest segment wide (and at most `row_capacity`):
    attention is dense within a row, so one row of a whole micro-batch costs more than the
    padding it saves. The width is rounded up to `width_multiple` (`Batch.widened`).
    """
    key = (pad_id, packing, row_capacity, width_multiple,
           tuple((s.prompt_index, tuple(s.prompt_ids), tuple(s.response_ids),
                  None if s.action_mask is None else tuple(s.action_mask)) for s in samples))
    hit = _COLLATED.get(key)
    if hit is not None:
        _COLLATED.move_to_end(key)
        return hit
    out = _collate(samples, pad_id, packing, row_capacity, width_multiple)
    _COLLATED[key] = out
    while len(_COLLATED) > COLLATE_CACHE_SIZE:
        _COLLATED.popitem(last=False)
    return out


def _collate(samples: list[RolloutSample], pad_id: int, packing: bool, row_capacity: int | None,
             width_multiple: int) -> tuple[Batch, torch.Tensor, torch.Tensor]:
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    masks = [[0] * len(s.prompt_ids) + s.loss_mask for s in samples]
    groups = prompt_groups(samples)
    if packing and len(groups) < len(samples):
        longest = max(len(seqs[g[0]]) + sum(len(samples[i].response_ids) for i in g[1:]) for g in groups)
        capacity = 2 * longest if row_capacity is None else max(longest, min(row_capacity, 2 * longest))
        batch = pack_shared_prefix(seqs, masks, groups, capacity, pad_id)
    else:
        longest = max(len(q) for q in seqs)
        capacity = None if row_capacity is None else max(longest, min(row_capacity, 2 * longest))
        batch = make_batch(seqs, masks, pad_id, packing, capacity)
    batch = batch.widened(width_multiple, pad_id)
    index, mask = response_index(batch)
    return batch, index, mask


def stack(values: list[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """Right-pad `(T_i,)` tensors with zeros into `(N, width)` float32 (width: the longest)."""
    width = width if width is not None else max(v.numel() for v in values)
    out = torch.zeros((len(values), width), dtype=torch.float32)
    for i, v in enumerate(values):
        out[i, : v.numel()] = v.float()
    return out


def unstack(matrix: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    """The inverse of `stack`: row i cut to `lengths[i]` (along the last dimension), on CPU."""
    matrix = matrix.detach().float().cpu()
    return TensorRows(matrix[i, ..., :n].clone() for i, n in enumerate(lengths))


def old_logprob_sums(old: list[torch.Tensor], engine: list[torch.Tensor], trainer: list[torch.Tensor],
                     ref: list[torch.Tensor] | None, estimator: str) -> torch.Tensor:
    """Pure: the sums behind a step's `rollout/logprob_mismatch` and `rollout/kl`, over samples'
    response tokens: (sum of |engine - trainer| log-probs, tokens, sum of the KL estimate of `old`
    against `ref`, samples), float64. Sums, so that ranks' shares add up (all-reduce) before
    `old_logprob_metrics` divides. `trainer`: the policy's log-probs under the engine's sampling
    distribution (the old log-probs themselves where it samples unfiltered); `ref` None: no KL."""
    sums = torch.zeros(4, dtype=torch.float64)
    if not old:
        return sums
    sums[0] = (torch.cat(engine).double() - torch.cat(trainer).double()).abs().sum()
    sums[1], sums[3] = sum(len(lp) for lp in old), len(old)
    if ref is not None:
        sums[2] = kl_penalty(torch.cat(old), torch.cat(ref), estimator).double().sum()
    return sums


def old_logprob_metrics(sums: torch.Tensor) -> dict[str, float]:
    """`rollout/logprob_mismatch` (per token) and `rollout/kl` (per sample) from `old_logprob_sums`."""
    return {"rollout/logprob_mismatch": (sums[0] / sums[1].clamp(min=1)).item(),
            "rollout/kl": (sums[2] / sums[3].clamp(min=1)).item()}


def step_reward_matrix(samples: list[RolloutSample], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rewards, mask)`, each `(N, width)`: each sample's process rewards (`extra["step_rewards"]`:
    `(token index, reward)` pairs) at their tokens, plus its penalty (`extra["penalty"]`, the
    overlong and truncation penalties' change to its reward) on its last token."""
    rewards, mask = torch.zeros((len(samples), width)), torch.zeros((len(samples), width))
    for i, s in enumerate(samples):
        for position, value in s.extra.get("step_rewards", []):
            rewards[i, position] += value
            mask[i, position] = 1
        penalty = s.extra.get("penalty", 0.0)
        if penalty and s.response_len:
            rewards[i, s.response_len - 1] += penalty
            mask[i, s.response_len - 1] = 1
    return rewards, mask
