"""A supervised stage's ranks: one role ("train") of Ray actors, one DeepSpeed rank each.

The RoleGroup (distributed/role_group.py) sets every rank's RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT before DeepSpeed starts and places it from the cluster's devices: one GPU
per rank when the cluster has GPUs, else an equal share of the cores (as torch threads).
"""

from __future__ import annotations

import os

import ray

from rlhf_core.distributed.resources import ClusterDevices, detect_devices
from rlhf_core.distributed.role_group import RoleGroup

# Bounds a rank that hangs alive (a rank that dies fails the wait at once); RLHF_STAGE_TIMEOUT_S overrides it.
DEFAULT_STAGE_TIMEOUT_S = 7 * 24 * 3600.0


def stage_timeout_s() -> float:
    return float(os.environ.get("RLHF_STAGE_TIMEOUT_S") or DEFAULT_STAGE_TIMEOUT_S)


class StageWorker:
    """One rank of a supervised stage."""

    def run_stage(self, config: dict, data=None) -> dict | None:
        from rlhf_core.config import STAGE_CONFIGS
        from rlhf_core.distributed.engine import init_distributed
        from rlhf_core.trainers import run_recipe

        env = os.environ  # set by the RoleGroup; Ray's CUDA_VISIBLE_DEVICES makes the local device 0
        init_distributed(int(env["RANK"]), int(env["WORLD_SIZE"]), env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                         local_rank=int(env["LOCAL_RANK"]))
        cfg = STAGE_CONFIGS[config["stage"]].model_validate(config)
        return run_recipe(cfg, data)


class WorkerGroup:
    """`world_size` StageWorker ranks; GPU or CPU from the cluster (`use_gpu` forces one)."""

    def __init__(self, world_size: int, use_gpu: bool | None = None, devices: ClusterDevices | None = None):
        devices = devices or detect_devices()
        if use_gpu is not None and use_gpu != devices.use_gpu:
            devices = ClusterDevices(use_gpu=use_gpu, gpus=devices.gpus, cpus=devices.cpus)
        self.devices = devices
        self.group = RoleGroup(StageWorker, world_size, name="train", devices=devices)

    def run_stage(self, config: dict, data: ray.ObjectRef | None = None) -> dict | None:
        """Run the stage on every rank; rank 0's result. `data`: an object-store reference to the
        driver's checked StageData, which every rank reads instead of tokenizing the datasets
        again (None: each rank loads them itself)."""
        return self.group.call_all_async("run_stage", config, data).result(timeout_s=stage_timeout_s())[0]

    def shutdown(self) -> None:
        self.group.shutdown()
