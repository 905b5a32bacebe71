"""The results of one call on a role's ranks, in rank order: one type for the controller to wait on,
whether the ranks are Ray actors (`role_group.RoleGroup`) or one rank in this process.

A call on Ray actors holds their ObjectRefs (`ray.wait` takes the list) and the wait that collects
them with the role's deadline and error naming (`role_group.gather_all`, handed in so this module
needs no Ray); a call in this process holds its values already.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class PendingCall(list):
    def __init__(self, refs: Sequence = (), *, role: str, method: str, ranks: Sequence[int], mode: str = "all",
                 timeout_s: float = 0.0, wait: Callable | None = None, values: list | None = None,
                 keep: int | None = None):
        super().__init__(refs)
        self.role, self.method, self.ranks, self.mode, self.timeout_s = role, method, list(ranks), mode, timeout_s
        self._wait, self._values, self.keep = wait, values, keep
        self.every = 1

    @classmethod
    def resolved(cls, values: list, role: str = "local", method: str = "") -> PendingCall:
        """A call already made in this process: `values` in rank order."""
        return cls(role=role, method=method, ranks=range(len(values)), values=list(values))

    def sharded(self, keep: int, every: int = 1) -> PendingCall:
        """This call as the parts of one padded batch: `gather` keeps its first `keep` items, from
        every `every`-th rank (the ranks of a ring compute the same part)."""
        self.keep, self.every = keep, every
        return self

    def finish(self, values: list):
        return values[0] if self.mode == "rank0" else values

    def per_rank(self, timeout_s: float | None = None) -> list:
        """Every rank's own result, in rank order (waited for once)."""
        if self._values is None:
            self._values = self._wait([self], timeout_s=timeout_s, finish=False)[0]
        return list(self._values)

    def result(self, timeout_s: float | None = None):
        """The call's result by its mode: rank 0's for a rank-0 call, else every rank's."""
        return self.finish(self.per_rank(timeout_s))

    def first(self):
        return self.per_rank()[0]

    def gather(self) -> list:
        """The ranks' lists joined in rank order (a sharded batch's padding dropped)."""
        items = [item for part in self.per_rank()[:: self.every] for item in part]
        return items if self.keep is None else items[: self.keep]
