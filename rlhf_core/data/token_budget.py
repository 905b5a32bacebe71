"""Micro-batches by a token budget instead of a sample count (`--use_dynamic_batch`).

A step's samples are cut into as few micro-batches as the budget allows, and every rank of a role
cuts its share into the same number (ZeRO reduces gradients once per micro-batch boundary on
every rank alike): `micro_batch_count` is what one rank needs, the role takes the largest, and
`balanced_groups` splits each rank's samples into that many groups of near-equal tokens. A sample
longer than the budget is a micro-batch of its own. The loss does not depend on the split: the
trainers normalise by the units of the whole step (`trainers/loop.optimizer_step`).

Pure functions of token counts; no tensors.
"""

from __future__ import annotations


def micro_batch_count(lengths: list[int], budget: int) -> int:
    """The number of micro-batches first-fit decreasing packs `lengths` into, none over `budget`
    (a longer sample alone in one); 0 for no samples."""
    if budget < 1:
        raise ValueError(f"a token budget must be >= 1, got {budget}")
    loads: list[int] = []
    for n in sorted(lengths, reverse=True):
        for i, load in enumerate(loads):
            if load + n <= budget:
                loads[i] += n
                break
        else:
            loads.append(n)
    return len(loads)


def balanced_groups(lengths: list[int], count: int) -> list[list[int]]:
    """Indices into `lengths` in `count` groups of near-equal token sums (longest first, each to the
    lightest group), each group in the original order. Fewer samples than groups leave groups empty."""
    if count < 1:
        raise ValueError(f"the number of groups must be >= 1, got {count}")
    groups: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        lightest = min(range(count), key=lambda g: (loads[g], g))
        groups[lightest].append(i)
        loads[lightest] += lengths[i]
    return [sorted(g) for g in groups]


def group_count(lengths: list[int], budget: int) -> int:
    """How many `balanced_groups` to cut `lengths` into so that none over `budget` holds more than one
    sample: first-fit decreasing's count (`micro_batch_count`), more where the near-equal split
    would overrun the budget that first-fit kept (it can: near-equal is not first-fit)."""
    count = micro_batch_count(lengths, budget)
    while count and any(len(g) > 1 and sum(lengths[i] for i in g) > budget for g in balanced_groups(lengths, count)):
        count += 1
    return count


def budget_chunks(lengths: list[int], budget: int, padded: bool = False) -> list[list[int]]:
    """Consecutive runs of indices whose tokens fit `budget` (a longer sample alone): the no-grad
    passes' chunks, in order, with nothing to keep in step across ranks. `padded`: a chunk costs
    its rows x its longest row (a padded batch), not the sum of its lengths (a packed one)."""
    chunks: list[list[int]] = []
    total = longest = 0
    for i, n in enumerate(lengths):
        cost = (len(chunks[-1]) + 1) * max(longest, n) if padded and chunks else total + n
        if chunks and cost <= budget:
            chunks[-1].append(i)
            total, longest = total + n, max(longest, n)
        else:
            chunks.append([i])
            total = longest = n
    return chunks


# -- The supervised trainers' micro-batches: samples of one or more sequences (a pair: two) --------
# A sample is its sequences' lengths. Packed, a micro-batch costs its tokens; padded, its rows x its
# longest sequence (every sample of a stage has as many sequences, so a padded budget is one of
# `budget // rows` slots per row).

def _padded(samples: list[tuple[int, ...]], budget: int) -> tuple[list[int], int]:
    """Each sample's longest sequence, and the budget per row."""
    rows = max((len(s) for s in samples), default=1)
    return [max(s) for s in samples], max(1, budget // rows)


def step_micro_batches(shares: list[list[tuple[int, ...]]], rank: int, budget: int, padded: bool
                       ) -> list[list[int]]:
    """Rank `rank`'s share of an optimizer step in micro-batches within `budget` token slots (a
    sample over it alone): positions into `shares[rank]`, each micro-batch in share order. Every
    rank gets as many micro-batches as the share that needs most (ZeRO reduces at the boundary on
    all ranks alike); every rank knows every share, so no collective is needed. Packed, near-equal
    token sums (`balanced_groups` in `group_count` groups, the largest any share needs); padded,
    samples of similar length together (longest first), so padding stays small. The shares are of equal size."""
    if budget < 1:
        raise ValueError(f"a token budget must be >= 1, got {budget}")
    if not padded:
        tokens = [[sum(s) for s in share] for share in shares]
        return balanced_groups(tokens[rank], max(group_count(t, budget) for t in tokens))

    def longest_first(share):
        longest, per_row = _padded(share, budget)
        order = sorted(range(len(share)), key=lambda i: (-longest[i], i))
        return [[order[k] for k in run] for run in budget_chunks([longest[i] for i in order], per_row, padded=True)]

    count = max(len(longest_first(share)) for share in shares)
    runs = longest_first(shares[rank])
    while len(runs) < count:  # split the run of most samples in two
        k = max(range(len(runs)), key=lambda k: (len(runs[k]), -k))
        half = (len(runs[k]) + 1) // 2
        runs[k:k + 1] = [runs[k][:half], runs[k][half:]]
    return [sorted(run) for run in runs]


def consecutive_chunks(samples: list[tuple[int, ...]], budget: int, padded: bool) -> list[list[int]]:
    """Consecutive runs of sample indices within `budget` token slots (a longer sample alone): the
    no-grad passes' chunks (evaluation), with nothing to keep in step across ranks."""
    if padded:
        longest, per_row = _padded(samples, budget)
        return budget_chunks(longest, per_row, padded=True)
    return budget_chunks([sum(s) for s in samples], budget)
