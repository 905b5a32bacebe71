"""A role (actor, critic, reference, reward, rollout, or a supervised stage's ranks) as Ray actors.

`RoleGroup(worker_cls, world_size, pool)` makes one Ray actor per rank from any plain class, all
ranks at once: a light task in rank 0's bundle first picks that node's address and a free port
for the role's torch.distributed rendezvous (a role of one rank picks its own). Before the class's
own `__init__` runs, every rank has RANK, WORLD_SIZE, LOCAL_RANK (0: Ray gives each GPU actor its
own CUDA_VISIBLE_DEVICES), MASTER_ADDR and MASTER_PORT set, and torch uses as many threads as the
rank has whole CPUs (at least one). Each role rendezvouses on its own port, so each has its own
process group (`init_process_group`, or the worker's own `deepspeed.init_distributed` in a later
method: never in `__init__`, which may run before the other ranks exist).

The controller calls methods on the ranks: `call_all` (same arguments everywhere, results in rank
order), `call_rank0`, `call_each_async` (each rank its own arguments) and `call_sharded` (a batch
split over the ranks, the results joined in its order). Each has an `_async` twin returning a
`PendingCall` (a list of ObjectRefs, so `ray.wait` takes it) to overlap roles; `.result()` or
`gather_all` collect them. A role of one rank in the caller's process (`LocalRoleGroup`) answers
the same calls.
Every wait has a deadline (`timeout_s`): a rank that died, raised, or did not answer in time
raises `RoleError`/`RoleTimeoutError` naming the role and rank, at once for the first failure.
A rank that dies mid-collective makes the others raise too (gloo: "connection closed by peer"),
often before Ray reports the death: a rank's exception is held for up to `DEATH_GRACE_S` while
the other ranks' results are watched, and a death among them is reported instead (the root
cause, naming the rank that died); a rank that raised a `FollowOnError` (failures.py) waits the
same way for any other rank's failure. The caller then kills the group (`shutdown`), so no
surviving rank is left waiting in a collective.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import ray

from rlhf_core.distributed.failures import FollowOnError
from rlhf_core.distributed.pending import PendingCall
from rlhf_core.distributed.resources import (
    ClusterDevices,
    ResourcePool,
    detect_devices,
    floor_units,
    groups_across_nodes,
    plan_layout,
    rank_bundle_groups,
)
from rlhf_core.distributed.sharding import shards

DEFAULT_TIMEOUT_S = 600.0
DEATH_GRACE_S = 10.0  # how long a rank's exception waits for a death (or a FollowOnError for any failure) among the others


class RoleError(RuntimeError):
    """A call on a role failed. `role`, `ranks` (`rank`: the first), `method`; `cause`: the
    exception the worker raised (None when the actor died or did not answer)."""

    def __init__(self, role: str, ranks: Sequence[int], method: str, message: str,
                 cause: BaseException | None = None):
        self.role, self.ranks, self.method, self.cause, self.message = role, list(ranks), method, cause, message
        where = f"rank {self.ranks[0]}" if len(self.ranks) == 1 else f"ranks {self.ranks}"
        super().__init__(f"role {role!r} {where}: {message}")

    @property
    def rank(self) -> int:
        return self.ranks[0]


class RoleTimeoutError(RoleError, TimeoutError):
    """Ranks that did not answer within the deadline (stuck, or slower than `timeout_s` allows)."""


class RankActor:
    """Mixed into the worker class: sets the rank's environment before the class's `__init__`."""

    def __init__(self, _role_setup: dict, *args, **kwargs):
        # What a rank prints is log, never the command's output: Ray forwards an actor's stdout to the
        # driver's stdout, where `rlhf train ...` writes its manifest. Ray forwards stderr to stderr.
        sys.stdout.flush()
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
        env = dict(_role_setup["env"])
        if "MASTER_ADDR" not in env:  # a role of one rank: the rendezvous is on its node
            from rlhf_core.infra.network import rendezvous_port

            env.update(MASTER_ADDR=ray.util.get_node_ip_address(), MASTER_PORT=str(rendezvous_port()))
        os.environ.update(env)
        import torch

        torch.set_num_threads(_role_setup["num_threads"])
        self._role_name, self._role_rank = _role_setup["role"], _role_setup["rank"]
        if _role_setup.get("prepare_args") is not None:  # e.g. remote models -> this node's downloads
            args, kwargs = _role_setup["prepare_args"](args, kwargs)
        super().__init__(*args, **kwargs)

    def _role_info(self) -> dict:
        import torch

        return {"role": self._role_name, "rank": self._role_rank, "pid": os.getpid(),
                "node": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "threads": torch.get_num_threads(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def _role_save_to(self, method: str, uri: str):
        """`method(folder)` (a worker method that writes a folder) with the folder at `uri` (s3://):
        written into a staging folder of this rank's own on its node, then uploaded (`folders.py`)."""
        from rlhf_core.distributed.folders import save_to

        return save_to(getattr(self, method), uri, f"{self._role_name}-rank{self._role_rank}")

    def _role_load_from(self, method: str, uri: str):
        """`method(folder)` (a worker method that reads a folder) on a download of `uri` onto this node."""
        from rlhf_core.distributed.folders import load_from

        return load_from(getattr(self, method), uri)

    def _role_init_process_group(self, backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S):
        """Join the role's process group (NCCL with a GPU, else gloo); returns (rank, world size)."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            if backend is None:
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            rank, world_size, timeout = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timedelta(seconds=timeout_s)
            if world_size == 1:  # nobody to meet: no TCP store (it would listen on every interface)
                dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
            else:
                dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world_size,
                                        timeout=timeout)
        return dist.get_rank(), dist.get_world_size()


@ray.remote(num_cpus=0)
def _rendezvous() -> tuple[str, int]:
    """This node's address and a free port on it: where a role of several ranks rendezvouses."""
    from rlhf_core.infra.network import rendezvous_port

    return ray.util.get_node_ip_address(), rendezvous_port()


_ACTOR_CLASSES: dict[type, Any] = {}


def actor_class(worker_cls: type):
    """`worker_cls` with RankActor mixed in, as a Ray actor class (made once per class)."""
    if isinstance(worker_cls, ray.actor.ActorClass):
        raise TypeError(f"{worker_cls}: pass the plain class, without @ray.remote (RoleGroup makes the actors)")
    if worker_cls not in _ACTOR_CLASSES:
        # A qualified name nothing resolves to: cloudpickle ships the subclass by value, its bases by reference.
        cls = type(worker_cls.__name__, (RankActor, worker_cls),
                   {"__qualname__": f"RoleActor.{worker_cls.__name__}", "__doc__": worker_cls.__doc__})
        _ACTOR_CLASSES[worker_cls] = ray.remote(cls)
    return _ACTOR_CLASSES[worker_cls]


def start_together(groups: Sequence[RoleGroup]) -> None:
    """Finish starting groups made with `wait=False`, whose rank-0 processes are already starting:
    then each starts its other ranks, and every rank of every group is waited for at once. A rank's
    process imports torch and the model code before it answers, seconds each: roles started this way
    import side by side instead of one role after the other. On a failure (naming the role and rank)
    every group is shut down."""
    try:
        for group in groups:
            group._start_ranks()
        infos = gather_all([group.call_all_async("_role_info") for group in groups],  # every rank constructed
                           timeout_s=max(group.start_timeout_s for group in groups))
        for group, info in zip(groups, infos, strict=True):
            group._started(info)
    except BaseException:
        for group in groups:
            group.shutdown()
        raise


# -- waiting with deadlines ------------------------------------------------------------------

def gather_all(calls: Sequence[PendingCall], timeout_s: float | None = None, finish: bool = True) -> list:
    """Results of several calls (on several roles) at once, failing at the first rank that
    raised or died; `timeout_s` (default: the longest of the calls' own) bounds the whole wait.
    `finish=False`: each call's per-rank results as they are (a list in rank order)."""
    timeout_s = timeout_s if timeout_s is not None else max((c.timeout_s for c in calls), default=DEFAULT_TIMEOUT_S)
    where = {ref: (c, i) for c in calls for i, ref in enumerate(c)}
    values: dict[int, list] = {id(c): [None] * len(c) for c in calls}
    pending = [ref for c in calls for ref in c]
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            late: dict[tuple[str, str], list[int]] = {}
            for ref in pending:
                call, i = where[ref]
                late.setdefault((call.role, call.method), []).append(call.ranks[i])
            (role, method), ranks = next(iter(late.items()))
            others = "; also " + ", ".join(f"role {r!r} ranks {k} ({m})" for (r, m), k in list(late.items())[1:]) \
                if len(late) > 1 else ""
            raise RoleTimeoutError(role, ranks, method, f"no answer to {method}() within {timeout_s:g} s (stuck, or "
                                   f"slower than the timeout allows){others}")
        for ref in ready:
            call, i = where[ref]
            try:
                values[id(call)][i] = _get_ready(ref, call.role, call.ranks[i], call.method)
            except RoleError as raised:
                if raised.cause is None or not pending:
                    raise
                grace = min(DEATH_GRACE_S, max(0.0, deadline - time.monotonic()))
                root = _root_cause_among(pending, where, grace, raised_too=isinstance(raised.cause, FollowOnError))
                if root is None:
                    raise
                raise RoleError(root.role, root.ranks, root.method, f"{root.message}\n(then role {raised.role!r} "
                                f"rank {raised.rank} failed too: {raised.message})", root.cause) from raised
    return [c.finish(values[id(c)]) if finish else values[id(c)] for c in calls]


def _root_cause_among(pending: list, where: dict, grace_s: float, raised_too: bool = False) -> RoleError | None:
    """The first rank among `pending` whose actor died within `grace_s` (with `raised_too`: or that
    raised anything but a FollowOnError), as its RoleError; None if none did."""
    deadline = time.monotonic() + grace_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            return None
        call, i = where[ready[0]]
        try:
            _get_ready(ready[0], call.role, call.ranks[i], call.method)
        except RoleError as e:
            if isinstance(e, RoleTimeoutError):
                continue
            if e.cause is None or (raised_too and not isinstance(e.cause, FollowOnError)):
                return e
    return None


def _get_ready(ref, role: str, rank: int, method: str):
    try:
        return ray.get(ref, timeout=DEFAULT_TIMEOUT_S)  # ready: at most a transfer from another node
    except ray.exceptions.RayTaskError as e:
        cause = e.cause if isinstance(getattr(e, "cause", None), BaseException) else e
        raise RoleError(role, [rank], method, f"{method}() raised {type(cause).__name__}: {cause}", cause) from e
    except ray.exceptions.RayActorError as e:
        raise RoleError(role, [rank], method, f"the actor died during {method}():\n{e}") from e
    except ray.exceptions.GetTimeoutError as e:
        raise RoleTimeoutError(role, [rank], method, f"the result of {method}() could not be fetched") from e
    except ray.exceptions.RayError as e:
        raise RoleError(role, [rank], method, f"{method}() failed in Ray: {type(e).__name__}: {e}") from e


# -- the group -------------------------------------------------------------------------------

class RoleGroup:
    """`world_size` Ray actors of `worker_cls`, rank i in bundle `bundle_offset + i` of `pool`,
    each taking `share` of its bundle. Without a pool the group makes (and later removes) one of
    its own, sized from the cluster's devices (`devices`, default: detected).

    `bundles_per_rank` k > 1: each rank drives workers of its own on k bundles (a tensor-parallel
    vLLM engine: one Ray worker per GPU). The group claims `share` of bundles bundle_offset ..
    bundle_offset + k*world_size - 1, gives each rank k of them (`rank_bundle_groups`: one node
    when possible), places the rank's actor in the first with the CPU share and no GPU, and
    captures what the actor starts in the placement group. The rank's environment names its
    bundles (`RLHF_RANK_BUNDLES`, "3,4") and the GPU share a worker takes in each
    (`RLHF_RANK_BUNDLE_GPUS`).

    `prepare_args(args, kwargs) -> (args, kwargs)` (a module-level function) runs on each rank before
    the worker's `__init__`, on the rank's node: e.g. remote model URIs replaced by that node's
    downloads (`trainers/ppo.models_on_this_node`).

    `timeout_s` bounds every call; `start_timeout_s` (default: `timeout_s`) bounds the start: the
    placement, rank 0's address, and every rank constructed (a process that imports torch and the
    model code, which under load can take far longer than a call should).

    `wait=False`: return as soon as rank 0 is asked for, and let `start_together(groups)` finish
    several groups at once, so that their processes start side by side."""

    def __init__(self, worker_cls: type, world_size: int, pool: ResourcePool | None = None, *,
                 name: str | None = None, share: float = 1.0, bundle_offset: int = 0, args: Sequence = (),
                 kwargs: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, num_threads: int | None = None,
                 devices: ClusterDevices | None = None, bundles_per_rank: int = 1, prepare_args=None,
                 wait: bool = True, duplicates: int = 1, start_timeout_s: float | None = None):
        start_timeout_s = timeout_s if start_timeout_s is None else start_timeout_s
        for field, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
            if value is None or value <= 0:
                raise ValueError(f"{field} must be a positive number of seconds, got {value!r}")
        if duplicates < 1 or world_size % duplicates:
            raise ValueError(f"rings of {duplicates} ranks do not divide {world_size} ranks")
        self.name = name or worker_cls.__name__
        self.world_size, self.timeout_s, self.duplicates = world_size, timeout_s, duplicates
        self.start_timeout_s = start_timeout_s
        self.actors: list = []
        self._owns_pool = pool is None
        if pool is None:
            layout = plan_layout({self.name: world_size}, devices=devices or detect_devices(),
                                 bundles_per_rank={self.name: bundles_per_rank})
            pool = ResourcePool.from_spec(layout.pools[self.name], timeout_s=start_timeout_s)
        self.pool = pool
        self._claimed = False
        try:
            pool.claim(self.name, share, bundle_offset, world_size * bundles_per_rank)
            self._claimed = True
            self.num_cpus = floor_units(pool.spec.cpus * share)
            self.num_gpus = floor_units(pool.spec.gpus * share)  # of each bundle the role uses
            spanning = bundles_per_rank > 1
            self.rank_bundles = [[bundle_offset + r] for r in range(world_size)]
            if spanning:
                nodes = pool.bundle_nodes()
                self.rank_bundles = rank_bundle_groups(nodes, bundle_offset, world_size, bundles_per_rank)
                across = groups_across_nodes(self.rank_bundles, nodes)
                if across:
                    print(f"rlhf: role {self.name!r} ranks {across}: their {bundles_per_rank} bundles are on more "
                          "than one node (slow across nodes without a fast interconnect)", file=sys.stderr, flush=True)
            cls = actor_class(worker_cls)
            # a spanning rank's GPU work runs in the workers it starts in its bundles, not in its own actor
            options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": 0.0 if spanning else self.num_gpus}
            if env:
                options["runtime_env"] = {"env_vars": {k: str(v) for k, v in env.items()}}
            threads = num_threads or max(1, int(self.num_cpus))

            def start(rank: int, master: dict):
                own = {"RLHF_RANK_BUNDLES": ",".join(map(str, self.rank_bundles[rank])),
                       "RLHF_RANK_BUNDLE_GPUS": f"{self.num_gpus:g}"} if spanning else {}
                setup = {"role": self.name, "rank": rank, "num_threads": threads, "prepare_args": prepare_args,
                         "env": {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", **own, **master}}
                strategy = pool.scheduling(self.rank_bundles[rank][0], capture_child_tasks=spanning)
                return cls.options(scheduling_strategy=strategy, **options).remote(setup, *args, **(kwargs or {}))

            self._start_rank = start
            if world_size == 1:  # its rank picks the address itself (RankActor)
                self.actors.append(start(0, {}))
            else:  # rank 0's node and a free port there, from a task in its bundle (no torch to import)
                self._rendezvous = _rendezvous.options(scheduling_strategy=pool.scheduling(
                    self.rank_bundles[0][0])).remote()
        except BaseException:
            self.shutdown()
            raise
        if wait:
            start_together([self])

    def _start_ranks(self) -> None:
        """Ranks 1.. (rank 0 too, when there are several) once the rendezvous address is known."""
        if self.world_size == 1:
            return
        try:
            self.master_addr, self.master_port = ray.get(self._rendezvous, timeout=self.start_timeout_s)
        except ray.exceptions.GetTimeoutError as e:
            raise RoleTimeoutError(self.name, [0], "rendezvous", f"no node for rank 0 within {self.start_timeout_s:g} s "
                                   "(its placement bundle was never scheduled)") from e
        except ray.exceptions.RayError as e:
            raise RoleError(self.name, [0], "rendezvous", f"picking rank 0's address failed: {e}") from e
        master = {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}
        self.actors += [self._start_rank(rank, master) for rank in range(self.world_size)]

    def _started(self, info: list[dict]) -> None:
        self.info = info
        # Which process is which rank, for whoever reads the log of a rank that dies.
        print(f"role {self.name!r}: " + ", ".join(f"rank {i['rank']} pid {i['pid']} on {i['node']}" for i in info)
              + f" (nodes {', '.join(i['node_id'][:12] for i in info)})", file=sys.stderr, flush=True)

    # dispatch ---------------------------------------------------------------------------------

    def _method(self, actor, method: str):
        try:
            return getattr(actor, method)
        except AttributeError:
            raise AttributeError(f"role {self.name!r}: its worker class has no method {method!r}") from None

    def _pending(self, method: str, mode: str, ranks: Sequence[int], calls: Sequence[tuple[tuple, dict]]):
        refs = [self._method(self.actors[r], method).remote(*a, **kw) for r, (a, kw) in zip(ranks, calls, strict=True)]
        return PendingCall(refs, role=self.name, method=method, ranks=ranks, mode=mode, timeout_s=self.timeout_s,
                           wait=gather_all)

    def _shared(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Arguments every rank gets: in the object store once, not once per rank (an ObjectRef
        argument is handed over as it is, so the ranks still receive its value)."""
        if self.world_size == 1:
            return args, kwargs
        put = lambda v: v if isinstance(v, ray.ObjectRef) else ray.put(v)  # noqa: E731
        return tuple(put(a) for a in args), {k: put(v) for k, v in kwargs.items()}

    def call_each_async(self, method: str, calls: Sequence[tuple[tuple, Mapping[str, Any]]],
                        ranks: Sequence[int] | None = None) -> PendingCall:
        """A call of its own on each rank: `method(*args_i, **kwargs_i)` on `ranks[i]` (default: rank
        i); the results per rank, in that order."""
        ranks = list(range(len(calls))) if ranks is None else list(ranks)
        return self._pending(method, "all", ranks, [(tuple(a), dict(kw)) for a, kw in calls])

    @property
    def data_parallel_size(self) -> int:
        """Ranks that take different data: the ranks of a ring (`duplicates`) take the same."""
        return self.world_size // self.duplicates

    def call_sharded_async(self, method: str, items: list, **kwargs) -> PendingCall:
        """`method(shard, **kwargs)` on each rank's shard of `items` (`sharding.shards(..., pad=True)`:
        equal contiguous parts, the last padded with the last item; the ranks of a ring take the same
        part); `gather()` gives the results in `items`' order, the padding's dropped."""
        parts = shards(items, self.data_parallel_size, pad=True)
        calls = [((part,), kwargs) for part in parts for _ in range(self.duplicates)]
        return self.call_each_async(method, calls).sharded(len(items), every=self.duplicates)

    def call_sharded(self, method: str, items: list, **kwargs) -> list:
        return self.call_sharded_async(method, items, **kwargs).gather()

    def call_all_async(self, method: str, *args, **kwargs) -> PendingCall:
        shared = self._shared(args, kwargs)
        return self._pending(method, "all", range(self.world_size), [shared] * self.world_size)

    def call_rank0_async(self, method: str, *args, **kwargs) -> PendingCall:
        return self._pending(method, "rank0", [0], [(args, kwargs)])

    def call_all(self, method: str, *args, **kwargs) -> list:
        """`method(*args, **kwargs)` on every rank; the results in rank order."""
        return self.call_all_async(method, *args, **kwargs).result()

    def call_rank0(self, method: str, *args, **kwargs):
        return self.call_rank0_async(method, *args, **kwargs).result()

    def init_process_group(self, backend: str | None = None) -> list[tuple[int, int]]:
        """Every rank joins the role's own process group; returns each rank's (rank, world size)."""
        return self.call_all("_role_init_process_group", backend, self.timeout_s)

    # lifetime ---------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill the ranks, give back their share of the pool (and the pool, when the group made it)."""
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self.actors = []
        if self._claimed:
            self.pool.release(self.name)
            self._claimed = False
        if self._owns_pool and self.pool is not None:
            self.pool.remove()
            self.pool = None

    def __enter__(self) -> RoleGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
