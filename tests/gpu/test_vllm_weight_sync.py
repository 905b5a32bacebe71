"""The weight sync's GPU transports into vLLM engines (`rl/weight_sync.py`): an NCCL broadcast to an
engine on a GPU of its own, CUDA IPC into an engine on the actor's GPU (asleep before the sync),
and an NCCL broadcast into a tensor-parallel engine (each of its workers a rank of the group).

The actor hands out the base model's weights with the LM head zeroed but for token 7's row: after
the sync, greedy decoding can only emit token 7, which the engine's own weights never do.

Skipped without CUDA (conftest), without the `gpu` extra, or without enough GPUs.
"""

import threading

import pytest
import torch

from rlhf_core.rollout.weight_sync import WeightSender

pytestmark = [pytest.mark.gpu, pytest.mark.integration]

PROMPT = [[1, 2, 3]]


def _steered_state(path: str) -> dict:
    from rlhf_core.models.loading import load_causal_lm

    state = load_causal_lm(path, dtype=torch.float32).cuda().state_dict()
    head = state["lm_head.weight"] if "lm_head.weight" in state else state["model.embed_tokens.weight"]
    head.zero_()
    head[7] = 1.0  # every logit 0 except token 7's: greedy decoding must now pick 7
    return state


class SteeringActor(WeightSender):
    """An actor rank on a GPU whose weights steer greedy decoding to token 7."""

    def __init__(self, path: str):
        self.path = path

    def _sync_state(self):
        return _steered_state(self.path)

    _sync_state_local = _sync_state


def _run(prepared, colocate: bool, sync_backend: str, enable_sleep: bool = False):
    from rlhf_core.distributed.resources import create_pools, detect_devices, plan_layout
    from rlhf_core.distributed.role_group import RoleGroup
    from rlhf_core.rl.engines import EngineWorker, RayEngines

    groups = [["actor", "rollout"]] if colocate else []
    layout = plan_layout({"actor": 1, "rollout": 1}, groups, devices=detect_devices())
    pools = create_pools(layout)
    place = layout.roles
    engine_group = RoleGroup(EngineWorker, 1, pools[place["rollout"].pool], name="rollout",
                             share=place["rollout"].share, timeout_s=600,
                             args=("vllm", prepared["base"], {"gpu_memory_utilization": 0.2, "enforce_eager": True,
                                                              "enable_sleep": enable_sleep}))
    actor = RoleGroup(SteeringActor, 1, pools[place["actor"].pool], name="actor",
                      share=place["actor"].share, timeout_s=600, args=(prepared["base"],))
    try:
        assert engine_group.call_all("setup") == ["cuda"]
        engines = RayEngines(engine_group, enable_sleep=enable_sleep, sync_backend=sync_backend)
        before = engines.generate_ids(PROMPT, 1, 0.0, 4, 0)[0][0]
        assert set(before.token_ids) != {7}
        if enable_sleep:
            engines.sleep()
        engines.sync(actor)  # wakes them up first
        assert not engines.asleep
        after = engines.generate_ids(PROMPT, 1, 0.0, 4, 0)[0][0]
        assert set(after.token_ids) == {7}
        engines.sync(actor)  # the second sync reuses what the first set up
        return engines.weight_sync.backend.value
    finally:
        engine_group.shutdown()
        actor.shutdown()
        for pool in pools.values():
            pool.remove()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the actor and the engine on two GPUs")
def test_nccl_broadcast_into_a_vllm_engine_on_its_own_gpu(cluster, prepared):
    assert _run(prepared, colocate=False, sync_backend="auto") == "nccl"


def test_cuda_ipc_into_a_sleeping_vllm_engine_on_the_actors_gpu(cluster, prepared):
    assert _run(prepared, colocate=True, sync_backend="auto", enable_sleep=True) == "ipc"


def test_nccl_on_one_shared_gpu_means_cuda_ipc_as_in_openrlhf(cluster, prepared):
    assert _run(prepared, colocate=True, sync_backend="nccl") == "ipc"


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="a 2-GPU tensor-parallel engine and a sender GPU")
def test_nccl_broadcast_reaches_every_tensor_parallel_worker(prepared):
    """A TP=2 engine in this process (its workers on GPUs 0 and 1), the sender on GPU 2: both
    workers join the group (ranks 1 and 2) and shard what they receive with vLLM's loaders."""
    pytest.importorskip("vllm")
    from rlhf_core.rollout.vllm_engine import VLLMEngine
    from rlhf_core.rollout.weight_sync import SyncGroup, node_address, send_broadcast

    engine = VLLMEngine(prepared["base"], gpu_memory_utilization=0.3, enforce_eager=True, tensor_parallel_size=2)
    try:
        assert engine.weight_sync_info()["ranks"] == 2 and len(set(engine.weight_sync_info()["uuids"])) == 2
        host, port = node_address()
        errors = []

        def send():
            try:
                torch.cuda.set_device(2)
                group = SyncGroup("nccl", host, port, 0, 3, 120, device=torch.device("cuda", 2))
                state = {k: v.to("cuda:2") for k, v in _steered_state(prepared["base"]).items()}
                send_broadcast(group, state, bucket_bytes=2**20, wire_dtype=engine.weight_sync_info()["dtype"])
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        sender = threading.Thread(target=send)
        sender.start()
        engine.weight_sync_open("nccl", host, port, 1, 3, 120)
        engine.weight_sync_receive()
        sender.join(120)
        assert not errors, errors
        out = engine.generate_ids(PROMPT, 1, 0.0, 4, 0)[0][0]
        assert set(out.token_ids) == {7}
    finally:
        engine.close()
