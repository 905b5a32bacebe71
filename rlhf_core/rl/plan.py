"""One rollout step's plan: the order each PPO epoch visits the samples in, every rank's share, and
which samples' old log-probs the training forward computes itself.

The controller builds it once per step; the experience passes and every trainable role read the
same plan, so the orders cannot drift apart. Each epoch is a seeded permutation cut into global
optimizer steps of `--train.batch_size`; rank r takes its contiguous slice of every step, so one
rank and two ranks make the same updates. Where a rank's slice of a step holds whole prompt groups,
groups are permuted together and a micro-batch computes each prompt once (`experience.collate`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def rank_orders(count: int, batch_size: int, world_size: int, seed: int, group_size: int = 1) -> list[list[int]]:
    """Sample indices for each rank, in training order: its slice of every global step of a seeded
    permutation of `range(count)`; samples past the last whole step are left out.

    group_size: n > 1 (n consecutive samples per prompt) permutes whole groups when `count` and a
    rank's share of a step (`batch_size // world_size`) are multiples of n, else single samples."""
    per_rank = batch_size // world_size
    n = group_size if group_size > 1 and count % group_size == 0 and per_rank % group_size == 0 else 1
    groups = torch.randperm(count // n, generator=torch.Generator().manual_seed(seed)).tolist()
    order = [g * n + k for g in groups for k in range(n)]
    steps = [order[i : i + batch_size] for i in range(0, len(order) - batch_size + 1, batch_size)]
    return [[i for step in steps for i in step[r * per_rank : (r + 1) * per_rank]] for r in range(world_size)]


@dataclass(frozen=True)
class RankWork:
    """What one rank of a trainable role gets once per step: its samples (indices into the rollout,
    each once) and, per epoch, positions into them in training order."""

    samples: list[int]
    epochs: list[list[int]]


@dataclass(frozen=True)
class StepPlan:
    count: int  # samples in the rollout
    batch_size: int  # one global optimizer step (--train.batch_size)
    group_size: int  # samples per prompt, next to each other
    epoch_seeds: tuple[int, ...]  # one permutation per PPO epoch
    leave_first_step: bool  # the first optimizer step's old log-probs come from its training forward
    # the actor computes the other old log-probs itself, before its first update, where nothing
    # before training reads them (no KL in the reward): no separate experience pass for the policy
    old_in_training: bool = False
    _orders: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # (epoch, world) -> orders

    def orders(self, epoch: int, world_size: int) -> list[list[int]]:
        """Each rank's sample indices in `epoch`'s training order (drawn once per plan and world size)."""
        key = (epoch, world_size)
        if key not in self._orders:
            self._orders[key] = rank_orders(self.count, self.batch_size, world_size, self.epoch_seeds[epoch],
                                            self.group_size)
        return [list(rank) for rank in self._orders[key]]

    def work(self, world_size: int) -> list[RankWork]:
        """Each rank's samples and epoch orders for a role of `world_size` ranks."""
        per_epoch = [self.orders(e, world_size) for e in range(len(self.epoch_seeds))]
        out = []
        for r in range(world_size):
            position: dict[int, int] = {}
            for order in per_epoch:
                for i in order[r]:
                    position.setdefault(i, len(position))
            out.append(RankWork(list(position), [[position[i] for i in order[r]] for order in per_epoch]))
        return out

    def experience_order(self, world_size: int) -> list[int]:
        """Every sample, in the order the first epoch trains on them (rank by rank), then any it
        leaves out: the experience passes then run on the micro-batches training will use."""
        order = [i for rank in self.orders(0, world_size) for i in rank]
        seen = set(order)
        return order + [i for i in range(self.count) if i not in seen]

    def on_policy(self, world_size: int) -> set[int]:
        """The samples of the first global optimizer step when `leave_first_step`: the policy that
        sampled them trains on them, so their old log-probs are the training forward's own,
        detached (PPO's ratio is exactly 1 there), with no separate no-grad pass."""
        if not self.leave_first_step:
            return set()
        per_rank = self.batch_size // world_size
        return {i for rank in self.orders(0, world_size) for i in rank[:per_rank]}

    def old_positions(self, world_size: int) -> list[list[int]]:
        """With `old_in_training`: per rank, the positions into its `work` samples whose old
        log-probs it computes before training (all but the on-policy ones), in training order."""
        left = self.on_policy(world_size)
        return [[p for p, i in enumerate(w.samples) if i not in left] for w in self.work(world_size)]
