"""RingAttention: sequence parallelism over the ranks of a ring group (`--ds.ring_attn_size`).

The ranks of a group (consecutive ranks, `ring_attn_size` of them; with DeepSpeed's AutoTP beside
it, every `tensor_parallel_size`-th rank, so that each ring position is a tensor-parallel group:
`ring_ranks`) take the same micro-batch and split its width: rank r of the ring holds columns `[r c, (r + 1) c)` of every row (the batch
padded to a multiple of the ring). Everything a token does alone (embedding, norms, projections,
MLP, the head at the positions a loss reads) runs on the rank that holds it; attention needs every
key of the row, so each layer all-gathers the keys and values, `ring_attn_head_stride` key/value
heads at a time (the memory of one gather is that many heads of the whole row), and attends its own
queries to them through their rows of the full mask: packed samples, shared-prompt pairs and
padding attend exactly as on one rank.

Gradients: a gathered key's gradient comes from every rank's queries, so the gather's backward
sums the gradients over the ring (all-reduce) and keeps the own slice. The quantities the losses
read (logits or scores at given positions) are computed by the rank that holds each position and
summed over the ring (the others add exact zeros); every rank then computes the same loss from the
same numbers, so that sum's backward hands each rank the loss's gradient unchanged. Each rank's
parameter gradients are then its share of the group's, and their sum is one rank's gradient of the
whole batch: DeepSpeed averages over all ranks, which the training loop's scale accounts for
(`trainers/loop.optimizer_step`, `duplicates`).

All of it is plain `torch.distributed` (all-gather, all-reduce): gloo on a CPU, NCCL on GPUs. The
attention itself is matmul attention on the gathered keys (`models/attention.matmul_attention`),
not ring-flash-attn's fused kernel: on a GPU the same algorithm runs with dense attention, so its
memory is that of one row's scores per head stride. Registered with transformers' attention
interface under `NAME`, so any model family whose attention goes through that interface runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlhf_core.data.batching import Batch
from rlhf_core.models.attention import batch_mask, compute_dtype, matmul_attention

NAME = "rlhf_ring"


@dataclass(frozen=True)
class Ring:
    """This rank's ring group: `size` ranks, this one the `rank`-th, gathering `head_stride` key/value heads at a time."""

    group: object
    size: int
    rank: int
    head_stride: int

    def shard(self, batch: Batch) -> Shard:
        """This rank's columns of `batch`, with their rows of the full attention mask."""
        return Shard.of(batch, self)


_CURRENT: Ring | None = None


def current() -> Ring | None:
    """The ring this process trains in, or None (no sequence parallelism)."""
    return _CURRENT


def ring_ranks(world: int, size: int, tensor_parallel: int = 1) -> list[list[int]]:
    """The rings of `world` ranks (pure): blocks of `size x tensor_parallel` consecutive ranks take
    the same batches; in a block, DeepSpeed's AutoTP groups `tensor_parallel` consecutive ranks (a
    ring position's: they split each linear layer), and the ranks of one slice, one per position,
    form a ring (every `tensor_parallel`-th rank). Without tensor parallelism: consecutive ranks."""
    block = size * tensor_parallel
    if world % block:
        raise ValueError(f"--ds.ring_attn_size {size} x --ds.tensor_parallel_size {tensor_parallel} must divide "
                         f"the ranks ({world})")
    return [[start + position * tensor_parallel + t for position in range(size)]
            for start in range(0, world, block) for t in range(tensor_parallel)]


def setup(size: int, head_stride: int, tensor_parallel: int = 1) -> Ring | None:
    """Form the ring groups (`ring_ranks`; every rank calls this: forming a group is collective) and
    register the attention function; returns this rank's ring (None for size 1)."""
    global _CURRENT
    if size == 1:
        _CURRENT = None
        return None
    world, rank = dist.get_world_size(), dist.get_rank()
    mine = None
    for ranks in ring_ranks(world, size, tensor_parallel):
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = Ring(group, size, ranks.index(rank), head_stride)
    register()
    _CURRENT = mine
    return mine


def register() -> str:
    """Make `NAME` a valid `attn_implementation` in this process (idempotent); returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, ring_attention_forward)
        AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


@dataclass(frozen=True)
class Shard:
    """A rank's columns `[start, start + width)` of a batch `T` columns wide, as a `Batch` whose
    `attention_mask` holds their rows of the whole (padded) batch's mask, `(rows, 1, width, size * width)`."""

    local: Batch
    start: int
    width: int
    full_width: int  # T, before padding to a multiple of the ring

    @classmethod
    def of(cls, batch: Batch, ring: Ring) -> Shard:
        rows, t = batch.input_ids.shape
        width = -(-t // ring.size)
        pad = width * ring.size - t
        mask, ids, pos = batch.attention_mask, batch.input_ids, batch.position_ids
        loss, seq = batch.loss_mask, batch.seq_ids
        if pad:
            # Padding columns: positions continue the row's last, no loss, no sample, and no real
            # token attends to them (after every real token; a padding mask's zeros; a 4-D mask's
            # own rows and columns, where they see themselves only).
            ids = torch.nn.functional.pad(ids, (0, pad))
            pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
            loss = torch.nn.functional.pad(loss, (0, pad))
            seq = torch.nn.functional.pad(seq, (0, pad), value=-1)
            if mask is not None and mask.dim() == 2:
                mask = torch.nn.functional.pad(mask, (0, pad))
            elif mask is not None:
                mask = torch.nn.functional.pad(mask.bool(), (0, pad, 0, pad))
                tail = torch.arange(t, t + pad, device=mask.device)
                mask[:, :, tail, tail] = True
        cols = slice(ring.rank * width, (ring.rank + 1) * width)
        own = batch_mask(mask, pos, queries=cols).expand(rows, 1, width, width * ring.size)  # this rank's rows only
        local = Batch(ids[:, cols], own, pos[:, cols], loss[:, cols], seq[:, cols], batch.num_samples)
        return cls(local, ring.rank * width, width, t)

    def owned(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For flat positions `index` into the whole batch (`rows * T`): `(mine, local)`, whether this
        rank holds each, and its flat position in the shard (`rows * width`; 0 where not mine)."""
        row, col = index // self.full_width, index % self.full_width
        mine = (col >= self.start) & (col < self.start + self.width)
        local = torch.where(mine, row * self.width + col - self.start, torch.zeros_like(index))
        return mine, local


def at_positions(ring: Ring, batch: Batch, index: torch.Tensor, hidden_of, head, which: bool = False) -> torch.Tensor:
    """`head(hidden states at the flat positions index)` of the whole `batch`, computed across the
    ring: `hidden_of(local_batch) -> (rows, width, hidden)` runs on this rank's shard, `head` on the
    positions it holds, and the ring sums the results (`index` of any shape: `(*index.shape, out)`).
    `which`: `head(hidden, positions)` is also told which entries of `index.reshape(-1)` its rows are
    (a head that reads each position's own label: log-probs, which the ring then sums instead of
    whole-vocabulary logits)."""
    shard = ring.shard(batch)
    hidden = hidden_of(shard.local)
    mine, local = shard.owned(index)
    owned = mine.reshape(-1).nonzero().squeeze(-1)
    rows = hidden.reshape(-1, hidden.shape[-1])[local.reshape(-1)[owned]]  # the head on this rank's rows only
    part = head(rows, owned) if which else head(rows)
    out = part.new_zeros((mine.numel(), part.shape[-1])).index_put((owned,), part)
    return _SumOverRing.apply(out.reshape(*index.shape, part.shape[-1]), ring)


class _SumOverRing(torch.autograd.Function):
    """Sum over the ring; backward: the gradient unchanged (every rank computes the same loss from
    the sum, so each one's gradient of it is the loss's gradient of its own summand)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ring: Ring) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=ring.group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """`(B, H, width, D)` -> `(B, H, size * width, D)`, the ring's shards in order; backward: the
    gradients of every rank summed, the own slice kept."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ring: Ring) -> torch.Tensor:
        ctx.ring = ring
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(ring.size)]
        dist.all_gather(parts, x, group=ring.group)
        return torch.cat(parts, dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ring = ctx.ring
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ring.group)
        width = total.shape[2] // ring.size
        return total[:, :, ring.rank * width : (ring.rank + 1) * width], None


def gather_sequence(x: torch.Tensor, ring: Ring) -> torch.Tensor:
    return _GatherSequence.apply(x, ring)


def ring_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                           scaling: float | None = None, **kwargs):
    """transformers' attention call on a shard: `query (B, H, width, D)`, `key`/`value` `(B, KV,
    width, D)`, `attention_mask (B, 1, width, size * width)` bool (the shard's rows, `Shard.of`).
    Returns `(B, width, H, D)`."""
    ring = current()
    if ring is None:
        raise RuntimeError(f"attention implementation {NAME!r} outside a ring (models/ring.setup)")
    if attention_mask is None or attention_mask.dtype != torch.bool or \
            attention_mask.shape[-1] != key.shape[-2] * ring.size:
        raise RuntimeError(f"{NAME}: a forward over a batch not split by the ring (models/ring.Shard): keys "
                           f"{key.shape[-2]} x {ring.size} ranks, mask {tuple(attention_mask.shape) if attention_mask is not None else None}")
    if kwargs.get("s_aux") is not None or kwargs.get("sinks") is not None:
        raise NotImplementedError(f"{NAME}: attention sinks (gpt-oss's) are not built into ring attention")
    window = kwargs.get("sliding_window")
    if window is not None:  # transformers' rule, by column: a query sees the keys less than `window` before it
        width = query.shape[-2]
        rows = torch.arange(ring.rank * width, (ring.rank + 1) * width, device=query.device)
        cols = torch.arange(attention_mask.shape[-1], device=query.device)
        attention_mask = attention_mask & (rows[:, None] - cols[None, :] < window)
    dtype = compute_dtype(query)
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    kv_heads = key.shape[1]
    groups = query.shape[1] // kv_heads
    outs = []
    for first in range(0, kv_heads, ring.head_stride):
        last = min(first + ring.head_stride, kv_heads)
        keys = gather_sequence(key[:, first:last], ring)
        values = gather_sequence(value[:, first:last], ring)
        outs.append(matmul_attention(query[:, first * groups : last * groups], keys, values, attention_mask, scale,
                                     causal=False, dropout=dropout, training=module.training,
                                     softcap=kwargs.get("softcap")))
    return torch.cat(outs, dim=2), None
