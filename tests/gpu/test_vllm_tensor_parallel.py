"""Tensor-parallel vLLM engines (`--vllm.tensor_parallel_size 2`) placed as the RL stage places them:
one Ray actor per engine in the first of its 2 bundles, vLLM's Ray executor starting a worker in
each (`VLLM_RAY_BUNDLE_INDICES`), alone or colocated with a 2-rank actor (fractional GPU shares).

- a tp=2 engine generates, both workers on GPUs of their own, greedily like the transformers model;
- weights synced into a tp=2 engine (NCCL broadcast from an actor on a third GPU; CUDA IPC from a
  colocated 2-rank actor, the engine asleep before the sync) equal the actor's: each worker's
  shard of a row-parallel and a vocabulary-parallel weight, put back together, and the replicated
  norm, in the engine's dtype; greedy decoding then follows the steered LM head;
- a short GRPO run with one tp=2 engine colocated with 2 actor ranks.

Skipped without CUDA (conftest), without the `gpu` extra, or without enough GPUs.
"""


import pytest
import torch

from rlhf_core.rl.engines import EngineWorker
from tests.gpu.test_vllm_weight_sync import PROMPT, SteeringActor, _steered_state

pytestmark = [pytest.mark.gpu, pytest.mark.integration,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="a tensor-parallel engine of 2 GPUs")]

TP = 2
CHECKED = ("model.norm.weight", "model.layers.0.self_attn.o_proj.weight", "model.embed_tokens.weight")


class InspectedEngine(EngineWorker):
    def worker_params(self, names: tuple[str, ...]) -> list[dict]:
        """Each tensor-parallel worker's own (sharded) copy of the named parameters, on the CPU."""

        def read(worker):
            params = dict(worker.model_runner.model.named_parameters())
            return {n: params[n].detach().cpu() for n in names if n in params}

        return self.engine.llm.collective_rpc(read)


def _engine_group(prepared, pool, place, **options):
    from rlhf_core.distributed.role_group import RoleGroup

    return RoleGroup(InspectedEngine, place.world_size, pool, name="rollout", share=place.share, timeout_s=600,
                     bundles_per_rank=place.bundles_per_rank,
                     args=("vllm", prepared["base"], {"gpu_memory_utilization": 0.2, "enforce_eager": True,
                                                      "tensor_parallel_size": TP, **options}))


def _assert_holds(shards: list[dict], state: dict, dtype: torch.dtype) -> None:
    """The workers' shards put back together equal the actor's weights in the engine's dtype."""
    expect = {n: state[n].detach().to(dtype).cpu() for n in CHECKED}
    assert all(torch.equal(s["model.norm.weight"], expect["model.norm.weight"]) for s in shards)  # replicated
    o_proj = torch.cat([s["model.layers.0.self_attn.o_proj.weight"] for s in shards], dim=1)  # row-parallel
    assert torch.equal(o_proj, expect["model.layers.0.self_attn.o_proj.weight"])
    embed = torch.cat([s["model.embed_tokens.weight"] for s in shards], dim=0)  # vocabulary-parallel, padded
    vocab = expect["model.embed_tokens.weight"].shape[0]
    assert torch.equal(embed[:vocab], expect["model.embed_tokens.weight"])


def test_a_tp2_engine_in_its_own_bundles_generates(cluster, prepared):
    from rlhf_core.distributed.resources import create_pools, detect_devices, plan_layout
    from rlhf_core.rl.engines import RayEngines
    from rlhf_core.rollout.hf import TransformersEngine

    layout = plan_layout({"rollout": 1}, devices=detect_devices(), bundles_per_rank={"rollout": TP})
    pool = create_pools(layout)["rollout"]
    group = _engine_group(prepared, pool, layout.roles["rollout"])
    try:
        assert group.call_all("setup") == ["cuda"]
        (info,) = group.call_all("weight_sync_info")
        assert info["ranks"] == TP and len(set(info["uuids"])) == TP  # a worker on each GPU
        prompts = [[1 + i, 2 + 2 * i, 3 + 3 * i] for i in range(8)]
        got = RayEngines(group).generate_ids(prompts, 2, 0.0, 5, 0)
        hf = TransformersEngine.from_pretrained(prepared["base"], dtype=torch.float32)
        expected = hf.generate_ids(prompts, 1, 0.0, 5, seed=0)
        assert all(len(g) == 2 and g[0] == g[1] for g in got)
        same = sum(e[0].token_ids == g[0].token_ids for e, g in zip(expected, got, strict=True))
        assert same >= 0.75 * len(prompts), same  # bf16 and other kernels: near-ties may flip, rarely
    finally:
        group.shutdown()
        pool.remove()


def _sync_into_tp2(prepared, colocate: bool, sync_backend: str):
    from rlhf_core.distributed.resources import create_pools, detect_devices, plan_layout
    from rlhf_core.distributed.role_group import RoleGroup
    from rlhf_core.rl.engines import RayEngines

    actor_ranks = TP if colocate else 1
    layout = plan_layout({"actor": actor_ranks, "rollout": 1}, [["actor", "rollout"]] if colocate else [],
                         devices=detect_devices(), bundles_per_rank={"rollout": TP})
    pools = create_pools(layout)
    place = layout.roles
    group = _engine_group(prepared, pools[place["rollout"].pool], place["rollout"], enable_sleep=colocate)
    actor = RoleGroup(SteeringActor, actor_ranks, pools[place["actor"].pool], name="actor",
                      share=place["actor"].share, timeout_s=600, args=(prepared["base"],))
    try:
        assert group.call_all("setup") == ["cuda"]
        engines = RayEngines(group, enable_sleep=colocate, sync_backend=sync_backend)
        before = engines.generate_ids(PROMPT, 1, 0.0, 4, 0)[0][0]
        assert set(before.token_ids) != {7}
        if colocate:
            engines.sleep()
        engines.sync(actor)
        assert engines.weight_sync.backend.value == ("ipc" if colocate else "nccl")
        (info,) = group.call_all("weight_sync_info")
        (shards,) = group.call_all("worker_params", CHECKED)
        assert len(shards) == TP
        _assert_holds(shards, _steered_state(prepared["base"]), getattr(torch, info["dtype"]))
        after = engines.generate_ids(PROMPT, 1, 0.0, 4, 0)[0][0]
        assert set(after.token_ids) == {7}
        engines.sync(actor)  # the second sync reuses what the first set up
    finally:
        group.shutdown()
        actor.shutdown()
        for pool in pools.values():
            pool.remove()


@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="a tp=2 engine and the actor on a third GPU")
def test_nccl_broadcast_into_a_tp2_engine_gives_every_worker_its_shard(cluster, prepared):
    _sync_into_tp2(prepared, colocate=False, sync_backend="auto")


def test_cuda_ipc_into_a_sleeping_tp2_engine_on_the_actors_gpus(cluster, prepared):
    _sync_into_tp2(prepared, colocate=True, sync_backend="auto")


def test_grpo_with_a_tp2_engine_colocated_with_two_actor_ranks(cluster, rl_setting, tmp_path, capfd):
    from tests.gpu.conftest import assert_trained_with_synced_engines, grpo_on_sort

    manifest = grpo_on_sort(cluster, rl_setting, tmp_path / "out", "--actor_num_gpus_per_node", "2",
                            "--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "2",
                            "--vllm_gpu_memory_utilization", "0.2", "--enforce_eager", "--colocate_all_models",
                            "--vllm_enable_sleep")
    assert "rlhf: weight sync to 1 rollout engine(s): ipc" in capfd.readouterr().err
    assert_trained_with_synced_engines(manifest, rl_setting)
