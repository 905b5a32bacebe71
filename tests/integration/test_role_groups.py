"""Role worker groups on a 2-CPU local Ray: dispatch, shards, colocation in fractions of a bundle,
one process group per role, and errors that name the role and rank instead of hanging."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.distributed.resources import PlacementError, create_pools, detect_devices, plan_layout
from rlhf_core.distributed.role_group import (
    RoleError,
    RoleGroup,
    RoleTimeoutError,
    gather_all,
    start_together,
)

pytestmark = pytest.mark.integration


class ToyWorker:
    """Holds a tensor; knows its rank from the environment the group set."""

    def __init__(self, value: float = 0.0, meet: tuple[str, int] | None = None, delay: float = 0.0):
        time.sleep(delay)  # a slow start: a model to load
        self.value = torch.tensor([value])
        self.rank = int(os.environ["RANK"])
        if meet is not None:  # (folder, n): wait in __init__ until n ranks are in theirs
            folder, n = meet
            (Path(folder) / f"{os.environ['TOY_FLAG']}-{self.rank}").touch()
            deadline = time.monotonic() + 60
            while len(list(Path(folder).iterdir())) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{len(list(Path(folder).iterdir()))} of {n} ranks got as far as __init__")
                time.sleep(0.05)

    def whoami(self) -> dict:
        import torch.distributed as dist

        return {"rank": self.rank, "world": int(os.environ["WORLD_SIZE"]), "local_rank": os.environ["LOCAL_RANK"],
                "master": (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])),
                "flag": os.environ.get("TOY_FLAG"), "threads": torch.get_num_threads(),
                "dist": (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else None}

    def all_reduce(self) -> float:
        import torch.distributed as dist

        t = self.value * (self.rank + 1)
        dist.all_reduce(t)
        return t.item()

    def scale(self, items: list, factor: float = 1.0) -> list:
        return [(x * factor, self.rank) for x in items]

    def sleep(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def fail_on(self, rank: int) -> int:
        if self.rank == rank:
            raise ValueError(f"rank {rank} refuses")
        return self.rank

    def fail_in_turn(self, follow_on: bool) -> int:
        """Rank 0 fails at once (a FollowOnError, or a plain error); rank 1, the root cause, a second later."""
        from rlhf_core.distributed.failures import FollowOnError

        if self.rank == 0:
            raise (FollowOnError if follow_on else RuntimeError)("my checkpoint folder is gone")
        time.sleep(1.0)
        raise ValueError("the disk is full")


@pytest.fixture(scope="module")
def cluster():
    import ray

    from rlhf_core.distributed.local_ray import init_local

    init_local(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield detect_devices()
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def pools(cluster):
    """actor+ref colocated (2 ranks each) and a critic pool: 4 bundles of 0.5 CPU on 2 CPUs."""
    layout = plan_layout({"actor": 2, "ref": 2, "critic": 2}, [["actor", "ref"]], devices=cluster)
    made = create_pools(layout, timeout_s=60)
    yield layout, made
    for pool in made.values():
        pool.remove()


@pytest.fixture(scope="module")
def roles(pools, tmp_path_factory):
    """Two roles of two ranks, started together (`start_together`): no rank's `__init__` returns
    before all four ranks are in theirs, which only ranks started side by side can do."""
    layout, made = pools
    meet = (str(tmp_path_factory.mktemp("meet")), 4)
    groups = {}
    try:
        for role, value in (("actor", 1.0), ("ref", 10.0)):
            p = layout.roles[role]
            groups[role] = RoleGroup(ToyWorker, p.world_size, made[p.pool], name=role, share=p.share,
                                     kwargs={"value": value, "meet": meet}, env={"TOY_FLAG": role}, timeout_s=90,
                                     wait=False)
        start_together(list(groups.values()))
        yield groups
    finally:
        for g in groups.values():
            g.shutdown()


def test_a_batch_is_sharded_over_the_ranks_and_gathered_in_order(roles):
    """The controller's one sharding rule (`RoleGroup.call_sharded`): equal contiguous shards, the last
    padded with the last item (every rank runs as many forwards), results in order, padding dropped."""
    ref = roles["ref"]
    assert ref.call_sharded("scale", [1.0, 2.0, 3.0, 4.0, 5.0], factor=2.0) == \
        [(2.0, 0), (4.0, 0), (6.0, 0), (8.0, 1), (10.0, 1)]
    each = ref.call_each_async("scale", [(([1.0],), {"factor": 3.0}), (([1.0, 2.0],), {})])
    assert each.per_rank() == [[(3.0, 0)], [(1.0, 1), (2.0, 1)]]  # each rank its own arguments


def test_devices_come_from_the_cluster(cluster):
    assert not cluster.use_gpu and cluster.device == "cpu" and cluster.cpus == 2


def test_two_colocated_roles_fit_in_fractions_of_two_cpus(pools, roles):
    import ray

    layout, _ = pools
    assert {n: p.bundle() for n, p in layout.pools.items()} == {"actor+ref": {"CPU": 0.5}, "critic": {"CPU": 0.5}}
    assert roles["actor"].num_cpus == roles["ref"].num_cpus == 0.25
    assert ray.available_resources().get("CPU", 0) == 0  # the pools hold both cores; the roles run inside them
    for role, group in roles.items():
        info = group.call_all("whoami")
        assert [i["rank"] for i in info] == [0, 1] and {i["world"] for i in info} == {2}
        assert {i["flag"] for i in info} == {role} and {i["local_rank"] for i in info} == {"0"}
        assert {i["threads"] for i in info} == {1}
        assert {i["master"] for i in info} == {(group.master_addr, group.master_port)}


def test_a_pool_refuses_more_than_a_whole_bundle(pools, roles):
    _, made = pools
    with pytest.raises(PlacementError, match="bundle 0: role 'extra' asks for 0.5 of it, 1 is already taken"):
        RoleGroup(ToyWorker, 2, made["actor+ref"], name="extra", share=0.5)


def test_call_all_in_rank_order_and_call_rank0(roles):
    assert roles["actor"].call_all("fail_on", -1) == [0, 1]
    assert roles["actor"].call_rank0("whoami")["rank"] == 0


def test_each_role_has_its_own_process_group(roles):
    assert roles["actor"].master_port != roles["ref"].master_port
    for group in roles.values():
        assert group.init_process_group() == [(0, 2), (1, 2)]
    # value * (rank + 1) summed over the role's two ranks: 1*1 + 1*2 and 10*1 + 10*2
    assert roles["actor"].call_all("all_reduce") == [3.0, 3.0]
    assert roles["ref"].call_all("all_reduce") == [30.0, 30.0]
    assert [i["dist"] for i in roles["ref"].call_all("whoami")] == [(0, 2), (1, 2)]  # 2 ranks, not 4


def test_async_calls_on_two_roles_overlap(roles):
    start = time.monotonic()
    a, r = roles["actor"].call_all_async("sleep", 1.5), roles["ref"].call_rank0_async("sleep", 1.5)
    assert gather_all([a, r]) == [[0, 1], 0]
    assert time.monotonic() - start < 2.8


def test_a_raising_rank_is_named_with_its_exception(roles):
    with pytest.raises(RoleError, match="role 'actor' rank 1: fail_on\\(\\) raised ValueError: rank 1 refuses") as e:
        roles["actor"].call_all("fail_on", 1)
    assert isinstance(e.value.cause, ValueError) and e.value.rank == 1
    with pytest.raises(AttributeError, match="role 'actor'.*no method 'nope'"):
        roles["actor"].call_all("nope")


def test_a_follow_on_error_is_reported_as_the_failure_that_caused_it(roles):
    """Rank 0's FollowOnError comes first; the wait reports rank 1's error, the root cause (its
    exception kept as the cause, so a bad-input cause still exits 2). The control: a plain error
    from rank 0 is reported as it is."""
    with pytest.raises(RoleError, match=r"role 'actor' rank 1: fail_in_turn\(\) raised ValueError: the disk is full\n"
                                        r"\(then role 'actor' rank 0 failed too: .*FollowOnError") as e:
        roles["actor"].call_all("fail_in_turn", True)
    assert isinstance(e.value.cause, ValueError)
    with pytest.raises(RoleError, match=r"role 'actor' rank 0: fail_in_turn\(\) raised RuntimeError"):
        roles["actor"].call_all("fail_in_turn", False)


@pytest.fixture
def critic(pools):
    layout, made = pools
    # calls within 5 s; the start (processes importing torch, slower on a loaded machine) may take longer
    group = RoleGroup(ToyWorker, 2, made["critic"], name="critic", timeout_s=5, start_timeout_s=120)
    yield group
    group.shutdown()


def test_a_killed_actor_fails_the_call_naming_role_and_rank(critic):
    os.kill(critic.info[1]["pid"], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RoleError, match="role 'critic' rank 1: the actor died during whoami") as e:
        critic.call_all("whoami")
    assert e.value.cause is None and time.monotonic() - start < critic.timeout_s


def test_a_stuck_role_times_out_naming_its_ranks(critic):
    start = time.monotonic()
    with pytest.raises(RoleTimeoutError, match="role 'critic' ranks \\[0, 1\\]: no answer to sleep\\(\\) within 5 s"):
        critic.call_all("sleep", 120)
    assert time.monotonic() - start < 10


def test_a_start_slower_than_a_call_may_be_has_a_deadline_of_its_own(pools):
    """Ranks 3 s in `__init__`, calls bounded by 1 s: with `start_timeout_s` the group starts and a
    call still times out at 1 s; without it the start itself is held to the call's 1 s and fails."""
    _, made = pools
    group = RoleGroup(ToyWorker, 2, made["critic"], name="critic", timeout_s=1, start_timeout_s=120,
                      kwargs={"delay": 3.0})
    try:
        start = time.monotonic()
        with pytest.raises(RoleTimeoutError, match=r"no answer to sleep\(\) within 1 s"):
            group.call_all("sleep", 3)
        assert time.monotonic() - start < 2.5
    finally:
        group.shutdown()
    # The start's first step to overrun the 1 s fails it: on a loaded machine the placement may
    # already (a rank's node), else the ranks' construction (their `_role_info`).
    start_step = r"(ranks \[0, 1\]: no answer to _role_info\(\)|rank \d: no node for rank \d)"
    with pytest.raises(RoleTimeoutError, match=rf"role 'critic' {start_step} within 1 s"):
        RoleGroup(ToyWorker, 2, made["critic"], name="critic", timeout_s=1, kwargs={"delay": 3.0})
    with pytest.raises(ValueError, match="start_timeout_s must be a positive number"):
        RoleGroup(ToyWorker, 2, made["critic"], name="critic", start_timeout_s=0)
