"""Devices from cluster resources, pools and shares for each colocation mode, batch shards."""

import pytest

from rlhf_core.distributed.resources import (
    ClusterDevices,
    PlacementError,
    cluster_devices,
    colocation_groups,
    plan_layout,
    ranks_in_driver,
)

RL_ROLES = {"actor": 2, "ref": 2, "critic": 2, "reward": 2}


def gpu_cluster(gpus=8, cpus=32):
    return ClusterDevices(use_gpu=True, gpus=gpus, cpus=cpus)


def cpu_cluster(cpus=2):
    return ClusterDevices(use_gpu=False, gpus=0, cpus=cpus)


def test_devices_come_from_the_cluster_not_the_driver():
    head_without_gpu_in_gpu_cluster = {"CPU": 16.0, "GPU": 4.0, "node:10.0.0.1": 1.0, "memory": 1e10}
    assert cluster_devices(head_without_gpu_in_gpu_cluster) == ClusterDevices(True, 4.0, 16.0)
    assert cluster_devices({"CPU": 2.0, "memory": 1e9}) == ClusterDevices(False, 0.0, 2.0)
    assert cluster_devices({"CPU": 2.0, "GPU": 0.0}).device == "cpu"
    # GPUs busy right now still make it a GPU cluster; CPUs count as available
    busy = cluster_devices({"CPU": 16.0, "GPU": 2.0}, available={"CPU": 6.0})
    assert busy.use_gpu and busy.device == "cuda" and busy.cpus == 6.0
    assert not cluster_devices({"CPU": 4.0, "GPU": 0.5}).use_gpu  # no whole GPU for a rank


def test_a_driver_holds_one_rank_per_role_only_on_the_one_cpu_node_it_runs_on():
    assert ranks_in_driver(1, alive_nodes=1, devices=cpu_cluster(), driver_on_the_node=True)
    assert not ranks_in_driver(2, alive_nodes=1, devices=cpu_cluster(), driver_on_the_node=True)  # a worker group
    assert not ranks_in_driver(1, alive_nodes=2, devices=cpu_cluster(), driver_on_the_node=True)  # ranks go elsewhere
    assert not ranks_in_driver(1, alive_nodes=1, devices=gpu_cluster(1), driver_on_the_node=True)  # a rank takes a GPU
    assert not ranks_in_driver(1, alive_nodes=1, devices=cpu_cluster(0), driver_on_the_node=True)  # a head of 0 CPUs
    assert not ranks_in_driver(1, alive_nodes=1, devices=cpu_cluster(), driver_on_the_node=False)  # Ray Client


def test_ranks_on_ray_takes_0_or_1_and_1_or_unset_never_connects(monkeypatch):
    from rlhf_core.distributed import cluster
    from rlhf_core.infra.settings import ConfigError

    monkeypatch.setattr(cluster, "ensure_ray", lambda: pytest.fail("connected to ask the cluster's shape"))
    monkeypatch.delenv("RLHF_RANKS_ON_RAY", raising=False)
    assert not cluster.ranks_stay_in_driver(1)  # a cluster of RAY_ADDRESS: actors, unless told
    monkeypatch.setenv("RLHF_RANKS_ON_RAY", "1")
    assert not cluster.ranks_stay_in_driver(1)
    monkeypatch.setenv("RLHF_RANKS_ON_RAY", "0")
    assert not cluster.ranks_stay_in_driver(2) and not cluster.ranks_stay_in_driver(1, pinned=True)
    monkeypatch.setenv("RLHF_RANKS_ON_RAY", "true")
    with pytest.raises(ConfigError, match="RLHF_RANKS_ON_RAY='true': give 0"):
        cluster.ranks_stay_in_driver(1)


def test_openrlhf_colocation_flags_as_groups():
    roles = ["actor", "ref", "critic", "reward", "rollout"]
    assert colocation_groups(roles, colocate_all_models=True) == [roles]
    assert colocation_groups(roles, colocate_actor_ref=True) == [["actor", "ref"]]
    assert colocation_groups(roles, colocate_actor_ref=True, colocate_critic_reward=True) == [
        ["actor", "ref"], ["critic", "reward"]]
    assert colocation_groups(["actor", "ref", "reward"], colocate_critic_reward=True) == []  # no critic (GRPO)
    assert colocation_groups(roles) == []


def shares_per_bundle(layout):
    used = {}
    for p in layout.roles.values():
        for i in range(p.world_size):
            used[(p.pool, i)] = used.get((p.pool, i), 0) + p.share
    return used


def test_colocate_all_models_on_gpu_is_one_pool_split_in_fractions():
    layout = plan_layout({**RL_ROLES, "rollout": 2}, colocation_groups([*RL_ROLES, "rollout"], colocate_all_models=True),
                         devices=gpu_cluster())
    (pool,) = layout.pools.values()
    assert pool.name == "actor+ref+critic+reward+rollout" and pool.bundles == 2
    assert pool.bundle() == {"CPU": 1.0, "GPU": 1.0}
    for p in layout.roles.values():
        assert p.pool == pool.name and p.share == pytest.approx(0.2) and p.num_gpus == pytest.approx(0.2)
    assert all(s <= 1 for s in shares_per_bundle(layout).values())


def test_colocate_actor_ref_and_critic_reward_on_gpu():
    layout = plan_layout(RL_ROLES, colocation_groups(RL_ROLES, colocate_actor_ref=True, colocate_critic_reward=True),
                         devices=gpu_cluster(gpus=4))
    assert {n: (p.bundles, p.gpus) for n, p in layout.pools.items()} == {"actor+ref": (2, 1.0), "critic+reward": (2, 1.0)}
    assert layout.roles["ref"].pool == "actor+ref" and layout.roles["reward"].pool == "critic+reward"
    assert {p.share for p in layout.roles.values()} == {0.5}
    assert {p.num_gpus for p in layout.roles.values()} == {0.5}


def test_separate_roles_on_gpu_take_whole_gpus_and_must_fit():
    layout = plan_layout(RL_ROLES, devices=gpu_cluster(gpus=8))
    assert len(layout.pools) == 4 and all(p.share == 1.0 and p.num_gpus == 1.0 for p in layout.roles.values())
    with pytest.raises(PlacementError, match="need 8 GPUs.*has 4"):
        plan_layout(RL_ROLES, devices=gpu_cluster(gpus=4))


def test_colocated_roles_of_different_sizes_share_the_largest_pool():
    layout = plan_layout({"actor": 4, "ref": 2}, [["actor", "ref"]], devices=gpu_cluster())
    assert layout.pools["actor+ref"].bundles == 4 and layout.roles["ref"].world_size == 2


def test_on_cpu_the_whole_job_fits_in_two_cores():
    pairs = plan_layout(RL_ROLES, colocation_groups(RL_ROLES, colocate_actor_ref=True, colocate_critic_reward=True),
                        devices=cpu_cluster(2))
    assert {p.cpus for p in pairs.pools.values()} == {0.5} and all(p.gpus == 0 for p in pairs.pools.values())
    assert {p.num_cpus for p in pairs.roles.values()} == {0.25}
    separate = plan_layout(RL_ROLES, devices=cpu_cluster(2))
    assert {p.cpus for p in separate.pools.values()} == {0.25}
    everything = plan_layout({**RL_ROLES, "rollout": 2}, [[*RL_ROLES, "rollout"]], devices=cpu_cluster(2))
    assert everything.roles["actor"].num_cpus == pytest.approx(0.2)
    for layout in (pairs, separate, everything):
        assert sum(p.bundles * p.cpus for p in layout.pools.values()) <= 2
        assert sum(r.world_size * r.num_cpus for r in layout.roles.values()) <= 2
        assert all(r.num_gpus == 0 for r in layout.roles.values())


def test_on_cpu_whole_cores_when_there_are_enough():
    assert plan_layout({"train": 2}, devices=cpu_cluster(2)).roles["train"].num_cpus == 1.0
    assert plan_layout({"train": 3}, devices=cpu_cluster(8)).pools["train"].cpus == 2.0
    assert plan_layout({"train": 1}, devices=cpu_cluster(2)).roles["train"].num_cpus == 2.0


def test_three_way_shares_never_exceed_a_bundle():
    layout = plan_layout({"a": 1, "b": 1, "c": 1}, [["a", "b", "c"]], devices=cpu_cluster(1))
    assert sum(p.share for p in layout.roles.values()) <= 1
    assert sum(p.num_cpus for p in layout.roles.values()) <= 1
    assert layout.roles["a"].num_cpus == pytest.approx(0.3333)


def test_bad_layouts_are_refused():
    with pytest.raises(PlacementError, match="unknown role 'critc'"):
        plan_layout(RL_ROLES, [["critc", "reward"]], devices=gpu_cluster())
    with pytest.raises(PlacementError, match="two colocation groups"):
        plan_layout(RL_ROLES, [["actor", "ref"], ["ref", "reward"]], devices=gpu_cluster())
    with pytest.raises(PlacementError, match="positive integer"):
        plan_layout({"actor": 0}, devices=gpu_cluster())
    with pytest.raises(PlacementError, match="cannot be split"):
        plan_layout({"actor": 1}, devices=cpu_cluster(0))


def test_detect_devices_waits_for_the_cpus_a_finished_job_is_handing_back(monkeypatch):
    """Right after another job, Ray reports its CPUs busy for a moment (0.0002 of 2 were seen free):
    the driver waits, bounded, until at least one is free instead of failing to place its roles."""
    import ray

    from rlhf_core.distributed import resources

    answers = iter([{"CPU": 0.0002}] * 3 + [{"CPU": 2.0}])
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray, "available_resources", lambda: next(answers))
    assert resources.detect_devices(release_wait_s=10).cpus == 2.0

    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 0.5})  # really busy: not forever
    import time

    started = time.monotonic()
    assert resources.detect_devices(release_wait_s=0.6).cpus == 0.5
    assert time.monotonic() - started < 3
