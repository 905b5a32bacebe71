"""The rollout engines of an RL stage, as the controller sees them: generate, take the actor's new
weights, give memory back between rollouts.

- `LocalEngines`: one transformers engine in the controller's process, with its own copy of the
  policy, refreshed from the local actor.
- `RayEngines`: `--vllm.num_engines` vLLM engines (or one transformers engine) as Ray actors in
  the rollout pool. Prompts are split in contiguous parts; engine i samples with seed
  `seed + i * ENGINE_SEED_STRIDE`, so one engine reproduces the local run. The weight transport
  (`--vllm.sync_backend`, `rollout/weight_sync.py`: object store, NCCL/gloo broadcast from actor
  rank 0, or CUDA IPC to engines on the actor's GPUs) is set up on the first sync, from what the
  engines and the actor ranks report (vLLM or not, CUDA, which GPU).

Every sync has a deadline (`RLHF_SYNC_TIMEOUT_S`, default 600 s): a stuck or dead engine fails the
step with `EngineSyncError` naming it, never a hang. Generation has the roles' call timeout
(`RLHF_STAGE_TIMEOUT_S`), and a dead engine fails it at once. With `--vllm.enable_sleep` the
engines sleep from the end of a rollout's generation to the weight sync before the next.
"""

from __future__ import annotations

import os
import sys

from rlhf_core.rollout.base import budget_slice
from rlhf_core.rollout.weight_sync import (  # noqa: F401 (EngineSyncError, sync_timeout_s: part of this module's API)
    DEFAULT_BUCKET_MB,
    DEFAULT_SYNC_TIMEOUT_S,
    EngineSyncError,
    SyncBackend,
    SyncGroup,
    WeightSync,
    device_uuid,
    make_weight_sync,
    open_ipc_handle,
    receive_broadcast,
    resolve_sync_backend,
    sync_timeout_s,
    unpack,
)

ENGINE_SEED_STRIDE = 1_000_003


def prompt_shards(num_prompts: int, num_engines: int) -> list[range]:
    """Contiguous, nearly equal ranges of prompt indices, one per engine (empty ones left out)."""
    base, extra = divmod(num_prompts, num_engines)
    out, start = [], 0
    for i in range(num_engines):
        stop = start + base + (1 if i < extra else 0)
        out.append(range(start, stop))
        start = stop
    return [r for r in out if len(r)]


class _Sleeping:
    """Sleep/wake bookkeeping: calls are idempotent and do nothing unless sleeping is enabled."""

    enable_sleep: bool = False
    asleep: bool = False

    def sleep(self) -> None:
        if self.enable_sleep and not self.asleep:
            self._sleep()
            self.asleep = True

    def wake_up(self) -> None:
        if self.asleep:
            self._wake_up()
            self.asleep = False


class LocalEngines(_Sleeping):
    num_engines = 1

    def __init__(self, engine, enable_sleep: bool = False):
        self.engine, self.enable_sleep = engine, enable_sleep

    def generate_ids(self, prompt_ids, n, temperature, max_new_tokens, seed, top_k=-1, top_p=1.0):
        return self.engine.generate_ids(prompt_ids, n, temperature, max_new_tokens, seed=seed, top_k=top_k, top_p=top_p)

    def sync(self, actor) -> None:
        self.wake_up()
        self.engine.update_weights(actor.call_rank0("weights"))

    def _sleep(self) -> None:
        self.engine.sleep()

    def _wake_up(self) -> None:
        self.engine.wake_up()

    def shutdown(self) -> None:
        self.engine.close()


def engine_bundles(env) -> dict:
    """The bundles a tensor-parallel engine's workers take, from what its RoleGroup rank was told
    (`RLHF_RANK_BUNDLES`, `RLHF_RANK_BUNDLE_GPUS`), as VLLMEngine's keyword arguments; {} for an
    engine of one GPU (its own actor's)."""
    bundles = env.get("RLHF_RANK_BUNDLES")
    if not bundles:
        return {}
    gpus = env.get("RLHF_RANK_BUNDLE_GPUS")
    return {"bundle_indices": [int(b) for b in bundles.split(",")], "gpus_per_worker": float(gpus) if gpus else None}


def vllm_dtype(precision: str) -> str:
    """vLLM's name for the dtype a trainer of `precision` (`--ds.param_dtype`) computes in here."""
    from rlhf_core.infra.precision import Precision, resolve_here

    return {Precision.BF16: "bfloat16", Precision.FP16: "float16", Precision.FP32: "float32"}[resolve_here(precision)]


class EngineWorker:
    """One rollout engine as a Ray actor: built in `setup()` (vLLM or transformers), then serving
    the `RolloutEngine` calls."""

    def __init__(self, backend: str, model_path: str, options: dict):
        self.backend, self.model_path, self.options = backend, model_path, options
        self.engine = None

    def setup(self) -> str:
        from rlhf_core.infra.hubs import use_modelscope

        self.options = dict(self.options)
        use_modelscope(self.options.pop("use_ms", False))
        if self.backend == "vllm":
            from rlhf_core.rollout.vllm_engine import VLLMEngine

            bundles = engine_bundles(os.environ)
            if self.options.get("tensor_parallel_size", 1) > 1 and not bundles:
                raise ValueError(f"a vLLM engine of tensor_parallel_size {self.options['tensor_parallel_size']} needs "
                                 "as many placement bundles: place it with RoleGroup(bundles_per_rank=...)")
            options = dict(self.options)
            # sample in the precision the trainer computes in, resolved on this engine's node (vLLM's
            # own "auto" would load an fp32 checkpoint in half precision)
            options["dtype"] = vllm_dtype(options.pop("precision", "auto"))
            self.engine = VLLMEngine(self.model_path, **options, **bundles)
            # the CUDA build on GPUs (a tensor-parallel engine's own actor holds none), the CPU build on CPUs
            return "cuda" if self.engine.weight_sync_info()["cuda"] else "cpu"

        import torch

        from rlhf_core.rollout.hf import TransformersEngine

        # fp32 on CPU (exact next to the trainer's recomputation), bf16 on GPU
        self.engine = TransformersEngine.from_pretrained(self.model_path, **self.options)
        return str(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))

    def generate_ids(self, prompt_ids, n, temperature, max_new_tokens, seed, top_k=-1, top_p=1.0):
        return self.engine.generate_ids(prompt_ids, n, temperature, max_new_tokens, seed=seed, top_k=top_k, top_p=top_p)

    def update_weights(self, weights: dict) -> bool:
        self.engine.update_weights(weights)
        return True

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()

    # the receiving side of the weight sync (rollout/weight_sync.py): a vLLM engine passes each call on
    # to its workers; a transformers engine is one receiver itself, loading all weights at once
    def weight_sync_info(self) -> dict:
        """{"vllm", "cuda", "ranks" (members of the sync group), "dtype", "uuids" (GPUs)}."""
        if self.backend == "vllm":
            return {"vllm": True, **self.engine.weight_sync_info()}
        device = self.engine.device
        dtype = str(next(self.engine.model.parameters()).dtype).removeprefix("torch.")
        cuda = device.type == "cuda"
        return {"vllm": False, "cuda": cuda, "ranks": 1, "dtype": dtype, "uuids": [device_uuid(device)] if cuda else []}

    def weight_sync_ready(self) -> bool:
        return True

    def weight_sync_open(self, backend: str, host: str, port: int, rank_offset: int, world_size: int,
                         timeout_s: float) -> bool:
        if self.backend == "vllm":
            self.engine.weight_sync_open(backend, host, port, rank_offset, world_size, timeout_s)
        else:
            self._sync_group = SyncGroup(backend, host, port, rank_offset, world_size, timeout_s,
                                         device=self.engine.device)
        return True

    def weight_sync_receive(self) -> int:
        if self.backend == "vllm":
            return self.engine.weight_sync_receive()
        received: dict = {}
        count = receive_broadcast(self._sync_group, received.update)  # views into buckets this call owns
        self.engine.update_weights(received)
        return count

    def weight_sync_receive_ipc(self, metas: list, handles: dict, first: bool, last: bool) -> int:
        if self.backend == "vllm":
            return self.engine.weight_sync_receive_ipc(metas, handles, first, last)
        device = self.engine.device
        flat = open_ipc_handle(handles[device_uuid(device)], device)
        self._ipc_received = getattr(self, "_ipc_received", {})
        self._ipc_received.update((name, t.clone()) for name, t in unpack(flat, metas))  # the actor frees its copy
        if last:
            received, self._ipc_received = self._ipc_received, {}
            self.engine.update_weights(received)
        return len(metas)

    def weight_sync_close(self) -> None:
        if self.backend == "vllm":
            self.engine.weight_sync_close()
        elif getattr(self, "_sync_group", None) is not None:
            self._sync_group.close()
            self._sync_group = None


def check_engine_workers(infos: list[dict]) -> None:
    """Every CUDA engine reported one GPU per worker of the sync group (`ranks`: its tensor-parallel
    workers), all distinct: a worker missing from the group would leave the broadcast waiting,
    and NCCL cannot join two ranks on one GPU. EngineSyncError naming the engine otherwise."""
    for e, info in enumerate(infos):
        if info["ranks"] < 1:
            raise EngineSyncError(e, f"reports {info['ranks']} weight-sync workers")
        if info["cuda"] and (len(info["uuids"]) != info["ranks"] or len(set(info["uuids"])) != len(info["uuids"])):
            raise EngineSyncError(e, f"{info['ranks']} tensor-parallel workers report the GPUs {info['uuids']}: "
                                  "expected one GPU of its own per worker")


class RayEngines(_Sleeping):
    """`group`: a RoleGroup of EngineWorker. `sync_backend`: `--vllm.sync_backend` (auto, nccl, gloo,
    ipc, object_store), resolved on the first sync; the default, object_store, needs nothing from
    the workers but `update_weights`. `bucket_mb`: the broadcast's bucket size. `checkpoint_format`:
    the engines are vLLM's, which load weights in a saved checkpoint's form (`WeightSync`)."""

    def __init__(self, group, enable_sleep: bool = False, timeout_s: float | None = None,
                 sync_backend: str = "object_store", bucket_mb: int = DEFAULT_BUCKET_MB,
                 checkpoint_format: bool = False):
        self.group, self.checkpoint_format = group, checkpoint_format
        self.num_engines = group.world_size
        self.enable_sleep = enable_sleep
        self.timeout_s = timeout_s if timeout_s is not None else sync_timeout_s()
        self.requested_sync, self.bucket_mb = sync_backend, bucket_mb
        self.weight_sync: WeightSync | None = None

    def generate_ids(self, prompt_ids, n, temperature, max_new_tokens, seed, top_k=-1, top_p=1.0):
        shards = prompt_shards(len(prompt_ids), self.num_engines)
        calls = [(([prompt_ids[i] for i in r], n, temperature, budget_slice(max_new_tokens, r),
                   seed + e * ENGINE_SEED_STRIDE),
                  {"top_k": top_k, "top_p": top_p}) for e, r in enumerate(shards)]
        parts = self.group.call_each_async("generate_ids", calls, ranks=range(len(shards))).per_rank()
        return [group for part in parts for group in part]

    def setup_sync(self, actor) -> WeightSync:
        """Pick the transport from what the engines and the actor ranks report (`actor`: the policy's RoleGroup)."""
        from rlhf_core.infra.settings import ConfigError
        from rlhf_core.rollout.weight_sync import await_sync

        if self.requested_sync == SyncBackend.OBJECT_STORE.value:
            self.weight_sync = make_weight_sync(SyncBackend.OBJECT_STORE, [], checkpoint_format=self.checkpoint_format)
            return self.weight_sync
        engines = await_sync(None, self.group.call_all_async("weight_sync_info"), self.timeout_s,
                             what="weight sync setup")
        check_engine_workers(engines)
        devices = actor.call_all("weight_sync_device")
        actor_gpus = {d["uuid"] for d in devices if d["uuid"]}
        engine_gpus = [u for info in engines for u in info["uuids"]]
        backend = resolve_sync_backend(self.requested_sync, vllm=any(info["vllm"] for info in engines),
                                       colocated=bool(actor_gpus & set(engine_gpus)),
                                       cuda=all(info["cuda"] for info in engines) and all(d["cuda"] for d in devices))
        if backend == SyncBackend.IPC and not set(engine_gpus) <= actor_gpus:
            raise ConfigError("--vllm.sync_backend: some engine workers share the actor's GPUs and some do not; CUDA "
                              "IPC needs every engine on an actor rank's GPU (--train.colocate_all with actor ranks "
                              "= --vllm.num_engines x --vllm.tensor_parallel_size)")
        dtypes = {info["dtype"] for info in engines}
        wire_dtype = dtypes.pop() if len(dtypes) == 1 and backend != SyncBackend.OBJECT_STORE else None
        self.weight_sync = make_weight_sync(backend, [info["ranks"] for info in engines], self.bucket_mb, wire_dtype,
                                            self.checkpoint_format)
        print(f"rlhf: weight sync to {self.num_engines} rollout engine(s): {backend.value}"
              + (f" ({wire_dtype} on the wire)" if wire_dtype else ""), file=sys.stderr, flush=True)
        return self.weight_sync

    def sync(self, actor) -> None:
        """Every engine loads the actor's current weights (`actor`: the policy's RoleGroup)."""
        self.wake_up()
        weight_sync = self.weight_sync or self.setup_sync(actor)
        weight_sync.sync(actor, self.group, self.timeout_s)

    def _sleep(self) -> None:
        self.group.call_all("sleep")

    def _wake_up(self) -> None:
        self.group.call_all("wake_up")

    def shutdown(self) -> None:
        self.group.shutdown()


def generate_on_engines(backend: str, model_path: str, prompt_ids: list[list[int]], n: int, temperature: float,
                        max_new_tokens: int, seed: int, num_engines: int, top_p: float = 1.0) -> list[list]:
    """Generation outside RL on `num_engines` engines as Ray actors (`EngineWorker`s of `backend`:
    vllm, transformers, or auto as `make_engine` resolves it; a local Ray when no cluster is given):
    engine e generates the e-th contiguous share of the prompts with seed `seed + e x
    ENGINE_SEED_STRIDE` (`RayEngines`); the groups come back in prompt order. `rlhf batch_inference
    --num_engines` and `rlhf pairs --num_engines`."""
    from rlhf_core.distributed.cluster import ensure_ray
    from rlhf_core.distributed.role_group import RoleGroup
    from rlhf_core.rollout import auto_backend

    backend = auto_backend().value if backend == "auto" else backend
    started = ensure_ray()
    group = None
    try:
        group = RoleGroup(EngineWorker, num_engines, name="rollout", args=(backend, model_path, {}))
        group.call_all("setup")
        return RayEngines(group).generate_ids(prompt_ids, n, temperature, max_new_tokens, seed, top_p=top_p)
    finally:
        if group is not None:
            group.shutdown()
        if started:
            import ray

            ray.shutdown()
