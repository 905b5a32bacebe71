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
