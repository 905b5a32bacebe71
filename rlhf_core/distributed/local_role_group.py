"""A role of one rank in this process, called as a `role_group.RoleGroup` is.

One CPU rank needs no Ray actor, as a single `deepspeed` process needs no launcher: the RL stage
runs its roles in the controller's process when nothing asks for more (`trainers/ppo.runs_on_ray`).
The calls and their `PendingCall` results are the `RoleGroup`'s, so the controller cannot tell the
two apart.
"""

from __future__ import annotations

from rlhf_core.distributed.pending import PendingCall

FOLDER_CALLS = ("_role_save_to", "_role_load_from")


class LocalRoleGroup:
    """`worker` as a role group of one rank."""

    world_size = data_parallel_size = 1

    def __init__(self, worker, name: str = "local"):
        self.worker, self.name = worker, name

    def _call(self, method: str, *args, **kwargs):
        if method in FOLDER_CALLS:  # a RankActor's own method (`role_group.RankActor`), for this one rank
            from rlhf_core.distributed import folders

            name, uri = args
            if method == "_role_save_to":
                return folders.save_to(getattr(self.worker, name), uri, f"{self.name}-rank0")
            return folders.load_from(getattr(self.worker, name), uri)
        return getattr(self.worker, method)(*args, **kwargs)

    def call_sharded_async(self, method: str, items: list, **kwargs) -> PendingCall:
        return PendingCall.resolved([self._call(method, items, **kwargs)], self.name, method)

    def call_sharded(self, method: str, items: list, **kwargs) -> list:
        return self.call_sharded_async(method, items, **kwargs).gather()

    def call_each_async(self, method: str, calls: list[tuple[tuple, dict]]) -> PendingCall:
        ((args, kwargs),) = calls
        return PendingCall.resolved([self._call(method, *args, **kwargs)], self.name, method)

    def call_all_async(self, method: str, *args, **kwargs) -> PendingCall:
        return PendingCall.resolved([self._call(method, *args, **kwargs)], self.name, method)

    def call_all(self, method: str, *args, **kwargs) -> list:
        return [self._call(method, *args, **kwargs)]

    def call_rank0(self, method: str, *args, **kwargs):
        return self._call(method, *args, **kwargs)

    def shutdown(self) -> None:
        self.worker = None
