"""Weight sync: after every training step, every rollout engine takes the actor's new weights.

`WeightSync.sync(actor, engines, timeout_s)` (set up on first call) has three transports, picked
by `resolve_sync_backend` from `--vllm.sync_backend` and the engines:

- `object_store`: rank 0's state dict is put in Ray's object store once; engines read it from
  there, never through the driver. `auto` for transformers engines.
- `nccl` / `gloo`: a process group of its own (a `TCPStore` on actor rank 0; the DeepSpeed and vLLM
  groups are untouched): rank 0 is actor rank 0, the others every engine worker (one per
  tensor-parallel rank). Rank 0 broadcasts a header (names, dtypes, shapes), then buckets of
  same-dtype tensors packed into flat buffers of at most `bucket_mb`: a few large collectives, not
  one per parameter. Tied weights travel once. gloo is the same code on CPU (the CPU tests).
  `auto` for vLLM engines on GPUs of their own.
- `ipc` (colocated vLLM, GPU only; NCCL cannot join two ranks on one GPU): each actor rank packs a
  bucket on its GPU and hands a CUDA IPC handle to the worker on that GPU (matched by device UUID).
  `auto` for colocated vLLM, and what `nccl` means there (as in OpenRLHF).

Floating tensors travel in the engines' dtype when they share one. Every sync is bounded
(`RLHF_SYNC_TIMEOUT_S`, 600 s; the group's own timeout is 1.5x): an engine that raises, dies or
misses the deadline is named in an `EngineSyncError`, never a hang. Engines are asked whether they
are free before each broadcast, so one stuck in an earlier call is named alone.
"""

from __future__ import annotations

import io
import os
import pickle
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum

import torch

DEFAULT_SYNC_TIMEOUT_S = 600.0
DEFAULT_BUCKET_MB = 512
GROUP_TIMEOUT_FACTOR = 1.5
SYNC_BACKEND_CHOICES = ("auto", "nccl", "gloo", "ipc", "object_store")


def sync_timeout_s() -> float:
    return float(os.environ.get("RLHF_SYNC_TIMEOUT_S") or DEFAULT_SYNC_TIMEOUT_S)


class EngineSyncError(RuntimeError):
    """A rollout engine did not take the new weights (it raised, died or did not answer in time)."""

    def __init__(self, engine: int, message: str, engines: Iterable[int] | None = None):
        self.engine = engine
        self.engines = list(engines) if engines is not None else [engine]
        where = f"rollout engine {engine}" if len(self.engines) == 1 else \
            f"rollout engines {', '.join(map(str, self.engines))}"
        super().__init__(f"{where}: {message}")


class SyncBackend(str, Enum):
    OBJECT_STORE = "object_store"
    NCCL = "nccl"
    GLOO = "gloo"
    IPC = "ipc"

    @property
    def is_broadcast(self) -> bool:
        return self in (SyncBackend.NCCL, SyncBackend.GLOO)


def resolve_sync_backend(requested: str, *, vllm: bool, colocated: bool, cuda: bool) -> SyncBackend:
    """The transport for `--vllm.sync_backend requested`. `vllm`: the engines are vLLM; `colocated`:
    engine workers sit on the actor's GPUs; `cuda`: actor and engines are on CUDA devices."""
    from rlhf_core.infra.settings import ConfigError

    if requested not in SYNC_BACKEND_CHOICES:
        raise ConfigError(f"--vllm.sync_backend {requested!r}: use one of {', '.join(SYNC_BACKEND_CHOICES)}")
    if requested == "auto":
        if not vllm:
            return SyncBackend.OBJECT_STORE
        requested = "nccl" if cuda else "gloo"  # vLLM's CPU build: the same broadcast over gloo
    if requested in ("nccl", "ipc") and not cuda:
        raise ConfigError(f"--vllm.sync_backend {requested}: the actor and the engines are not all on CUDA devices "
                          "(use gloo or object_store)")
    if requested == "nccl" and colocated:
        return SyncBackend.IPC  # NCCL cannot connect two ranks on one GPU (OpenRLHF's meaning too)
    if requested == "ipc" and not colocated:
        raise ConfigError("--vllm.sync_backend ipc: the engines do not share the actor's GPUs (CUDA IPC maps memory "
                          "of the same GPU; use nccl, or --train.colocate_all)")
    return SyncBackend(requested)


# -- what travels: a header of tensor metadata, then buckets of packed tensors -------------------

@dataclass(frozen=True)
class TensorMeta:
    names: tuple[str, ...]  # several when weights are tied
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.torch_dtype).element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def wire_tensors(state: Mapping[str, torch.Tensor], wire_dtype: str | None = None
                 ) -> tuple[list[TensorMeta], list[torch.Tensor]]:
    """The distinct tensors of a state dict in its order (tied ones once, under all their names),
    floating ones cast to `wire_dtype` when given; and their metadata."""
    by_key: dict[tuple, int] = {}
    names: list[list[str]] = []
    tensors: list[torch.Tensor] = []
    for name, t in state.items():
        key = (t.device, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype) if t.numel() else None
        if key is not None and key in by_key:
            names[by_key[key]].append(name)
            continue
        if key is not None:
            by_key[key] = len(tensors)
        names.append([name])
        t = t.detach()
        if wire_dtype is not None and t.is_floating_point():
            t = t.to(getattr(torch, wire_dtype))
        tensors.append(t)
    metas = [TensorMeta(tuple(n), _dtype_name(t.dtype), tuple(t.shape)) for n, t in zip(names, tensors, strict=True)]
    return metas, tensors


def plan_buckets(metas: list[TensorMeta], bucket_bytes: int) -> list[list[int]]:
    """Indices of `metas` in buckets: one dtype per bucket, in order, at most `bucket_bytes` each
    (a tensor bigger than that gets a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    open_bucket: dict[str, tuple[list[int], int]] = {}
    out: list[list[int]] = []
    for i, m in enumerate(metas):
        indices, size = open_bucket.get(m.dtype, ([], 0))
        if indices and size + m.nbytes > bucket_bytes:
            out.append(indices)
            indices, size = [], 0
        indices.append(i)
        open_bucket[m.dtype] = (indices, size + m.nbytes)
    out.extend(indices for indices, _ in open_bucket.values() if indices)
    return sorted(out, key=lambda b: b[0])


def pack(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """One flat buffer on `device` holding the tensors one after another (all of one dtype)."""
    return torch.cat([t.reshape(-1).to(device) for t in tensors])


def unpack(flat: torch.Tensor, metas: list[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """(name, view into `flat`) for every name of every tensor, in order."""
    if sum(m.numel for m in metas) != flat.numel():
        raise ValueError(f"a bucket of {flat.numel()} elements does not hold its {sum(m.numel for m in metas)} "
                         "announced ones")
    out, offset = [], 0
    for m in metas:
        view = flat[offset : offset + m.numel].view(m.shape)
        offset += m.numel
        out.extend((name, view) for name in m.names)
    return out


# -- the process group ----------------------------------------------------------------------------

def node_address() -> tuple[str, int]:
    """This node's address (as Ray sees it when running under Ray) and a free port on it, outside the
    range the kernel gives outgoing connections (`infra.network.rendezvous_port`)."""
    from rlhf_core.infra.network import rendezvous_port

    try:
        import ray

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    except Exception:  # not in a Ray worker
        host = "127.0.0.1"
    return host, rendezvous_port()


class SyncGroup:
    """A process group of its own for the weight sync: rank 0 (actor rank 0) hosts the store.
    Construction blocks until all `world_size` members joined (bounded by `timeout_s`)."""

    def __init__(self, backend: str, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                 device: torch.device | None = None):
        import torch.distributed as dist

        self.backend, self.rank, self.world_size = SyncBackend(backend), rank, world_size
        # Past the driver's deadline: the driver names the late engines before a member's own timeout
        # fires (a member that times out first would look like the culprit).
        self.timeout = timedelta(seconds=timeout_s * GROUP_TIMEOUT_FACTOR)
        if self.backend == SyncBackend.NCCL:
            self.device = device or torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=self.timeout)
        store = dist.PrefixStore("rlhf-weight-sync", store)
        if self.backend == SyncBackend.GLOO:
            self.pg = dist.ProcessGroupGloo(store, rank, world_size, self.timeout)
        elif self.backend == SyncBackend.NCCL:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            raise ValueError(f"{backend}: not a broadcast backend (nccl or gloo)")
        self._store = store

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = self.timeout
        self.pg.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()

    def broadcast_object(self, obj=None):
        """Rank 0's `obj` on every rank (pickled into a byte tensor, its length sent first)."""
        if self.rank == 0:
            buffer = io.BytesIO()
            pickle.dump(obj, buffer)
            payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8).to(self.device)
            length = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        else:
            length = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.broadcast(length)
        if self.rank != 0:
            payload = torch.empty(int(length.item()), dtype=torch.uint8, device=self.device)
        self.broadcast(payload)
        return obj if self.rank == 0 else pickle.loads(payload.cpu().numpy().tobytes())

    def close(self) -> None:
        pg, self.pg = getattr(self, "pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # a broken group (a peer died) has nothing left to shut down cleanly
                pass
        self._store = None


def send_broadcast(group: SyncGroup, state: Mapping[str, torch.Tensor], bucket_bytes: int,
                   wire_dtype: str | None = None) -> int:
    """Rank 0: the header, then every bucket. Returns the bytes sent (per receiver)."""
    metas, tensors = wire_tensors(state, wire_dtype)
    buckets = plan_buckets(metas, bucket_bytes)
    group.broadcast_object({"metas": metas, "buckets": buckets})
    sent = 0
    for bucket in buckets:
        flat = pack([tensors[i] for i in bucket], group.device)
        group.broadcast(flat)
        sent += flat.numel() * flat.element_size()
        del flat
    return sent


def receive_broadcast(group: SyncGroup, load: Callable[[list[tuple[str, torch.Tensor]]], None]) -> int:
    """Every other rank: the header, then each bucket handed to `load` as (name, tensor) pairs (views
    into the bucket: `load` copies what it keeps). Returns the number of tensors received."""
    count = 0
    for tensors, items in broadcast_buckets(group):
        load(items)
        count += tensors
    return count


def broadcast_buckets(group: SyncGroup) -> Iterator[tuple[int, list[tuple[str, torch.Tensor]]]]:
    """Every other rank, as a generator: the header, then each bucket as its number of tensors and
    its (name, tensor) pairs (a tied tensor under each of its names), views into a bucket of its own
    (what is kept stays valid). The sender waits until the generator is exhausted."""
    header = group.broadcast_object()
    metas: list[TensorMeta] = header["metas"]
    for bucket in header["buckets"]:
        parts = [metas[i] for i in bucket]
        flat = torch.empty(sum(m.numel for m in parts), dtype=parts[0].torch_dtype, device=group.device)
        group.broadcast(flat)
        yield len(parts), unpack(flat, parts)


# -- CUDA IPC (colocated engines) -------------------------------------------------------------

def device_uuid(device: torch.device | None = None) -> str | None:
    if not torch.cuda.is_available():
        return None
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def ipc_handle(flat: torch.Tensor):
    """A picklable handle to a CUDA tensor another process on the same GPU can map."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(flat)


def open_ipc_handle(handle, device: torch.device) -> torch.Tensor:
    """The tensor behind `handle`, mapped on `device` (this process's index of the same GPU: each
    process may see the GPU under another index, depending on its CUDA_VISIBLE_DEVICES)."""
    import inspect

    rebuild, args = handle
    args = list(args)
    position = list(inspect.signature(rebuild).parameters).index("storage_device")
    args[position] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild(*args)


# -- the sender: mixed into the actor's worker class (RoleWorker) ------------------------------

class WeightSender:
    """Actor-side sync methods, called on every actor rank. The class provides `_sync_state()` (the
    full state dict on rank 0, {} elsewhere; every rank must call it: a ZeRO-3 gather is collective),
    `_sync_state_local()` (the full state dict on this rank's own device, for CUDA IPC) and
    `_as_checkpoint(state)` (a state dict in the names and layout of a saved checkpoint, which vLLM
    loads: `checkpoint_format`)."""

    _sync_group: SyncGroup | None = None
    _ipc_plan = None

    def _sync_rank(self) -> int:
        return int(os.environ.get("RANK", "0"))

    def weight_sync_device(self) -> dict:
        return {"cuda": torch.cuda.is_available(), "uuid": device_uuid()}

    def weight_sync_address(self) -> tuple[str, int]:
        return node_address()

    def weight_sync_open(self, backend: str, host: str, port: int, world_size: int, timeout_s: float) -> bool:
        if self._sync_rank() == 0:
            self._sync_group = SyncGroup(backend, host, port, 0, world_size, timeout_s)
        return True

    def weight_sync_send(self, bucket_bytes: int, wire_dtype: str | None = None, checkpoint_format: bool = False) -> int:
        state = self._sync_state()
        if self._sync_rank() != 0:
            return 0
        if checkpoint_format:
            state = self._as_checkpoint(state)
        if self._sync_group is None:
            raise RuntimeError("weight_sync_send before weight_sync_open")
        return send_broadcast(self._sync_group, state, bucket_bytes, wire_dtype)

    def weight_sync_ipc(self, index: int, bucket_bytes: int, wire_dtype: str | None = None,
                        checkpoint_format: bool = False) -> dict:
        """Bucket `index` packed on this rank's GPU: {"count": buckets, "metas": [...], "handles":
        {device uuid: handle}}. Index 0 gathers the weights; the last one is kept until release."""
        if index == 0:
            state = self._sync_state_local()
            metas, tensors = wire_tensors(self._as_checkpoint(state) if checkpoint_format else state, wire_dtype)
            self._ipc_plan = (metas, tensors, plan_buckets(metas, bucket_bytes))
        metas, tensors, buckets = self._ipc_plan
        device = torch.device("cuda", torch.cuda.current_device())
        self._ipc_flat = pack([tensors[i] for i in buckets[index]], device)
        torch.cuda.current_stream().synchronize()
        return {"count": len(buckets), "metas": [metas[i] for i in buckets[index]],
                "handles": {device_uuid(device): ipc_handle(self._ipc_flat)}}

    def weight_sync_release(self) -> None:
        self._ipc_plan = self._ipc_flat = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def weight_sync_close(self) -> None:
        if self._sync_group is not None:
            self._sync_group.close()
            self._sync_group = None


# -- waiting, with the engines named -------------------------------------------------------------

def await_sync(actor_call, engine_call, timeout_s: float, what: str = "weight sync",
               limit_s: float | None = None) -> list:
    """Wait for both sides of one sync step (PendingCalls); the engines' results in engine order.
    Who is named on failure:
    - an engine that raised or died, at once (but the actor if its result, the engines' input,
      failed first; and a dead engine over one that raised within DEATH_GRACE_S of its death);
    - engines without an answer at the deadline, unless all of them and the actor are late: then
      the actor is stuck;
    - the actor's own error is its RoleError (its group timeout outlasts the driver's deadline, so
      it is never an engine's absence showing)."""
    import ray

    from rlhf_core.distributed.role_group import (
        DEATH_GRACE_S,
        RoleError,
        RoleTimeoutError,
        _get_ready,
        _root_cause_among,
    )

    limit = f"{limit_s if limit_s is not None else timeout_s:g} s"  # the deadline as the user set it
    calls = [c for c in (actor_call, engine_call) if c is not None]
    where = {ref: (c, i) for c in calls for i, ref in enumerate(c)}
    engine_values: list = [None] * len(engine_call)
    engine_done = [False] * len(engine_call)
    pending = [ref for c in calls for ref in c]
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for ref in ready:
            call, i = where[ref]
            if call is not engine_call:
                _get_ready(ref, call.role, call.ranks[i], call.method)  # the actor's error, as it is
                continue
            try:
                engine_values[i], engine_done[i] = _get_ready(ref, call.role, call.ranks[i], call.method), True
            except RoleError as e:
                _raise_actor_failure(actor_call)  # an engine whose input (the actor's result) failed
                culprit, error = i, e
                if e.cause is not None and pending:  # it raised: an engine that died mid-broadcast makes
                    # the others raise (gloo: "connection reset by peer"), often before Ray reports the death
                    engines = [r for r in pending if where[r][0] is engine_call]
                    death = _root_cause_among(engines, where, min(DEATH_GRACE_S, max(0.0, deadline - time.monotonic())))
                    if death is not None:
                        culprit = engine_call.ranks.index(death.ranks[0])
                        error = RoleError(death.role, death.ranks, death.method,
                                          f"{death.message}\n(then engine {i} failed too: {e.message})")
                raise EngineSyncError(culprit, f"{what} failed: {error} (timeout {limit}, RLHF_SYNC_TIMEOUT_S)") from e
    late = [i for i, done in enumerate(engine_done) if not done]
    actor_late = actor_call is not None and any(ref in pending for ref in actor_call)
    if actor_late and len(late) == len(engine_call):  # every engine waits on the actor: the actor is stuck
        raise RoleTimeoutError(actor_call.role, actor_call.ranks, actor_call.method, f"no answer to "
                               f"{actor_call.method}() within {limit} during the {what} (every engine waiting)")
    if late:
        raise EngineSyncError(late[0], f"{what} failed: no answer to {engine_call.method}() within {limit} "
                              "(stuck, or slower than RLHF_SYNC_TIMEOUT_S allows)", engines=late)
    if actor_late:
        raise RoleTimeoutError(actor_call.role, actor_call.ranks, actor_call.method, f"no answer to "
                               f"{actor_call.method}() within {limit} during the {what}")
    return engine_values


def _raise_actor_failure(actor_call) -> None:
    """The actor's error, if one of its calls already failed (its result feeds the engines' calls)."""
    import ray

    from rlhf_core.distributed.role_group import _get_ready

    for i, ref in enumerate(actor_call or []):
        ready, _ = ray.wait([ref], timeout=0, fetch_local=False)
        if ready:
            _get_ready(ref, actor_call.role, actor_call.ranks[i], actor_call.method)


# -- the driver's side -----------------------------------------------------------------------

class WeightSync(ABC):
    """The driver's side of one transport; `actor` and `engines` are `RoleGroup`s.
    `checkpoint_format`: the engines load weights as a saved checkpoint names and lays them out
    (vLLM); transformers 5 keeps some in another form in memory (a mixture of experts' fused expert
    tensors), which the actor converts back before sending."""

    checkpoint_format: bool = False
    backend: SyncBackend

    @abstractmethod
    def sync(self, actor, engines, timeout_s: float) -> None:
        """Every engine holds the actor's weights when this returns; EngineSyncError naming the
        engine otherwise, within `timeout_s`."""


class ObjectStoreSync(WeightSync):
    backend = SyncBackend.OBJECT_STORE

    def sync(self, actor, engines, timeout_s):
        weights = actor.call_all_async("weights", checkpoint_format=self.checkpoint_format)  # rank 0's dict; all gather
        loads = engines.call_all_async("update_weights", weights[0])  # an ObjectRef: each engine reads the store
        await_sync(weights, loads, timeout_s)


def sync_group_ranks(ranks_per_engine: list[int]) -> tuple[int, list[int]]:
    """Pure: the broadcast group's world size and each engine's first rank. Rank 0 is actor rank 0;
    engine e's workers (one per tensor-parallel rank: each holds a shard and loads it from the
    full tensors it receives) take the next `ranks_per_engine[e]` ranks."""
    if not ranks_per_engine or any(not isinstance(n, int) or n < 1 for n in ranks_per_engine):
        raise ValueError(f"every engine needs at least one receiving worker, got {ranks_per_engine}")
    offsets, next_rank = [], 1
    for n in ranks_per_engine:
        offsets.append(next_rank)
        next_rank += n
    return next_rank, offsets


class BroadcastSync(WeightSync):
    """NCCL or gloo: the group is opened on the first sync and kept for the run."""

    def __init__(self, backend: SyncBackend, ranks_per_engine: list[int], bucket_mb: int = DEFAULT_BUCKET_MB,
                 wire_dtype: str | None = None):
        self.backend, self.ranks_per_engine = backend, list(ranks_per_engine)
        self.bucket_bytes, self.wire_dtype = int(bucket_mb * 2**20), wire_dtype
        self.opened = False

    def open(self, actor, engines, timeout_s) -> None:
        host, port = actor.call_rank0("weight_sync_address")
        world_size, offsets = sync_group_ranks(self.ranks_per_engine)
        sender = actor.call_all_async("weight_sync_open", self.backend.value, host, port, world_size, timeout_s)
        receivers = engines.call_each_async("weight_sync_open", [((self.backend.value, host, port, offsets[e],
                                                                   world_size, timeout_s), {})
                                                                 for e in range(len(offsets))])
        await_sync(sender, receivers, timeout_s, what=f"opening the {self.backend.value} weight-sync group")
        self.opened = True

    def sync(self, actor, engines, timeout_s):
        deadline = time.monotonic() + timeout_s
        if not self.opened:
            self.open(actor, engines, timeout_s)
        # An engine still busy (a hung generation) would leave the others blocked in the collective,
        # all of them late at the deadline: ask first, so the one that does not answer is the one named.
        what = f"{self.backend.value} weight broadcast"
        await_sync(None, engines.call_all_async("weight_sync_ready"), max(0.0, deadline - time.monotonic()), what,
                   limit_s=timeout_s)
        sender = actor.call_all_async("weight_sync_send", self.bucket_bytes, self.wire_dtype,
                                      checkpoint_format=self.checkpoint_format)
        receivers = engines.call_all_async("weight_sync_receive")
        await_sync(sender, receivers, max(0.0, deadline - time.monotonic()), what, limit_s=timeout_s)


class IPCSync(WeightSync):
    backend = SyncBackend.IPC

    def __init__(self, bucket_mb: int = DEFAULT_BUCKET_MB, wire_dtype: str | None = None):
        self.bucket_bytes, self.wire_dtype = int(bucket_mb * 2**20), wire_dtype

    def sync(self, actor, engines, timeout_s):
        deadline = time.monotonic() + timeout_s
        await_sync(None, engines.call_all_async("weight_sync_ready"), timeout_s, what="CUDA IPC weight sync")
        index, count = 0, 1
        try:
            while index < count:
                left = max(0.0, deadline - time.monotonic())
                exports = actor.call_all_async("weight_sync_ipc", index, self.bucket_bytes, self.wire_dtype,
                                               checkpoint_format=self.checkpoint_format)
                parts = exports.per_rank(timeout_s=left)
                count = parts[0]["count"]
                handles = {uuid: h for part in parts for uuid, h in part["handles"].items()}
                loads = engines.call_all_async("weight_sync_receive_ipc", parts[0]["metas"], handles,
                                               index == 0, index == count - 1)
                await_sync(None, loads, max(0.0, deadline - time.monotonic()), what="CUDA IPC weight sync",
                           limit_s=timeout_s)
                index += 1
        finally:
            actor.call_all_async("weight_sync_release")


def make_weight_sync(backend: SyncBackend, ranks_per_engine: list[int], bucket_mb: int = DEFAULT_BUCKET_MB,
                     wire_dtype: str | None = None, checkpoint_format: bool = False) -> WeightSync:
    if backend == SyncBackend.OBJECT_STORE:
        sync = ObjectStoreSync()
    elif backend == SyncBackend.IPC:
        sync = IPCSync(bucket_mb, wire_dtype)
    else:
        sync = BroadcastSync(backend, ranks_per_engine, bucket_mb, wire_dtype)
    sync.checkpoint_format = checkpoint_format
    return sync
