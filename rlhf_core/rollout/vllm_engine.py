"""Rollouts with vLLM (GPU only; `pip install 'rlhf-lifecycle[gpu]'`), behind the same interface.

vllm is imported only when an engine is built. Prompts go in as our token ids: vLLM's text path
would add a second BOS before a chat-templated prompt. Each prompt has its own seed
(`seed + index`), so results do not depend on vLLM's scheduling; greedy runs once per prompt and
is repeated; `generation_config="vllm"` keeps checkpoint sampling defaults out.

Log-probs are after temperature (`processed_logprobs`), what the trainer recomputes.
`update_weights` loads in place via `LLM.apply_model`, which needs the engine core in-process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before the engine is built). `sleep`/`wake_up` are vLLM's
level 1 (`enable_sleep=True`).

Tensor parallelism inside a Ray placement group: the actor holds no GPU; vLLM's Ray executor starts
one worker per bundle given (`VLLM_RAY_BUNDLE_INDICES`), each taking `VLLM_RAY_PER_WORKER_GPUS` of
its GPU (`tensor_parallel_setup`). The RL weight sync (`rl/weight_sync.py`) reaches every worker
through `LLM.collective_rpc` and `WeightSyncExtension`: each joins the sync group as its own rank
and loads buckets with the model's `load_weights` (which shards for its rank).
"""

from __future__ import annotations

import gc
import importlib.util
import os

import torch

from rlhf_core.rollout.base import RolloutEngine, Sample, check_request, cut_at_eos

# Set by Ray for an actor; vLLM's Ray executor assigns each of its workers the GPUs itself.
VISIBLE_DEVICES_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def vllm_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def tensor_parallel_setup(tensor_parallel_size: int, bundle_indices: list[int] | None = None,
                          gpus_per_worker: float | None = None, backend: str | None = None
                          ) -> tuple[str | None, dict[str, str], tuple[str, ...]]:
    """Pure: `(distributed_executor_backend, environment to set, environment variables to remove)`
    for an engine of `tensor_parallel_size` workers.

    One worker, or no bundles (an engine outside a placement group): vLLM's choice (`backend` as
    given), nothing set. Several workers in bundles of the placement group the engine's actor
    runs in: vLLM's Ray executor, one worker in each bundle, taking `gpus_per_worker` (default 1)
    of its GPU; the actor's own visible-devices variables are removed (the engine's process runs
    no model; the executor sets each worker's)."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be positive, got {tensor_parallel_size}")
    if not bundle_indices or tensor_parallel_size == 1:
        if bundle_indices and len(bundle_indices) != 1:
            raise ValueError(f"an engine of one worker was given bundles {bundle_indices}")
        return backend, {}, ()
    if len(bundle_indices) != tensor_parallel_size or len(set(bundle_indices)) != len(bundle_indices):
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs as many distinct bundles, got "
                         f"{bundle_indices}")
    if backend not in (None, "ray"):
        raise ValueError(f"distributed_executor_backend {backend!r}: workers in placement-group bundles need 'ray'")
    gpus = 1.0 if gpus_per_worker is None else float(gpus_per_worker)
    if not 0 < gpus <= 1:
        raise ValueError(f"gpus_per_worker must be in (0, 1], got {gpus_per_worker}")
    env = {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundle_indices)), "VLLM_RAY_PER_WORKER_GPUS": f"{gpus:g}"}
    return "ray", env, VISIBLE_DEVICES_VARS


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, add_special_tokens: bool = False, gpu_memory_utilization: float = 0.4,
                 dtype: str = "auto", enforce_eager: bool = False, seed: int = 0, enable_sleep: bool = False,
                 tensor_parallel_size: int = 1, distributed_executor_backend: str | None = None,
                 bundle_indices: list[int] | None = None, gpus_per_worker: float | None = None):
        """`bundle_indices`: the bundles of the current placement group that the `tensor_parallel_size`
        workers take (`gpus_per_worker` of each GPU); see `tensor_parallel_setup`."""
        distributed_executor_backend, env, unset = tensor_parallel_setup(
            tensor_parallel_size, bundle_indices, gpus_per_worker, distributed_executor_backend)
        for name in unset:
            os.environ.pop(name, None)
        os.environ.update(env)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # apply_model reaches the model in-process
        from vllm import LLM

        from rlhf_core.models.loading import load_tokenizer

        self.tokenizer = load_tokenizer(model_path)
        self.add_special_tokens = add_special_tokens
        # Leaves room on the GPU for the transformers models evaluation loads next to it.
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                       generation_config="vllm", logprobs_mode="processed_logprobs", enable_sleep_mode=enable_sleep,
                       tensor_parallel_size=tensor_parallel_size, distributed_executor_backend=distributed_executor_backend,
                       worker_extension_cls=f"{__name__}.WeightSyncExtension")
        self.tensor_parallel_size = tensor_parallel_size
        self.eos_ids = {self.tokenizer.eos_token_id}

    def generate_ids(self, prompt_ids: list[list[int]], n: int = 1, temperature: float = 0.0,
                     max_new_tokens: int = 64, seed: int = 0) -> list[list[Sample]]:
        from vllm import SamplingParams

        check_request(n, temperature, max_new_tokens)
        greedy = temperature == 0
        inputs = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        params = [SamplingParams(n=1 if greedy else n, temperature=temperature, top_p=1.0, max_tokens=max_new_tokens,
                                 seed=seed + i, skip_special_tokens=True, repetition_penalty=1.0, logprobs=0)
                  for i in range(len(prompt_ids))]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        results = []
        for out in outputs:
            group = [self._sample(list(c.token_ids), c.logprobs or []) for c in out.outputs]
            results.append(group * n if greedy else group)
        return results

    def _sample(self, token_ids: list[int], logprobs: list) -> Sample:
        response = cut_at_eos(token_ids, self.eos_ids)
        values = tuple(float(step[t].logprob) if step and t in step else 0.0
                       for t, step in zip(response, logprobs + [None] * len(response), strict=False))
        return Sample(tuple(response), values, bool(response) and response[-1] in self.eos_ids)

    def update_weights(self, weights: dict) -> None:
        items = list(weights.items())
        self.llm.apply_model(lambda model: model.load_weights(iter(items)))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    # the weight sync's receiving side, run on every worker of the engine (WeightSyncExtension)
    def weight_sync_info(self) -> dict:
        dtypes = set(self.llm.collective_rpc("rlhf_sync_dtype"))
        return {"cuda": True, "ranks": self.tensor_parallel_size, "dtype": dtypes.pop() if len(dtypes) == 1 else None,
                "uuids": list(self.llm.collective_rpc("rlhf_sync_device_uuid"))}

    def weight_sync_open(self, backend: str, host: str, port: int, rank_offset: int, world_size: int,
                         timeout_s: float) -> None:
        self.llm.collective_rpc("rlhf_sync_open", args=(backend, host, port, rank_offset, world_size, timeout_s))

    def weight_sync_receive(self) -> int:
        counts = self.llm.collective_rpc("rlhf_sync_receive")
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        return counts[0]

    def weight_sync_receive_ipc(self, metas: list, handles: dict) -> int:
        counts = self.llm.collective_rpc("rlhf_sync_receive_ipc", args=(metas, handles))
        self.llm.reset_prefix_cache()
        return counts[0]

    def weight_sync_close(self) -> None:
        self.llm.collective_rpc("rlhf_sync_close")

    def sleep(self) -> None:
        self.llm.sleep(level=1)

    def wake_up(self) -> None:
        self.llm.wake_up()

    def close(self) -> None:
        engine = getattr(getattr(self, "llm", None), "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        gc.collect()
        torch.cuda.empty_cache()


def worker_sync_rank(rank_offset: int, worker_rank: int) -> int:
    """Pure: the weight-sync group rank of an engine's worker `worker_rank` (its tensor-parallel
    rank, 0..tp-1), the engine's workers taking ranks rank_offset..rank_offset+tp-1."""
    if rank_offset < 1 or worker_rank < 0:
        raise ValueError(f"rank_offset {rank_offset} (rank 0 is the actor) and worker rank {worker_rank}")
    return rank_offset + worker_rank


class WeightSyncExtension:
    """Mixed into each vLLM worker (`worker_extension_cls`): the worker's side of the weight sync.
    vLLM's worker gives `self.device`, `self.model_config` and `self.model_runner.model`."""

    def rlhf_sync_dtype(self) -> str:
        return str(self.model_config.dtype).removeprefix("torch.")

    def rlhf_sync_device_uuid(self) -> str:
        from rlhf_core.rollout.weight_sync import device_uuid

        return device_uuid(self.device)

    def rlhf_sync_open(self, backend: str, host: str, port: int, rank_offset: int, world_size: int,
                       timeout_s: float) -> None:
        import torch.distributed as dist

        from rlhf_core.rollout.weight_sync import SyncGroup

        # this worker's rank in the sync group: after the engines before it, at its rank in the engine
        rank = worker_sync_rank(rank_offset, dist.get_rank() if dist.is_initialized() else 0)
        self._rlhf_sync_group = SyncGroup(backend, host, port, rank, world_size, timeout_s, device=self.device)

    def rlhf_sync_receive(self) -> int:
        from rlhf_core.rollout.weight_sync import receive_broadcast

        model = self.model_runner.model
        return receive_broadcast(self._rlhf_sync_group, lambda items: model.load_weights(weights=items))

    def rlhf_sync_receive_ipc(self, metas: list, handles: dict) -> int:
        from rlhf_core.rollout.weight_sync import device_uuid, open_ipc_handle, unpack

        flat = open_ipc_handle(handles[device_uuid(self.device)], self.device)
        self.model_runner.model.load_weights(weights=unpack(flat, metas))
        torch.cuda.synchronize(self.device)  # loaded before the actor frees the bucket
        return len(metas)

    def rlhf_sync_close(self) -> None:
        group = getattr(self, "_rlhf_sync_group", None)
        if group is not None:
            group.close()
            self._rlhf_sync_group = None
