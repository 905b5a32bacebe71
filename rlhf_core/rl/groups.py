"""How the controller calls a role: on every rank, on rank 0, on shards of a batch, or with each
rank's own arguments.

`LocalGroup` is one rank in the controller's own process (one CPU rank needs no Ray actor, as a
single `deepspeed` process needs no launcher); `RayGroup` is a role's ranks as Ray actors (a
`distributed.role_group.RoleGroup`) behind the same calls. Calls return a `Pending` whose
`gather()` concatenates the ranks' results in rank order and whose `first()` is rank 0's, so the
controller can start several roles before waiting on any.

A batch is sharded by `distributed.sharding.shards(..., pad=True)`: equal contiguous parts, the
last padded with the last item, the padding's results dropped.
"""

from __future__ import annotations

from rlhf_core.distributed.sharding import shards


class Pending:
    """The results of one call on every rank of a role, in rank order (waited for on first use)."""

    def __init__(self, results: list | None = None, call=None, keep: int | None = None):
        self._results, self._call, self._keep = results, call, keep

    def all(self) -> list:
        if self._results is None:
            self._results = self._call.per_rank()
        return list(self._results)

    def gather(self) -> list:
        items = [item for part in self.all() for item in part]
        return items if self._keep is None else items[: self._keep]

    def first(self):
        return self.all()[0]


class LocalGroup:
    """A role of one rank in this process."""

    world_size = 1

    def __init__(self, worker):
        self.worker = worker

    def call_sharded_async(self, method: str, items: list, **kwargs) -> Pending:
        return Pending([getattr(self.worker, method)(items, **kwargs)])

    def call_sharded(self, method: str, items: list, **kwargs) -> list:
        return self.call_sharded_async(method, items, **kwargs).gather()

    def call_each_async(self, method: str, per_rank: list[tuple[tuple, dict]]) -> Pending:
        ((args, kwargs),) = per_rank
        return Pending([getattr(self.worker, method)(*args, **kwargs)])

    def call_rank0(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)

    def call_all_async(self, method: str, *args, **kwargs) -> Pending:
        return Pending([getattr(self.worker, method)(*args, **kwargs)])

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

    def call_sharded_async(self, method: str, items: list, **kwargs) -> Pending:
        parts = shards(items, self.world_size, pad=True)
        call = self.group.call_each_async(method, [((part,), kwargs) for part in parts])
        return Pending(call=call, keep=len(items))

    def call_sharded(self, method: str, items: list, **kwargs) -> list:
        return self.call_sharded_async(method, items, **kwargs).gather()

    def call_each_async(self, method: str, per_rank: list[tuple[tuple, dict]]) -> Pending:
        """Rank r runs `method(*args_r, **kwargs_r)`: each rank its own work."""
        return Pending(call=self.group.call_each_async(method, per_rank))

    def call_rank0(self, method: str, *args, **kwargs):
        return self.group.call_rank0(method, *args, **kwargs)

    def call_all_async(self, method: str, *args, **kwargs) -> Pending:
        return Pending(call=self.group.call_all_async(method, *args, **kwargs))

    def call_all(self, method: str, *args, **kwargs) -> list:
        return self.group.call_all(method, *args, **kwargs)

    def shutdown(self) -> None:
        self.group.shutdown()
