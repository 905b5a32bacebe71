"""How the controller calls a role: on every rank, on rank 0, on shards of a batch, or with each
rank's own arguments.

`LocalGroup` is one rank in the controller's own process (one CPU rank needs no Ray actor, as a
single `deepspeed` process needs no launcher); `RayGroup` is a role's ranks as Ray actors (a
`distributed.role_group.RoleGroup`) behind the same calls. The `_async` calls of both return a
`distributed.pending.PendingCall` (`gather()`: the ranks' results joined in rank order; `first()`:
rank 0's), so the controller can start several roles before waiting on any.

A batch is sharded by `distributed.sharding.shards(..., pad=True)`: equal contiguous parts, the
last padded with the last item, the padding's results dropped.
"""

from __future__ import annotations

from rlhf_core.distributed.pending import PendingCall
from rlhf_core.distributed.sharding import shards


class LocalGroup:
    """A role of one rank in this process."""

    world_size = 1

    def __init__(self, worker):
        self.worker = worker

    def call_sharded_async(self, method: str, items: list, **kwargs) -> PendingCall:
        return PendingCall.resolved([getattr(self.worker, method)(items, **kwargs)])

    def call_sharded(self, method: str, items: list, **kwargs) -> list:
        return self.call_sharded_async(method, items, **kwargs).gather()

    def call_each_async(self, method: str, per_rank: list[tuple[tuple, dict]]) -> PendingCall:
        ((args, kwargs),) = per_rank
        return PendingCall.resolved([getattr(self.worker, method)(*args, **kwargs)])

    def call_rank0(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)

    def call_all_async(self, method: str, *args, **kwargs) -> PendingCall:
        return PendingCall.resolved([getattr(self.worker, method)(*args, **kwargs)])

    def call_all(self, method: str, *args, **kwargs) -> list:
        return [getattr(self.worker, method)(*args, **kwargs)]

    def shutdown(self) -> None:
        self.worker = None


class RayGroup:
    """A role's ranks as Ray actors (`RoleGroup`), called like a `LocalGroup`. Errors of a rank
    (it raised, died or hung past the group's timeout) surface as `RoleError` naming role and rank."""

    def __init__(self, group):
        self.group = group
        self.world_size = group.world_size
        self.name = group.name

    def call_sharded_async(self, method: str, items: list, **kwargs) -> PendingCall:
        parts = shards(items, self.world_size, pad=True)
        return self.group.call_each_async(method, [((part,), kwargs) for part in parts]).sharded(len(items))

    def call_sharded(self, method: str, items: list, **kwargs) -> list:
        return self.call_sharded_async(method, items, **kwargs).gather()

    def call_each_async(self, method: str, per_rank: list[tuple[tuple, dict]]) -> PendingCall:
        """Rank r runs `method(*args_r, **kwargs_r)`: each rank its own work."""
        return self.group.call_each_async(method, per_rank)

    def call_rank0(self, method: str, *args, **kwargs):
        return self.group.call_rank0(method, *args, **kwargs)

    def call_all_async(self, method: str, *args, **kwargs) -> PendingCall:
        return self.group.call_all_async(method, *args, **kwargs)

    def call_all(self, method: str, *args, **kwargs) -> list:
        return self.group.call_all(method, *args, **kwargs)

    def shutdown(self) -> None:
        self.group.shutdown()
