"""Batches: right-padded or packed (padding-free), and the deterministic global batch order.

Both layouts carry `seq_ids (rows, T)`: the index of the sample each token belongs to, -1 for
padding. Per-sample sums (sequence log-probs, last-token scores) are computed from `seq_ids`
alone, so losses never care which layout produced them.

Packing puts a micro-batch in rows with no attention mask; position ids restart at 0 for each
sample, and transformers reads sample boundaries from those restarts (SDPA, eager, flash-attn; no
KV cache), so attention stays inside each sample.

An epoch's order is a seeded permutation cut into global batches; rank r takes its slice of each.
Resuming at (epoch, step) replays the same data, and a step's data does not depend on world size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from rlhf_core.data.token_budget import step_micro_batches


@dataclass
class Batch:
    input_ids: torch.Tensor  # (rows, T)
    # (rows, T) for padded; None for packed; (rows, 1, T, T) bool (True = attend) for shared-prefix pairs
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor  # (rows, T)
    loss_mask: torch.Tensor  # (rows, T) float, 1 on tokens that carry loss
    seq_ids: torch.Tensor  # (rows, T) long, sample index or -1 for padding
    num_samples: int
    # (k, 3) long [row, position, predicting position]: tokens whose logits come from an earlier
    # position than the previous one (a rejected response after its shared prompt); None: none.
    predecessors: torch.Tensor | None = None

    def to(self, device) -> Batch:
        def move(t):
            return t if t is None or device is None else t.to(device)

        return Batch(move(self.input_ids), move(self.attention_mask), move(self.position_ids), move(self.loss_mask),
                     move(self.seq_ids), self.num_samples, move(self.predecessors))

    def widened(self, multiple: int, pad_id: int = 0) -> Batch:
        """This batch with its width rounded up to a multiple of `multiple` (`models/shapes.py`): the
        slots added are padding (no loss, sample -1) that attends only to padding, so every sample's
        log-probs and scores are what they were."""
        rows, width = self.input_ids.shape
        extra = -width % multiple
        if not extra:
            return self
        device = self.input_ids.device
        # Padding continues a row's trailing padding, else starts its own run at position 0: a new
        # packed sample to the restarted-position rule, and keys a 2-D mask hides.
        ends_padded = self.seq_ids[:, -1:] < 0
        start = torch.where(ends_padded, self.position_ids[:, -1:] + 1, torch.zeros_like(ends_padded, dtype=torch.long))
        positions = start + torch.arange(extra, device=device)
        mask = self.attention_mask
        if mask is not None and mask.dim() == 2:
            mask = torch.nn.functional.pad(mask, (0, extra))
        elif mask is not None:  # (rows, 1, T, T): each added slot attends to itself alone
            mask = torch.nn.functional.pad(mask, (0, extra, 0, extra))
            added = torch.arange(width, width + extra, device=device)
            mask[..., added, added] = True
        return Batch(torch.nn.functional.pad(self.input_ids, (0, extra), value=pad_id), mask,
                     torch.cat([self.position_ids, positions], dim=-1),
                     torch.nn.functional.pad(self.loss_mask, (0, extra)),
                     torch.nn.functional.pad(self.seq_ids, (0, extra), value=-1), self.num_samples, self.predecessors)

    @property
    def last_token_index(self) -> torch.Tensor:
        """Flat index (into rows*T) of each sample's last token: `(num_samples,)`."""
        flat = self.seq_ids.reshape(-1)
        positions = torch.arange(flat.numel(), device=flat.device)
        last = torch.full((self.num_samples,), -1, dtype=torch.long, device=flat.device)
        valid = flat >= 0
        return last.scatter_reduce(0, flat[valid], positions[valid], reduce="amax")


def pad_batch(seqs: list[list[int]], loss_masks: list[list[int]], pad_id: int) -> Batch:
    """Right-pad sequences into `(B, T_max)`."""
    width = max(len(s) for s in seqs)
    n = len(seqs)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    loss = torch.zeros((n, width), dtype=torch.float32)
    seq_ids = torch.full((n, width), -1, dtype=torch.long)
    for i, (s, m) in enumerate(zip(seqs, loss_masks, strict=True)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention[i, : len(s)] = 1
        loss[i, : len(s)] = torch.tensor(m, dtype=torch.float32)
        seq_ids[i, : len(s)] = i
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    return Batch(input_ids, attention, position_ids, loss, seq_ids, n)


def pack_batch(seqs: list[list[int]], loss_masks: list[list[int]], row_capacity: int | None = None,
               pad_id: int = 0) -> Batch:
    """Pack sequences into rows, attention confined to each sample by restarting position ids.

    `row_capacity=None`: one row `(1, sum(len))` (flash-attn's variable-length kernels). With a
    capacity, rows of at most that many tokens (`least_padded_rows`): SDPA/eager build a dense mask
    per row, so short rows keep attention linear in the batch, not quadratic. Row ends are padding
    with restarted positions, `seq_ids` -1 and no loss.
    """
    lengths = [len(s) for s in seqs]
    rows = first_fit_rows(lengths, None) if row_capacity is None else least_padded_rows(lengths, row_capacity)
    width = max(sum(lengths[i] for i in members) for members in rows)
    # Built as Python lists and converted once: four small tensor writes per sample cost more
    # than the packing itself on a tiny model's step.
    ids_rows, pos_rows, loss_rows, seq_rows = [], [], [], []
    for members in rows:
        ids, pos, loss, seq = [], [], [], []
        for i in members:
            n = lengths[i]
            ids += seqs[i]
            pos += range(n)
            loss += loss_masks[i]
            seq += [i] * n
        rest = width - len(ids)
        ids_rows.append(ids + [pad_id] * rest)
        pos_rows.append(pos + list(range(rest)))
        loss_rows.append(loss + [0] * rest)
        seq_rows.append(seq + [-1] * rest)
    return Batch(torch.tensor(ids_rows, dtype=torch.long), None, torch.tensor(pos_rows, dtype=torch.long),
                 torch.tensor(loss_rows, dtype=torch.float32), torch.tensor(seq_rows, dtype=torch.long), len(seqs))


def first_fit_rows(lengths: list[int], capacity: int | None) -> list[list[int]]:
    """First-fit decreasing: sample indices per row, no row over `capacity` (None: one row)."""
    return _first_fit(sorted(range(len(lengths)), key=lambda i: -lengths[i]), lengths, capacity)[0]


def _first_fit(order: list[int], lengths: list[int], capacity: int | None) -> tuple[list[list[int]], list[int]]:
    """First fit of the samples in `order`: `(rows, tokens per row)`."""
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        n = lengths[i]
        if capacity is None:
            slot = 0 if rows else None
        else:
            limit = capacity - n
            slot = next((r for r, used in enumerate(loads) if used <= limit), None)
        if slot is None:
            rows.append([])
            loads.append(0)
            slot = len(rows) - 1
        rows[slot].append(i)
        loads[slot] += n
    return rows, loads


WIDTH_CANDIDATES = 16


def least_padded_rows(lengths: list[int], capacity: int) -> list[list[int]]:
    """First-fit rows at the width (of WIDTH_CANDIDATES from the longest sample to `capacity`) with
    the fewest slots (rows x width); the narrower on ties (cheaper attention). A heuristic, not an
    exact bin packing. Why not just `capacity`: 800 tokens of 16-35-token samples take 14 rows of 64
    (896 slots), where 13 rows of 62 (806) might do.
    """
    longest = max(lengths)
    if longest >= capacity:
        return first_fit_rows(lengths, capacity)
    step = max(1, -(-(capacity - longest) // (WIDTH_CANDIDATES - 1)))
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    best = None
    for width in [*range(longest, capacity, step), capacity]:
        rows, loads = _first_fit(order, lengths, width)
        used = max(loads)
        cost = (len(rows) * used, used)
        if best is None or cost < best[0]:
            best = (cost, rows)
    return best[1]


def shared_prefix_len(a: list[int], b: list[int], mask_a: list[int], mask_b: list[int]) -> int:
    """Length of the common start of two sequences that carries no loss in either (their prompt)."""
    n = 0
    for x, y, ma, mb in zip(a, b, mask_a, mask_b, strict=False):
        if x != y or ma or mb:
            break
        n += 1
    return n


def pack_pairs(chosen: list[list[int]], rejected: list[list[int]], chosen_masks: list[list[int]],
               rejected_masks: list[list[int]], row_capacity: int, pad_id: int = 0) -> Batch:
    """Chosen and rejected packed with their shared prompt computed once (`pack_shared_prefix`,
    groups `[i, n + i]`): chosen i is sample i, rejected i is sample n + i, as in
    `pack_batch(chosen + rejected)`."""
    n = len(chosen)
    return pack_shared_prefix(chosen + rejected, chosen_masks + rejected_masks, [[i, n + i] for i in range(n)],
                              row_capacity, pad_id)


def pack_shared_prefix(seqs: list[list[int]], loss_masks: list[list[int]], groups: list[list[int]],
                       row_capacity: int, pad_id: int = 0) -> Batch:
    """Sequences packed so that each group's common prompt is computed once.

    `groups` partitions the sample indices; a group (a DPO pair, an RL prompt's samples) becomes one
    segment `[prompt | response 1 | response 2 | ...]`, the prompt being the longest loss-free start
    all members share. A response attends to the prompt and itself, never its siblings, with
    positions continuing the prompt's, so every token sees what it sees in its own sequence: log-probs
    and scores equal those packed apart. A later response's first token is predicted by the prompt's
    last position (`Batch.predecessors`). Prompt tokens belong to the group's first sample. Segments
    go in rows of up to `row_capacity` (`least_padded_rows`); padding attends only to itself.
    """
    shared = []
    for members in groups:
        first = members[0]
        shared.append(min((shared_prefix_len(seqs[first], seqs[i], loss_masks[first], loss_masks[i])
                           for i in members[1:]), default=0))
    lengths = [len(seqs[g[0]]) + sum(len(seqs[i]) - s for i in g[1:]) for g, s in zip(groups, shared, strict=True)]
    rows = least_padded_rows(lengths, row_capacity)
    width = max(sum(lengths[i] for i in members) for members in rows)
    # Per slot, as lists: token, position, loss, sample, segment, member of the segment, prompt or not.
    cols: dict[str, list[list]] = {k: [] for k in ("ids", "pos", "loss", "seq", "segment", "member", "prompt")}
    predecessors = []
    for r, segments in enumerate(rows):
        row = {k: [] for k in cols}
        for g in segments:
            s, prompt_end = shared[g], len(row["ids"]) + shared[g]
            for k, i in enumerate(groups[g]):
                offset = 0 if k == 0 else s  # the first member carries the prompt
                if k and s and len(seqs[i]) > s:
                    predecessors.append((r, len(row["ids"]), prompt_end - 1))
                m = len(seqs[i]) - offset
                row["ids"] += seqs[i][offset:]
                row["pos"] += range(offset, offset + m)
                row["loss"] += loss_masks[i][offset:]
                row["seq"] += [i] * m
                row["segment"] += [g] * m
                row["member"] += [k] * m
                row["prompt"] += [k == 0 and t < s for t in range(m)]
        pad = width - len(row["ids"])
        for k, fill in (("ids", [pad_id] * pad), ("pos", range(pad)), ("loss", [0] * pad), ("seq", [-1] * pad),
                        ("segment", range(-1, -1 - pad, -1)), ("member", [0] * pad), ("prompt", [False] * pad)):
            row[k] += fill  # padding: its own segment per slot, so it attends only to itself
            cols[k].append(row[k])
    segment, member, prompt = (torch.tensor(cols[k]) for k in ("segment", "member", "prompt"))
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    same_segment = segment.unsqueeze(-1) == segment.unsqueeze(-2)
    visible = (member.unsqueeze(-1) == member.unsqueeze(-2)) | prompt.unsqueeze(-2)
    allowed = causal & same_segment & visible
    jumps = torch.tensor(predecessors, dtype=torch.long).reshape(-1, 3)
    return Batch(torch.tensor(cols["ids"], dtype=torch.long), allowed.unsqueeze(1),
                 torch.tensor(cols["pos"], dtype=torch.long), torch.tensor(cols["loss"], dtype=torch.float32),
                 torch.tensor(cols["seq"], dtype=torch.long), len(seqs), jumps)


def make_batch(seqs, loss_masks, pad_id: int, packing: bool, row_capacity: int | None = None) -> Batch:
    if packing:
        return pack_batch(seqs, loss_masks, row_capacity, pad_id)
    return pad_batch(seqs, loss_masks, pad_id)


@dataclass(frozen=True)
class BatchPlan:
    """Which example indices rank `rank` uses at each optimizer step of each epoch: micro-batches of
    `micro_batch` examples, or (`micro_batch` None) by `token_budget` token slots, from each
    example's sequence `lengths` (`data/token_budget.step_micro_batches`; `padded`: a micro-batch
    costs its rows x its longest sequence)."""

    num_examples: int
    global_batch: int
    micro_batch: int | None
    rank: int
    world_size: int
    seed: int
    lengths: tuple[tuple[int, ...], ...] = ()
    token_budget: int = 0
    padded: bool = False

    @property
    def steps_per_epoch(self) -> int:
        return self.num_examples // self.global_batch

    def micro_batches(self, epoch: int, step: int) -> list[list[int]]:
        order = _epoch_order(self.num_examples, self.seed + epoch)
        batch = order[step * self.global_batch : (step + 1) * self.global_batch].tolist()
        per_rank = self.global_batch // self.world_size
        shares = [batch[r * per_rank : (r + 1) * per_rank] for r in range(self.world_size)]
        mine = shares[self.rank]
        if self.micro_batch is not None:
            return [mine[i : i + self.micro_batch] for i in range(0, per_rank, self.micro_batch)]
        groups = step_micro_batches([[self.lengths[i] for i in share] for share in shares], self.rank,
                                    self.token_budget, self.padded)
        return [[mine[j] for j in group] for group in groups]


@lru_cache(maxsize=2)
def _epoch_order(num_examples: int, seed: int) -> torch.Tensor:
    return torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed))
