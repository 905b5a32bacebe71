"""Where the ranks of a job's roles run: the cluster's devices, and placement groups they share.

- Devices come from the cluster (`ray.cluster_resources()`), never from the driver: a CPU-only
  head of a GPU cluster still trains on GPUs, and a driver with CUDA joining a CPU cluster does not.
- A `ResourcePool` is one placement group of `n` equal bundles ({"GPU": 1, "CPU": c} on GPU,
  {"CPU": c} on CPU). Bundle i hosts rank i of every role placed in the pool; each role takes a
  `share` of every bundle it uses (`num_gpus = share`, `num_cpus = share * c`), so colocated roles
  sit on the same GPUs, and a role placed alone gets a pool of its own with share 1.
- `plan_layout` (pure) turns role world sizes and colocation groups into pools and shares. On CPU
  the cluster's CPUs are divided evenly among all bundles of all pools, so an RL job's four roles
  fit in 2 cores.
- A tensor-parallel vLLM engine is one rank (a Ray actor) spanning several bundles, one worker
  per GPU. `rank_bundle_groups` (pure) gives each such rank its bundles, on one node when the
  pool's nodes allow it (Ray does not number a placement group's bundles node by node).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

DEFAULT_POOL_TIMEOUT_S = 600.0
RESOURCE_UNIT = 1e-4  # Ray keeps resource amounts in fixed point with 4 decimals


def floor_units(x: float) -> float:
    """`x` rounded down to Ray's resource precision (fractions that add up never exceed a bundle)."""
    return math.floor(x / RESOURCE_UNIT + 1e-6) * RESOURCE_UNIT


class PlacementError(ValueError):
    """The requested roles cannot be placed on this cluster (or in this pool)."""


@dataclass(frozen=True)
class ClusterDevices:
    """What the ranks run on: GPUs when the cluster has any, else CPUs (`cpus` are those available)."""

    use_gpu: bool
    gpus: float
    cpus: float

    @property
    def device(self) -> str:
        return "cuda" if self.use_gpu else "cpu"


def cluster_devices(resources: Mapping[str, float], available: Mapping[str, float] | None = None) -> ClusterDevices:
    """Pure: the devices of a cluster from its total `resources` (`ray.cluster_resources()`), and
    the CPUs still free from `available` (`ray.available_resources()`; default: the totals). GPUs
    count from the totals, so GPUs busy at the moment do not turn a GPU cluster into a CPU one."""
    gpus = float(resources.get("GPU", 0) or 0)
    cpus = float((available if available is not None else resources).get("CPU", 0) or 0)
    return ClusterDevices(use_gpu=gpus >= 1, gpus=gpus, cpus=cpus)


def ranks_in_driver(max_ranks: int, alive_nodes: int, devices: ClusterDevices, driver_on_the_node: bool) -> bool:
    """Pure: whether a job's driver may hold its ranks itself instead of starting a Ray actor per
    rank: every role has one rank, and the cluster is one node with CPUs and no GPUs, the node the
    driver runs on (an actor would run on the same CPUs of the same machine, only in another
    process that imports torch and loads the models again: seconds per stage). `devices`: from the
    cluster's totals."""
    return (max_ranks == 1 and alive_nodes == 1 and not devices.use_gpu and devices.cpus > 0
            and driver_on_the_node)


RELEASE_WAIT_S = 15.0  # how long a driver waits for CPUs a finished job is still handing back


def detect_devices(release_wait_s: float = RELEASE_WAIT_S) -> ClusterDevices:
    """The devices of the cluster this driver is connected to.

    Ray hands back the CPUs of a finished job's placement groups and actors asynchronously, so a
    job started right after another may find almost none free: while less than one CPU is free of
    a cluster that has more, wait (up to `release_wait_s`)."""
    import time

    import ray

    deadline = time.monotonic() + release_wait_s
    while True:
        totals = ray.cluster_resources()
        devices = cluster_devices(totals, ray.available_resources())
        if devices.cpus >= min(1.0, float(totals.get("CPU", 0) or 0)) or time.monotonic() >= deadline:
            return devices
        time.sleep(0.25)


@dataclass(frozen=True)
class PoolSpec:
    """`bundles` bundles of {"CPU": cpus, "GPU": gpus} (GPU left out when 0), plus custom Ray
    resources (`resources`: (name, amount) pairs) that pin the bundles to nodes that have them."""

    name: str
    bundles: int
    cpus: float
    gpus: float = 0.0
    resources: tuple[tuple[str, float], ...] = ()

    def bundle(self) -> dict[str, float]:
        return {"CPU": self.cpus, **({"GPU": self.gpus} if self.gpus else {}), **dict(self.resources)}


@dataclass(frozen=True)
class Placement:
    """Where one role goes: ranks 0..world_size-1 on bundles 0..world_size-1 of `pool`, each rank
    taking `share` of its bundle (`num_cpus`, `num_gpus`). With `bundles_per_rank` k > 1 the role
    uses bundles 0..k*world_size-1, k per rank, and takes `share` of each of them."""

    role: str
    pool: str
    world_size: int
    share: float
    num_cpus: float
    num_gpus: float
    bundles_per_rank: int = 1

    @property
    def bundles(self) -> int:
        return self.world_size * self.bundles_per_rank


@dataclass(frozen=True)
class Layout:
    pools: dict[str, PoolSpec] = field(default_factory=dict)
    roles: dict[str, Placement] = field(default_factory=dict)


def colocation_groups(roles: Iterable[str], *, colocate_all_models: bool = False, colocate_actor_ref: bool = False,
                      colocate_critic_reward: bool = False) -> list[list[str]]:
    """OpenRLHF's colocation flags as groups of role names (roles: "actor", "ref", "critic",
    "reward", "rollout"; only those in `roles` appear, so a job without a critic just leaves it
    out). `colocate_all_models` puts every role, the rollout engines included, in one pool."""
    present = list(dict.fromkeys(roles))
    if colocate_all_models:
        return [present] if present else []
    groups = []
    for flag, pair in ((colocate_actor_ref, ("actor", "ref")), (colocate_critic_reward, ("critic", "reward"))):
        members = [r for r in pair if r in present]
        if flag and len(members) > 1:
            groups.append(members)
    return groups


def plan_layout(world_sizes: Mapping[str, int], colocate: Iterable[Iterable[str]] = (), *,
                devices: ClusterDevices, cpus_per_gpu: float = 1.0,
                bundles_per_rank: Mapping[str, int] | None = None,
                resources: Mapping[str, Mapping[str, float]] | None = None) -> Layout:
    """Pure: pools and per-rank shares for roles of the given world sizes.

    Each colocation group becomes one pool (named "a+b") of as many bundles as its largest role
    uses (world size x `bundles_per_rank`, default 1); every other role gets a pool of its own. A
    role in a group of k takes 1/k of each bundle it uses. On GPU a bundle is one GPU and
    `cpus_per_gpu` CPUs (fewer when the cluster lacks them); on CPU the available CPUs are split
    evenly over all bundles of the job: whole cores when each gets at least one, else fractions.
    `resources` (role -> custom Ray resources per bundle, e.g. {"node_a": 1}) go into the bundles
    of the role's pool (the largest amount of each where colocated roles name the same one), so
    its placement group lands only on nodes that have them.
    """
    sizes = dict(world_sizes)
    for role, n in sizes.items():
        if not isinstance(n, int) or n < 1:
            raise PlacementError(f"role {role!r}: world size must be a positive integer, got {n!r}")
    spans = {role: 1 for role in sizes}
    for role, k in (bundles_per_rank or {}).items():
        if role not in sizes:
            raise PlacementError(f"bundles_per_rank: unknown role {role!r} (roles: {sorted(sizes)})")
        if not isinstance(k, int) or k < 1:
            raise PlacementError(f"role {role!r}: bundles per rank must be a positive integer, got {k!r}")
        spans[role] = k
    used = {role: sizes[role] * spans[role] for role in sizes}  # bundles each role uses
    groups: list[list[str]] = []
    placed: dict[str, int] = {}
    for group in colocate:
        members = list(dict.fromkeys(group))
        for role in members:
            if role not in sizes:
                raise PlacementError(f"colocation group {members}: unknown role {role!r} (roles: {sorted(sizes)})")
            if role in placed:
                raise PlacementError(f"role {role!r} is in two colocation groups")
            placed[role] = len(groups)
        if members:
            groups.append(members)
    groups += [[role] for role in sizes if role not in placed]
    groups.sort(key=lambda g: min(list(sizes).index(r) for r in g))  # pools in the order roles were given

    total_bundles = sum(max(used[r] for r in g) for g in groups)
    if devices.use_gpu:
        if total_bundles > devices.gpus:
            raise PlacementError(f"the roles need {total_bundles} GPUs ({_describe(groups, used)}); "
                                 f"the cluster has {devices.gpus:g}: colocate roles or use fewer ranks")
        cpus, gpus = floor_units(min(cpus_per_gpu, devices.cpus / total_bundles)), 1.0
    else:
        per_bundle = devices.cpus / total_bundles
        cpus, gpus = (float(math.floor(per_bundle)) if per_bundle >= 1 else floor_units(per_bundle)), 0.0
    if cpus <= 0:
        raise PlacementError(f"the cluster's {devices.cpus:g} available CPUs cannot be split over "
                             f"{total_bundles} bundles ({_describe(groups, used)})")
    custom = {role: dict(amounts) for role, amounts in (resources or {}).items() if amounts}
    for role, amounts in custom.items():
        if role not in sizes:
            raise PlacementError(f"resources: unknown role {role!r} (roles: {sorted(sizes)})")
        bad = [k for k, v in amounts.items() if k in ("CPU", "GPU") or not v > 0]
        if bad:
            raise PlacementError(f"role {role!r}: resources {bad} must be custom resources with positive amounts")
    layout = Layout()
    for group in groups:
        pinned: dict[str, float] = {}
        for role in group:
            for key, amount in custom.get(role, {}).items():
                pinned[key] = max(pinned.get(key, 0.0), float(amount))
        pool = PoolSpec("+".join(group), max(used[r] for r in group), cpus, gpus, tuple(sorted(pinned.items())))
        layout.pools[pool.name] = pool
        share = floor_units(1.0 / len(group))
        for role in group:
            layout.roles[role] = Placement(role, pool.name, sizes[role], share, floor_units(cpus * share),
                                           floor_units(gpus * share), spans[role])
    return layout


def _describe(groups: list[list[str]], sizes: Mapping[str, int]) -> str:
    return ", ".join(f"{'+'.join(g)}: {max(sizes[r] for r in g)}" for g in groups)


def rank_bundle_groups(bundle_nodes: Sequence[str], first: int, ranks: int, span: int) -> list[list[int]]:
    """Pure: the bundles of each of `ranks` ranks that span `span` bundles each, out of bundles
    first..first+ranks*span-1 of a pool whose bundle i sits on node `bundle_nodes[i]`.

    With span 1 rank r is bundle first+r, as for every other role. Otherwise each node's bundles
    (in index order, nodes in the order they first appear) are cut into runs of `span`: a rank's
    bundles are on one node wherever the node holds a multiple of `span` of them; what is left over
    on the nodes is grouped last, across nodes (vLLM runs such an engine, slowly: `groups_across_nodes`).
    """
    if ranks < 1 or span < 1:
        raise PlacementError(f"ranks and bundles per rank must be positive, got {ranks} and {span}")
    wanted = range(first, first + ranks * span)
    if first < 0 or wanted.stop > len(bundle_nodes):
        raise PlacementError(f"bundles {first}..{wanted.stop - 1} are outside a pool of {len(bundle_nodes)}")
    if span == 1:
        return [[i] for i in wanted]
    by_node: dict[str, list[int]] = {}
    for i in wanted:
        by_node.setdefault(bundle_nodes[i], []).append(i)
    groups, leftover = [], []
    for bundles in by_node.values():
        whole = len(bundles) - len(bundles) % span
        groups += [bundles[j : j + span] for j in range(0, whole, span)]
        leftover += bundles[whole:]
    groups += [leftover[j : j + span] for j in range(0, len(leftover), span)]
    return groups


def groups_across_nodes(groups: Sequence[Sequence[int]], bundle_nodes: Sequence[str]) -> list[int]:
    """Indices of the bundle groups whose bundles sit on more than one node."""
    return [g for g, bundles in enumerate(groups) if len({bundle_nodes[i] for i in bundles}) > 1]


class ResourcePool:
    """One placement group of `bundles` equal bundles that one or several roles share.

    A role claims a `share` of a range of bundles (`claim`); claims beyond a whole bundle are
    refused here, instead of leaving an actor pending in Ray forever.
    """

    def __init__(self, bundles: int, cpus: float, gpus: float = 0.0, *, name: str = "pool", strategy: str = "PACK",
                 timeout_s: float = DEFAULT_POOL_TIMEOUT_S, resources: Mapping[str, float] | None = None):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if bundles < 1:
            raise PlacementError(f"pool {name!r}: needs at least one bundle")
        self.spec = PoolSpec(name, bundles, cpus, gpus, tuple(sorted((resources or {}).items())))
        self._claims: dict[str, tuple[float, range]] = {}
        self.pg = placement_group([self.spec.bundle()] * bundles, strategy=strategy)
        try:
            ray.get(self.pg.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise PlacementError(f"pool {name!r}: {bundles} bundles of {self.spec.bundle()} were not placed within "
                                 f"{timeout_s:g} s; the cluster has {ray.cluster_resources()}, "
                                 f"available now {ray.available_resources()}") from None

    @classmethod
    def from_spec(cls, spec: PoolSpec, **kwargs) -> ResourcePool:
        return cls(spec.bundles, spec.cpus, spec.gpus, name=spec.name, resources=dict(spec.resources), **kwargs)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def bundles(self) -> int:
        return self.spec.bundles

    def claim(self, role: str, share: float, first: int, count: int) -> None:
        """Reserve `share` of bundles first..first+count-1 for `role` (refused past a whole bundle)."""
        if not 0 < share <= 1:
            raise PlacementError(f"role {role!r}: share must be in (0, 1], got {share}")
        if role in self._claims:
            raise PlacementError(f"pool {self.name!r}: role {role!r} is already placed here")
        wanted = range(first, first + count)
        if first < 0 or wanted.stop > self.bundles:
            raise PlacementError(f"role {role!r}: bundles {first}..{wanted.stop - 1} are outside pool "
                                 f"{self.name!r} of {self.bundles}")
        for i in wanted:
            taken = sum(s for s, r in self._claims.values() if i in r)
            if taken + share > 1 + 1e-9:
                raise PlacementError(f"pool {self.name!r} bundle {i}: role {role!r} asks for {share:g} of it, "
                                     f"{taken:g} is already taken by {sorted(self._claims)}")
        self._claims[role] = (share, wanted)

    def release(self, role: str) -> None:
        self._claims.pop(role, None)

    def scheduling(self, index: int, capture_child_tasks: bool = False):
        """The scheduling strategy that puts an actor (or task) in bundle `index`; with
        `capture_child_tasks` the actors and tasks it starts without a placement of their own join
        this placement group too (a tensor-parallel vLLM engine's workers)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index,
                                                placement_group_capture_child_tasks=capture_child_tasks)

    def bundle_nodes(self) -> list[str]:
        """The id of the node each bundle sits on, by bundle index."""
        from ray.util.placement_group import placement_group_table

        nodes = placement_group_table(self.pg)["bundles_to_node_id"]
        return [str(nodes[i]) for i in range(self.bundles)]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.pg)


def create_pools(layout: Layout, **kwargs) -> dict[str, ResourcePool]:
    """One ResourcePool per pool of `layout` (removed again if a later one cannot be placed)."""
    pools: dict[str, ResourcePool] = {}
    try:
        for spec in layout.pools.values():
            pools[spec.name] = ResourcePool.from_spec(spec, **kwargs)
    except BaseException:
        for pool in pools.values():
            pool.remove()
        raise
    return pools
