"""How the controller calls a role: on every rank, on rank 0, or on shards of a batch.

`LocalGroup` is one rank in the controller's own process (one CPU rank needs no Ray actor, as a
single `deepspeed` process needs no launcher); a Ray role group exposes the same calls over
several actors. Calls return a `Pending` whose `gather()` concatenates the ranks' results in rank
order and whose `first()` is rank 0's, so the controller can start several roles before waiting.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Pending:
    results: list  # one result per rank, in rank order

    def gather(self) -> list:
        return [item for part in self.results for item in part]

    def first(self):
        return self.results[0]

    def all(self) -> list:
        return list(self.results)


class LocalGroup:
    """A role of one rank in this process."""

    world_size = 1

    def __init__(self, worker):
        self.worker = worker

    def call_sharded_async(self, method: str, items: list, **kwargs) -> Pending:
        return Pending([getattr(self.worker, method)(items, **kwargs)])

    def call_sharded(self, method: str, items: list, **kwargs) -> list:
        return self.call_sharded_async(method, items, **kwargs).gather()

    def call_rank0(self, method: str, *args, **kwargs):
        return getattr(self.worker, method)(*args, **kwargs)

    def call_all_async(self, method: str, *args, **kwargs) -> Pending:
        return Pending([getattr(self.worker, method)(*args, **kwargs)])

    def call_all(self, method: str, *args, **kwargs) -> list:
        return [getattr(self.worker, method)(*args, **kwargs)]
