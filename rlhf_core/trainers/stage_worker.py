"""One rank of a supervised stage: the worker of its role group ("train"), one DeepSpeed rank.

The RoleGroup (distributed/role_group.py) sets every rank's RANK/WORLD_SIZE/LOCAL_RANK/
MASTER_ADDR/MASTER_PORT before DeepSpeed starts and places it from the cluster's devices: one GPU
per rank when the cluster has GPUs, else an equal share of the cores (as torch threads).
"""

from __future__ import annotations

import os

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
