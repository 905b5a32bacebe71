"""The weight sync on Ray (a 2-CPU local Ray), as the RL stage runs it: an actor rank that trains
and two transformers rollout engines as Ray actors (`EngineWorker`), synced by `RayEngines`.

- over a gloo broadcast (the code NCCL runs on GPUs), after each of two training steps, every
  engine holds exactly (`torch.equal`) the actor's weights; the group is opened once;
- `auto` on CPU transformers engines is the object store, with the same result;
- an engine stuck in an earlier call is named alone, and a dead one at once: `EngineSyncError`
  within the deadline, never a hang.
"""

import os
import time

import pytest
import torch

from rlhf_core.rl.engines import EngineWorker
from rlhf_core.rollout.weight_sync import WeightSender

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster():
    import ray

    from rlhf_core.distributed.local_ray import init_local

    context = init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield context
    ray.shutdown()


class TrainingActor(WeightSender):
    """A policy rank: the model, an optimizer step on demand, and its weights for the sync."""

    def __init__(self, path: str):
        from rlhf_core.models.loading import load_causal_lm

        self.model = load_causal_lm(path, dtype=torch.float32)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def train_step(self, seed: int) -> float:
        ids = torch.randint(3, 50, (4, 16), generator=torch.Generator().manual_seed(seed))
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss)

    def state(self) -> dict:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def _sync_state(self):
        return self.model.state_dict()

    def weights(self, checkpoint_format=False):  # the object store's path
        return self.state()


class Engine(EngineWorker):
    def state(self) -> dict:
        return {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}

    def hang(self) -> None:
        time.sleep(3600)

    def weight_sync_receive(self) -> int:
        if os.environ.get("TEST_RAISE_IN_SYNC") == os.environ["RANK"]:  # what a peer of a dead engine raises
            raise RuntimeError("gloo/transport/tcp/pair.cc: Read error: Connection reset by peer")
        if os.environ.get("TEST_DIE_IN_SYNC") == os.environ["RANK"]:
            time.sleep(float(os.environ.get("TEST_DIE_AFTER_S", "0")))
            os._exit(1)
        return super().weight_sync_receive()


def _groups(prepared, engines: int = 2, env: dict | None = None):
    import ray

    from rlhf_core.distributed.resources import cluster_devices, create_pools, plan_layout
    from rlhf_core.distributed.role_group import RoleGroup

    layout = plan_layout({"actor": 1, "rollout": engines}, [["actor", "rollout"]],
                         devices=cluster_devices(ray.cluster_resources()))
    pool = create_pools(layout, timeout_s=60)["actor+rollout"]
    share = layout.roles["actor"].share
    engine_group = RoleGroup(Engine, engines, pool, name="rollout", share=share, timeout_s=120, env=env,
                             args=("transformers", prepared["base"], {"dtype": torch.float32}))
    actor = RoleGroup(TrainingActor, 1, pool, name="actor", share=share, timeout_s=120,
                      args=(prepared["base"],))
    engine_group.call_all("setup")
    return pool, engine_group, actor


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("backend,expected", [("gloo", "gloo"), ("auto", "object_store")])
def test_every_engine_holds_the_actors_weights_after_each_step(cluster, prepared, backend, expected):
    from rlhf_core.rl.engines import RayEngines

    pool, engine_group, actor = _groups(prepared)
    try:
        engines = RayEngines(engine_group, timeout_s=60, sync_backend=backend)
        for step in range(2):
            actor.call_all("train_step", step)
            trained = actor.call_rank0("state")
            before = engine_group.call_all("state")
            assert not any(_same(s, trained) for s in before)  # the sync has work to do
            engines.sync(actor)
            if step == 0:
                weight_sync = engines.weight_sync
            assert engines.weight_sync is weight_sync and weight_sync.backend.value == expected  # set up once
            after = engine_group.call_all("state")
            assert all(_same(s, trained) for s in after), step
        got = engines.generate_ids([[5, 6, 7], [8, 9]], 1, 0.0, 4, 0)  # and still serve generation
        assert len(got) == 2 and all(len(g) == 1 for g in got)
    finally:
        engine_group.shutdown()
        actor.shutdown()
        pool.remove()


def test_a_stuck_engine_is_named_alone_and_a_dead_one_at_once(cluster, prepared):
    from rlhf_core.rl.engines import EngineSyncError, RayEngines

    pool, engine_group, actor = _groups(prepared, engines=3)
    try:
        engines = RayEngines(engine_group, timeout_s=8, sync_backend="gloo")
        engines.sync(actor)  # the group is open and works
        engine_group.actors[1].hang.remote()  # engine 1 hangs in another call: it never takes the next sync's
        t = time.monotonic()
        with pytest.raises(EngineSyncError, match=r"rollout engine 1: gloo weight broadcast failed: "
                                                  r"no answer to weight_sync_ready\(\) within 8 s") as error:
            engines.sync(actor)
        assert error.value.engines == [1]  # not the engines it would have left waiting in the broadcast
        assert time.monotonic() - t < 8 + 15
    finally:
        engine_group.shutdown()
        actor.shutdown()
        pool.remove()

    # Engine 2 dies in the broadcast a second after engine 0 raised (as gloo makes a dead engine's
    # peers do, often before Ray reports the death): the dead engine is named, not its peer.
    env = {"TEST_DIE_IN_SYNC": "2", "TEST_DIE_AFTER_S": "1", "TEST_RAISE_IN_SYNC": "0"}
    pool, engine_group, actor = _groups(prepared, engines=3, env=env)
    try:
        engines = RayEngines(engine_group, timeout_s=60, sync_backend="gloo")
        t = time.monotonic()
        with pytest.raises(EngineSyncError, match=r"rollout engine 2: gloo weight broadcast failed.*died(.|\n)*"
                                                  r"then engine 0 failed too: .*Connection reset by peer") as error:
            engines.sync(actor)  # the group opens, engine 2 dies in the broadcast
        assert error.value.engines == [2]
        assert time.monotonic() - t < 60  # at once, not at the deadline
    finally:
        engine_group.shutdown()
        actor.shutdown()
        pool.remove()
