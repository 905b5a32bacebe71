"""The rollout engines of an RL stage, as the controller sees them: generate, take the actor's new
weights, give memory back between rollouts.

- `LocalEngines`: one engine in the controller's process (a transformers engine with its own copy
  of the policy), refreshed from the local actor.
- `RayEngines`: `--vllm.num_engines` vLLM engines (or one transformers engine when there are none)
  as Ray actors in the rollout pool. Prompts are split over the engines in contiguous parts
  (engine i samples with seed `seed + i * ENGINE_SEED_STRIDE`, so one engine reproduces the local
  run). After every training step each engine loads the actor's weights from the object store:
  every actor rank is asked for them (a ZeRO-3 gather is collective), rank 0's dict is put in the
  object store once and every engine reads it from there, never through the driver.

Every sync has a deadline (`RLHF_SYNC_TIMEOUT_S`, default 600 s): a stuck or dead engine fails the
step with `EngineSyncError` naming the engine, never a hang. Generation is bounded by the same
group timeout as the roles' calls (`RLHF_STAGE_TIMEOUT_S`), and a dead engine fails it at once.

With `--vllm.enable_sleep` (colocated engines) the engines sleep while the models train: after a
rollout's generation, and wake up again before the weight sync that precedes the next one.
"""

from __future__ import annotations

import os

from rlhf_core.distributed.role_group import RoleError

ENGINE_SEED_STRIDE = 1_000_003
DEFAULT_SYNC_TIMEOUT_S = 600.0


def sync_timeout_s() -> float:
    return float(os.environ.get("RLHF_SYNC_TIMEOUT_S") or DEFAULT_SYNC_TIMEOUT_S)


class EngineSyncError(RuntimeError):
    """A rollout engine did not take the new weights (it raised, died or did not answer in time)."""

    def __init__(self, engine: int, message: str):
        self.engine = engine
        super().__init__(f"rollout engine {engine}: {message}")


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

    def generate_ids(self, prompt_ids, n, temperature, max_new_tokens, seed):
        return self.engine.generate_ids(prompt_ids, n, temperature, max_new_tokens, seed=seed)

    def sync(self, actor) -> None:
        self.wake_up()
        self.engine.update_weights(actor.call_rank0("weights"))

    def _sleep(self) -> None:
        self.engine.sleep()

    def _wake_up(self) -> None:
        self.engine.wake_up()

    def shutdown(self) -> None:
        self.engine.close()


class EngineWorker:
    """One rollout engine as a Ray actor: built in `setup()` (vLLM or transformers), then serving
    the `RolloutEngine` calls."""

    def __init__(self, backend: str, model_path: str, options: dict):
        self.backend, self.model_path, self.options = backend, model_path, options
        self.engine = None

    def setup(self) -> str:
        import torch

        if self.backend == "vllm":
            from rlhf_core.rollout.vllm_engine import VLLMEngine

            self.engine = VLLMEngine(self.model_path, **self.options)
        else:
            from rlhf_core.rollout.hf import TransformersEngine

            # fp32 on CPU (exact next to the trainer's recomputation), bf16 on GPU
            self.engine = TransformersEngine.from_pretrained(self.model_path, **self.options)
        return str(torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))

    def generate_ids(self, prompt_ids, n, temperature, max_new_tokens, seed):
        return self.engine.generate_ids(prompt_ids, n, temperature, max_new_tokens, seed=seed)

    def update_weights(self, weights: dict) -> bool:
        self.engine.update_weights(weights)
        return True

    def sleep(self) -> None:
        self.engine.sleep()

    def wake_up(self) -> None:
        self.engine.wake_up()


class RayEngines(_Sleeping):
    def __init__(self, group, enable_sleep: bool = False, timeout_s: float | None = None):
        self.group = group  # a RoleGroup of EngineWorker
        self.num_engines = group.world_size
        self.enable_sleep = enable_sleep
        self.timeout_s = timeout_s if timeout_s is not None else sync_timeout_s()

    def generate_ids(self, prompt_ids, n, temperature, max_new_tokens, seed):
        shards = prompt_shards(len(prompt_ids), self.num_engines)
        calls = [(([prompt_ids[i] for i in r], n, temperature, max_new_tokens, seed + e * ENGINE_SEED_STRIDE), {})
                 for e, r in enumerate(shards)]
        parts = self.group.call_each_async("generate_ids", calls, ranks=range(len(shards))).per_rank()
        return [group for part in parts for group in part]

    def sync(self, actor) -> None:
        """Every engine loads the actor's current weights (`actor`: a RayGroup of policy ranks)."""
        from rlhf_core.distributed.role_group import gather_all

        self.wake_up()
        weights = actor.group.call_all_async("weights")  # rank 0's dict; every rank takes part in a ZeRO-3 gather
        loads = self.group.call_all_async("update_weights", weights[0])  # an ObjectRef: each engine reads the store
        try:
            gather_all([weights, loads], timeout_s=self.timeout_s)
        except RoleError as e:
            if e.role != self.group.name:
                raise
            raise EngineSyncError(e.rank, f"weight sync failed: {e} (timeout {self.timeout_s:g} s, "
                                  "RLHF_SYNC_TIMEOUT_S)") from e

    def _sleep(self) -> None:
        self.group.call_all("sleep")

    def _wake_up(self) -> None:
        self.group.call_all("wake_up")

    def shutdown(self) -> None:
        self.group.shutdown()
