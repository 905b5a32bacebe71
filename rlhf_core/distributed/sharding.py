"""The one rule for splitting a batch over the ranks of a role: equal contiguous shards.

Ranks must run the same number of forward passes (ZeRO-3 ranks gather parameters together and
must not fall out of step), and contiguous shards whose size is a multiple of the micro-batch make
each rank's micro-batches those of one rank, so metrics agree with a single rank's. A batch that
does not divide is either padded with its last item (`pad=True`: every item is computed, the
caller drops the padding's results) or cut short (the last `len % world_size` items left out).
"""

from __future__ import annotations


def shards(items: list, world_size: int, *, pad: bool) -> list[list]:
    """`items` in `world_size` equal contiguous shards (see the module docstring for `pad`), each of
    the type of `items` where that is a list (a list type may pickle its own way)."""
    kind = type(items) if isinstance(items, list) else list
    if pad:
        if not items:
            raise ValueError("an empty batch has nothing to shard")
        size = -(-len(items) // world_size)
        items = list(items) + [items[-1]] * (size * world_size - len(items))
    else:
        size = len(items) // world_size
    return [kind(items[r * size : (r + 1) * size]) for r in range(world_size)]


def share(items: list, rank: int, world_size: int) -> list:
    """Rank `rank`'s shard of `items`, without padding (`shards(..., pad=False)[rank]`)."""
    size = len(items) // world_size
    return items[rank * size : (rank + 1) * size]
