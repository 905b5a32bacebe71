"""vLLM tensor parallelism for the RL stage's rollout engines, the parts that are pure logic (CPU):

- placement: an engine of `--vllm.tensor_parallel_size` tp is one rank of tp bundles (GPUs), in a
  pool of its own or colocated with the trainers (`--train.colocate_all`, fractional shares);
- which bundles each engine's workers take, one node per engine where the nodes allow it;
- what a tensor-parallel engine tells vLLM (executor backend, bundle indices, GPU share);
- the weight-sync group: every tensor-parallel worker is a rank of its own, after the actor;
- the config: both flag spellings, and what is refused (tp without engines, tp across nodes when
  colocated); the old refusal of tp > 1 is gone.

What runs on GPUs (vLLM's Ray executor, the sync into a tp=2 engine) is in tests/gpu/test_vllm_tensor_parallel.py;
the placement and the sync group on a CPU Ray are in tests/integration/test_tp_engines_ray.py.
"""

import pytest

from rlhf_core.distributed.resources import (
    ClusterDevices,
    PlacementError,
    colocation_groups,
    groups_across_nodes,
    plan_layout,
    rank_bundle_groups,
)
from rlhf_core.infra.settings import ConfigError
from rlhf_core.rl.engines import EngineSyncError, check_engine_workers, engine_bundles
from rlhf_core.rl_config import build_ppo_config
from rlhf_core.rollout.vllm_engine import VISIBLE_DEVICES_VARS, tensor_parallel_setup, worker_sync_rank
from rlhf_core.rollout.weight_sync import sync_group_ranks

TASK = {"actor.model_name_or_path": "m", "reward.task": "addition", "data.prompt_dataset": "json@d",
        "ckpt.output_dir": "o", "rollout.batch_size": 8, "train.batch_size": 8}


def gpus(n, cpus=64):
    return ClusterDevices(use_gpu=True, gpus=n, cpus=cpus)


def bundle_use(layout):
    """(pool, bundle) -> the share of it the roles take, each role on its `bundles` bundles."""
    used = {}
    for p in layout.roles.values():
        for i in range(p.bundles):
            used[(p.pool, i)] = used.get((p.pool, i), 0) + p.share
    return used


# -- placement ------------------------------------------------------------------------------

def test_separate_tp_engines_take_num_engines_x_tp_whole_gpus():
    layout = plan_layout({"actor": 4, "rollout": 2}, devices=gpus(8), bundles_per_rank={"rollout": 2})
    rollout = layout.roles["rollout"]
    assert (rollout.world_size, rollout.bundles_per_rank, rollout.bundles) == (2, 2, 4)
    assert layout.pools["rollout"].bundles == 4 and layout.pools["rollout"].bundle() == {"CPU": 1.0, "GPU": 1.0}
    assert rollout.share == 1.0 and rollout.num_gpus == 1.0
    assert layout.roles["actor"].bundles_per_rank == 1 and layout.pools["actor"].bundles == 4
    with pytest.raises(PlacementError, match=r"need 10 GPUs \(actor: 4, rollout: 6\).*has 8"):
        plan_layout({"actor": 4, "rollout": 3}, devices=gpus(8), bundles_per_rank={"rollout": 2})


def test_colocated_tp_engines_share_the_actors_gpus_in_fractions():
    roles = {"actor": 4, "ref": 4, "rollout": 2}
    layout = plan_layout(roles, colocation_groups(roles, colocate_all_models=True), devices=gpus(4),
                         bundles_per_rank={"rollout": 2})
    (pool,) = layout.pools.values()
    assert pool.bundles == 4  # the actor's 4 GPUs hold the 2 engines of 2 GPUs too
    rollout = layout.roles["rollout"]
    assert rollout.bundles == 4 and rollout.share == pytest.approx(1 / 3, abs=1e-4)
    assert rollout.num_gpus == pytest.approx(0.3333)  # what each tensor-parallel worker takes of its GPU
    assert set(bundle_use(layout)) == {(pool.name, i) for i in range(4)}
    assert all(s <= 1 for s in bundle_use(layout).values())


def test_the_rl_layout_follows_the_flags():
    from rlhf_core.rl.ray_roles import rl_layout

    cfg = build_ppo_config({**TASK, "actor.num_gpus_per_node": 4, "ref.num_gpus_per_node": 4,
                            "vllm.num_engines": 2, "vllm.tensor_parallel_size": 2, "train.colocate_all": True,
                            "train.batch_size": 8}, {})
    layout = rl_layout(cfg, [], gpus(4))
    (pool,) = layout.pools.values()  # actor, ref, critic and the engines on the actor's 4 GPUs
    assert layout.roles["rollout"].bundles_per_rank == 2 and pool.bundles == 4 and pool.name.endswith("+rollout")
    flat = build_ppo_config({**TASK, "actor_num_gpus_per_node": 4, "vllm_num_engines": 2,
                             "vllm_tensor_parallel_size": 2, "train.batch_size": 8}, {})
    separate = rl_layout(flat, [], gpus(10))  # actor 4, ref 1, critic 1, and 2 engines x 2 GPUs
    assert separate.pools["rollout"].bundles == 4 and separate.roles["rollout"].world_size == 2
    with pytest.raises(PlacementError, match=r"need 10 GPUs \(.*rollout: 4\)"):
        rl_layout(flat, [], gpus(9))
    no_vllm = rl_layout(build_ppo_config(TASK, {}), [], ClusterDevices(False, 0, 2))
    assert no_vllm.roles["rollout"].bundles_per_rank == 1  # one transformers engine


def test_bad_bundles_per_rank_are_refused():
    with pytest.raises(PlacementError, match="unknown role 'rollot'"):
        plan_layout({"rollout": 1}, devices=gpus(2), bundles_per_rank={"rollot": 2})
    with pytest.raises(PlacementError, match="bundles per rank must be a positive integer"):
        plan_layout({"rollout": 1}, devices=gpus(2), bundles_per_rank={"rollout": 0})


# -- each engine's bundles -------------------------------------------------------------------

def test_one_node_engines_take_consecutive_bundles():
    nodes = ["a"] * 8
    assert rank_bundle_groups(nodes, 0, 4, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_bundle_groups(nodes, 2, 2, 3) == [[2, 3, 4], [5, 6, 7]]
    assert rank_bundle_groups(nodes, 3, 2, 1) == [[3], [4]]


def test_engines_stay_on_one_node_however_ray_numbers_the_bundles():
    nodes = ["a", "b", "a", "b", "a", "b", "a", "b"]  # Ray may interleave a PACK group's nodes
    groups = rank_bundle_groups(nodes, 0, 4, 2)
    assert groups == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups_across_nodes(groups, nodes) == []
    assert sorted(b for g in groups for b in g) == list(range(8))  # every bundle once
    # span 1 keeps rank i on bundle i whatever the nodes (colocated roles line up by rank)
    assert rank_bundle_groups(nodes, 0, 3, 1) == [[0], [1], [2]]


def test_what_does_not_fit_on_one_node_is_grouped_last_and_reported():
    nodes = ["a", "a", "a", "b", "b", "b"]  # 3 GPUs per node, tp 2: one engine must span the nodes
    groups = rank_bundle_groups(nodes, 0, 3, 2)
    assert groups == [[0, 1], [3, 4], [2, 5]]
    assert groups_across_nodes(groups, nodes) == [2]
    with pytest.raises(PlacementError, match="outside a pool of 6"):
        rank_bundle_groups(nodes, 2, 3, 2)


def test_a_rank_learns_its_bundles_from_its_environment():
    assert engine_bundles({}) == {}
    assert engine_bundles({"RLHF_RANK_BUNDLES": "4,5", "RLHF_RANK_BUNDLE_GPUS": "0.3333"}) == {
        "bundle_indices": [4, 5], "gpus_per_worker": 0.3333}


def test_a_tp_engine_without_its_bundles_is_refused_before_vllm_starts(monkeypatch):
    from rlhf_core.rl.engines import EngineWorker

    monkeypatch.delenv("RLHF_RANK_BUNDLES", raising=False)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs as many placement bundles"):
        EngineWorker("vllm", "m", {"tensor_parallel_size": 2}).setup()


# -- what vLLM is told -------------------------------------------------------------------------

def test_one_gpu_engines_keep_vllms_own_executor():
    assert tensor_parallel_setup(1) == (None, {}, ())
    assert tensor_parallel_setup(1, [3]) == (None, {}, ())
    assert tensor_parallel_setup(2) == (None, {}, ())  # outside a placement group: vLLM's choice
    assert tensor_parallel_setup(2, None, None, "mp") == ("mp", {}, ())


def test_tp_engines_in_bundles_run_on_vllms_ray_executor():
    backend, env, unset = tensor_parallel_setup(2, [4, 5], 0.3333)
    assert backend == "ray"
    assert env == {"VLLM_RAY_BUNDLE_INDICES": "4,5", "VLLM_RAY_PER_WORKER_GPUS": "0.3333"}
    assert "CUDA_VISIBLE_DEVICES" in unset and unset == VISIBLE_DEVICES_VARS
    assert tensor_parallel_setup(4, [0, 2, 4, 6])[1]["VLLM_RAY_PER_WORKER_GPUS"] == "1"  # whole GPUs


@pytest.mark.parametrize("args, message", [
    ((2, [4]), "needs as many distinct bundles"),
    ((2, [4, 4]), "needs as many distinct bundles"),
    ((2, [0, 1], 1.5), r"gpus_per_worker must be in \(0, 1\]"),
    ((2, [0, 1], None, "mp"), "need 'ray'"),
    ((1, [0, 1]), "one worker was given bundles"),
    ((0,), "must be positive"),
])
def test_inconsistent_tp_settings_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        tensor_parallel_setup(*args)


# -- the weight-sync group ---------------------------------------------------------------------

def test_every_tp_worker_is_a_rank_of_the_sync_group():
    assert sync_group_ranks([1]) == (2, [1])
    assert sync_group_ranks([2, 2]) == (5, [1, 3])
    assert sync_group_ranks([1, 4, 2]) == (8, [1, 2, 6])
    for ranks_per_engine in ([2, 2], [4, 4, 4], [1, 2, 1]):
        world, offsets = sync_group_ranks(ranks_per_engine)
        ranks = [worker_sync_rank(offsets[e], w) for e, n in enumerate(ranks_per_engine) for w in range(n)]
        assert sorted(ranks) == list(range(1, world))  # each worker once; rank 0 is the actor
    with pytest.raises(ValueError, match="at least one receiving worker"):
        sync_group_ranks([2, 0])
    with pytest.raises(ValueError, match="rank 0 is the actor"):
        worker_sync_rank(0, 0)


def test_engines_must_report_one_gpu_per_worker():
    ok = [{"vllm": True, "cuda": True, "ranks": 2, "dtype": "bfloat16", "uuids": ["g0", "g1"]},
          {"vllm": False, "cuda": False, "ranks": 1, "dtype": "float32", "uuids": []}]
    check_engine_workers(ok)
    missing = [ok[0], {**ok[0], "uuids": ["g2"]}]
    with pytest.raises(EngineSyncError, match=r"rollout engine 1: 2 tensor-parallel workers report the GPUs \['g2'\]"):
        check_engine_workers(missing)
    with pytest.raises(EngineSyncError, match="rollout engine 0"):
        check_engine_workers([{**ok[0], "uuids": ["g0", "g0"]}])


# -- the config -------------------------------------------------------------------------------

def test_tp_engines_are_built_not_refused():
    from rlhf_core.trainers.ppo import engine_options

    for values in ({"vllm.num_engines": 2, "vllm.tensor_parallel_size": 2},
                   {"vllm_num_engines": 2, "vllm_tensor_parallel_size": 2}):
        cfg = build_ppo_config({**TASK, **values}, {})
        backend, options = engine_options(cfg)
        assert backend == "vllm" and options["tensor_parallel_size"] == 2


@pytest.mark.parametrize("values, message", [
    ({"vllm.tensor_parallel_size": 2}, "--vllm.tensor_parallel_size 2 needs --vllm.num_engines > 0"),
    ({"vllm_tensor_parallel_size": 2, "train.colocate_all": True, "vllm.num_engines": 1},
     r"actor ranks \(1\) must equal --vllm.num_engines x --vllm.tensor_parallel_size \(1 x 2\)"),
    ({"vllm.tensor_parallel_size": 2, "train.colocate_all": True, "vllm.num_engines": 3, "actor.num_nodes": 2,
      "actor.num_gpus_per_node": 3, "ref.num_nodes": 2, "ref.num_gpus_per_node": 3, "rollout.batch_size": 6,
      "train.batch_size": 6},
     r"--actor.num_gpus_per_node \(3\) must be a multiple of --vllm.tensor_parallel_size \(2\)"),
    ({"vllm.tensor_parallel_size": 0, "vllm.num_engines": 1}, "--vllm.tensor_parallel_size"),
])
def test_impossible_tp_configs_name_the_flag(values, message):
    with pytest.raises(ConfigError, match=message):
        build_ppo_config({**TASK, **values}, {})


def test_colocated_tp_across_nodes_of_whole_engines_is_accepted():
    cfg = build_ppo_config({**TASK, "vllm.tensor_parallel_size": 2, "train.colocate_all": True,
                            "vllm.num_engines": 4, "actor.num_nodes": 2, "actor.num_gpus_per_node": 4,
                            "ref.num_nodes": 2, "ref.num_gpus_per_node": 4}, {})
    assert cfg.vllm.tensor_parallel_size == 2 and cfg.actor.world_size == 8
