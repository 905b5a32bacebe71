"""Tensor-parallel rollout engines on a 2-CPU local Ray, without vLLM or a GPU: what the RL stage
does around vLLM's Ray executor, and the weight sync into engines of several workers.

- A `RoleGroup` whose ranks span 2 bundles each (`bundles_per_rank`, as the RL stage places an
  engine of `--vllm.tensor_parallel_size 2`) colocated with an actor of 4 ranks: each rank's actor
  sits in the first of its bundles, takes no GPU, learns its bundles from its environment, and the
  worker actors it starts there (as vLLM's Ray executor does, from `VLLM_RAY_BUNDLE_INDICES`) land
  in the same placement group, in those bundles. The claims cover every bundle of every engine.
- The broadcast sync into 2 engines of 2 receiving workers each (threads standing in for vLLM's
  worker processes, each its own rank, as `WeightSyncExtension` joins): a group of 1 + 2 x 2
  ranks, and every worker of every engine ends with the actor's weights (`torch.equal`).
"""

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from rlhf_core.rl.engines import EngineWorker
from rlhf_core.rollout.vllm_engine import worker_sync_rank
from rlhf_core.rollout.weight_sync import SyncGroup, WeightSender, receive_broadcast

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster():
    import ray

    from rlhf_core.distributed.local_ray import init_local

    context = init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield context
    ray.shutdown()


class Worker:
    """Stands in for one of vLLM's tensor-parallel workers."""

    def where(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        return {"pg": ctx.get_placement_group_id(), "resources": ctx.get_assigned_resources()}


class TPDriver:
    """A rank spanning several bundles, doing what vLLM's Ray executor does in its engine."""

    def start_workers(self) -> dict:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from rlhf_core.rl.engines import engine_bundles

        told = engine_bundles(os.environ)
        pg = ray.util.get_current_placement_group()  # where vLLM's executor looks for it
        self.workers = [ray.remote(num_cpus=0)(Worker).options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=b)).remote() for b in told["bundle_indices"]]
        ctx = ray.get_runtime_context()
        return {"told": told, "pg": pg.id.hex(), "own_pg": ctx.get_placement_group_id(),
                "own_resources": ctx.get_assigned_resources(), "workers": ray.get([w.where.remote() for w in self.workers])}


def test_ranks_spanning_bundles_start_their_workers_there(cluster):
    import ray

    from rlhf_core.distributed.resources import PlacementError, cluster_devices, create_pools, plan_layout
    from rlhf_core.distributed.role_group import RoleGroup

    layout = plan_layout({"actor": 4, "rollout": 2}, [["actor", "rollout"]],
                         devices=cluster_devices(ray.cluster_resources()), bundles_per_rank={"rollout": 2})
    pool = create_pools(layout, timeout_s=60)["actor+rollout"]
    place = layout.roles["rollout"]
    engines = RoleGroup(TPDriver, 2, pool, name="rollout", share=place.share, timeout_s=120,
                        bundles_per_rank=place.bundles_per_rank)
    try:
        assert engines.rank_bundles == [[0, 1], [2, 3]]  # one node: consecutive bundles
        with pytest.raises(PlacementError, match="bundle 0: role 'critic' asks for 0.6"):
            pool.claim("critic", 0.6, 0, 1)  # the engines took their share of every bundle they span
        pool.claim("actor", layout.roles["actor"].share, 0, 4)
        reports = engines.call_all("start_workers")
        for rank, report in enumerate(reports):
            assert report["told"]["bundle_indices"] == [2 * rank, 2 * rank + 1]
            assert report["pg"] == report["own_pg"] == pool.pg.id.hex()
            assert "GPU" not in report["own_resources"]  # the engine's own actor holds no GPU
            assert report["own_resources"]["CPU"] == pytest.approx(place.num_cpus)
            assert [w["pg"] for w in report["workers"]] == [pool.pg.id.hex()] * 2
    finally:
        engines.shutdown()
        pool.remove()


class TrainingActor(WeightSender):
    def __init__(self, path: str):
        from rlhf_core.models.loading import load_causal_lm

        self.model = load_causal_lm(path, dtype=torch.float32)

    def train_step(self) -> None:
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.01)

    def state(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _sync_state(self):
        return self.model.state_dict()


class TPEngine(EngineWorker):
    """A transformers engine that receives as a vLLM engine of TP workers does: each worker joins
    the sync group as a rank of its own and receives every tensor (vLLM's loader then keeps its
    shard; here each keeps all, so the test can compare)."""

    TP = 2

    def weight_sync_info(self) -> dict:
        return {**super().weight_sync_info(), "ranks": self.TP}

    def weight_sync_open(self, backend, host, port, rank_offset, world_size, timeout_s) -> bool:
        with ThreadPoolExecutor(self.TP) as threads:  # each blocks until the whole group joined
            self.groups = list(threads.map(lambda w: SyncGroup(backend, host, port, worker_sync_rank(rank_offset, w),
                                                               world_size, timeout_s), range(self.TP)))
        self.ranks = [g.rank for g in self.groups]
        return True

    def weight_sync_receive(self) -> int:
        self.received = [{} for _ in range(self.TP)]

        def receive(w):
            return receive_broadcast(self.groups[w], lambda items: self.received[w].update(
                (name, t.clone()) for name, t in items))

        with ThreadPoolExecutor(self.TP) as threads:
            counts = list(threads.map(receive, range(self.TP)))
        self.engine.update_weights(self.received[0])
        return counts[0]

    def weight_sync_close(self) -> None:
        for group in self.groups:
            group.close()

    def workers(self) -> tuple[list[int], list[dict]]:
        return self.ranks, self.received


def test_every_tensor_parallel_worker_receives_the_actors_weights(cluster, prepared):
    import ray

    from rlhf_core.distributed.resources import cluster_devices, create_pools, plan_layout
    from rlhf_core.distributed.role_group import RoleGroup
    from rlhf_core.rl.engines import RayEngines

    layout = plan_layout({"actor": 1, "rollout": 2}, [["actor", "rollout"]],
                         devices=cluster_devices(ray.cluster_resources()))
    pool = create_pools(layout, timeout_s=60)["actor+rollout"]
    share = layout.roles["actor"].share
    engine_group = RoleGroup(TPEngine, 2, pool, name="rollout", share=share, timeout_s=120,
                             args=("transformers", prepared["base"], {"dtype": torch.float32}))
    actor = RoleGroup(TrainingActor, 1, pool, name="actor", share=share, timeout_s=120,
                      args=(prepared["base"],))
    try:
        engine_group.call_all("setup")
        engines = RayEngines(engine_group, timeout_s=60, sync_backend="gloo")
        actor.call_all("train_step")
        trained = actor.call_rank0("state")
        engines.sync(actor)
        assert engines.weight_sync.ranks_per_engine == [2, 2]
        reports = engine_group.call_all("workers")
        assert [ranks for ranks, _ in reports] == [[1, 2], [3, 4]]  # a group of 5: the actor and 4 workers
        for _, received in reports:
            for state in received:
                assert state.keys() == trained.keys() and all(torch.equal(state[k], trained[k]) for k in trained)
    finally:
        engine_group.shutdown()
        actor.shutdown()
        pool.remove()
