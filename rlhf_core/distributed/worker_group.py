"""A group of Ray actors, one DeepSpeed rank each, placed together by a placement group.

The driver (the job's single controller) creates rank 0 first to learn its node address and a
free port for the rendezvous, then the other ranks; each sets RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT before DeepSpeed starts (gloo on CPU, NCCL on GPU). On CPU every rank
gets an equal share of the cores as torch threads.
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@ray.remote
class RankWorker:
    def __init__(self, rank: int, world_size: int, num_threads: int):
        import torch

        self.rank, self.world_size = rank, world_size
        torch.set_num_threads(max(1, num_threads))

    def address(self) -> tuple[str, int]:
        from rlhf_core.distributed.engine import free_port

        return ray.util.get_node_ip_address(), free_port()

    def run_stage(self, config: dict, master_addr: str, master_port: int, data=None) -> dict | None:
        from rlhf_core.config import STAGE_CONFIGS
        from rlhf_core.distributed.engine import init_distributed
        from rlhf_core.trainers import run_recipe

        # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU, so its local device is always 0.
        init_distributed(self.rank, self.world_size, master_addr, master_port, local_rank=0)
        cfg = STAGE_CONFIGS[config["stage"]].model_validate(config)
        return run_recipe(cfg, data)


class WorkerGroup:
    def __init__(self, world_size: int, use_gpu: bool):
        total_cpus = int(ray.available_resources().get("CPU", os.cpu_count() or 1))
        cpus = 1 if use_gpu else max(1, total_cpus // world_size)
        bundle = {"CPU": cpus, **({"GPU": 1} if use_gpu else {})}
        self.pg = placement_group([bundle] * world_size, strategy="PACK")
        ray.get(self.pg.ready(), timeout=600)
        self.workers = [
            RankWorker.options(
                num_cpus=cpus, num_gpus=1 if use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
            ).remote(i, world_size, cpus)
            for i in range(world_size)
        ]

    def run_stage(self, config: dict, data: ray.ObjectRef | None = None) -> dict | None:
        """Run the stage on every rank. `data`: an object-store reference to the driver's checked
        StageData, which every rank reads instead of tokenizing the datasets again (None: each
        rank loads them itself)."""
        addr, port = ray.get(self.workers[0].address.remote())
        results = ray.get([w.run_stage.remote(config, addr, port, data) for w in self.workers])
        return results[0]

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
