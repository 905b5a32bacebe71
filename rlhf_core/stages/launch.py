"""Run a training stage as a group of Ray actors, one rank each (the job's single controller lives
here), or in the CLI's own process when one rank and no cluster suffice. The cluster itself is
`rlhf_core/distributed/cluster.py`'s."""

from __future__ import annotations

import os
import sys

from rlhf_core.config import TrainConfig
from rlhf_core.distributed.cluster import ensure_ray, prepare_environment, ranks_stay_in_driver
from rlhf_core.infra import heap
from rlhf_core.infra.hubs import use_modelscope
from rlhf_core.infra.settings import ConfigError


def is_bad_input(cause: BaseException) -> bool:
    """A stage's failure that a retry would only repeat: bad configuration or data, or a reward source
    that answered something unusable (a reward file that raised, a server's malformed answer or 4xx);
    a reward server that stayed unreachable is an infrastructure failure (exit 1, retried)."""
    from rlhf_core.data.loading import DataError
    from rlhf_core.rewards.base import RewardError
    from rlhf_core.rewards.remote import RewardUnavailable

    if isinstance(cause, RewardError):
        return not isinstance(cause, RewardUnavailable)
    return isinstance(cause, (ConfigError, DataError))


class StageFailed(RuntimeError):
    """A rank failed; `cause` is the original exception raised inside the actor."""

    def __init__(self, cause: BaseException):
        super().__init__(str(cause))
        self.cause = cause


def trains_in_process(cfg: TrainConfig) -> bool:
    """One rank and no cluster to join (`RAY_ADDRESS` unset): the CLI's own process is the rank and
    no local Ray is started. (Joined to a cluster, one rank may still train in the driver:
    `run_stage` asks `cluster.ranks_stay_in_driver`.)"""
    return cfg.world_size == 1 and not os.environ.get("RAY_ADDRESS")


def run_stage(cfg: TrainConfig) -> dict:
    """Train one stage on `cfg.world_size` ranks and return its manifest (from rank 0)."""
    from rlhf_core.infra import storage
    from rlhf_core.trainers import check_data

    cfg.check_complete()
    storage.check_stage_output(cfg)  # refuse to write over what is not ours before anything runs
    prepare_environment()
    use_modelscope(cfg.use_ms)
    data = check_data(cfg)
    heap.settle()  # modules and checked data stay: later collector passes skip them (heap.py)
    if trains_in_process(cfg):
        return _train_here(cfg, data)
    import ray  # slow to import: only where a worker group runs

    from rlhf_core.distributed.role_group import RoleError, RoleGroup
    from rlhf_core.trainers.stage_worker import StageWorker, stage_timeout_s

    started = ensure_ray()
    group = None
    try:
        if ranks_stay_in_driver(cfg.world_size):
            return _train_here(cfg, data)
        # The checked data goes to the object store once; the driver keeps only the reference.
        shared, data = share_data(data), None
        group = RoleGroup(StageWorker, cfg.world_size, name="train")  # GPUs when the cluster has them
        # every rank runs the stage; rank 0's result is the manifest
        return group.call_all_async("run_stage", cfg.model_dump(mode="json"), shared).result(
            timeout_s=stage_timeout_s())[0]
    except RoleError as e:  # a rank raised, died or hung: the error names the role and rank
        # Bad input is the rank's own message (exit 2, as in one process); anything else keeps the rank's name.
        raise StageFailed(e.cause if e.cause is not None and is_bad_input(e.cause) else e) from None
    finally:
        if group is not None:
            group.shutdown()
        if started:
            ray.shutdown()
        sys.stderr.flush()


def _train_here(cfg: TrainConfig, data) -> dict:
    from rlhf_core.trainers import run_recipe

    try:
        return run_recipe(cfg, data)
    except Exception as e:
        raise StageFailed(e) from e


def share_data(data):
    """`ray.put(data)`, or None when the object store cannot hold it: then each rank loads and
    checks the datasets itself (the same deterministic `load_data`), and a log line says so."""
    import ray
    from ray.exceptions import ObjectStoreFullError

    try:
        return ray.put(data)
    except ObjectStoreFullError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"rlhf: the checked datasets do not fit in Ray's object store ({first}); each rank loads them "
              "itself instead (more memory and start-up time per rank; a larger object store, e.g. "
              "`ray start --object-store-memory`, avoids it)", file=sys.stderr, flush=True)
        return None


def run_rl_stage(cfg) -> dict:
    """Run an RL stage (`rlhf train ppo`) from this process, its single controller; returns its manifest."""
    from rlhf_core.infra import storage

    cfg.check_complete()
    storage.check_stage_output(cfg)  # refuse to write over what is not ours before anything runs
    prepare_environment()
    from rlhf_core.trainers.ppo import run_ppo

    try:
        return run_ppo(cfg)
    except Exception as e:
        raise StageFailed(e) from e


def probe_hardware() -> dict:
    """What the ranks of a stage would train on, probed on the cluster (not on this driver): a GPU
    worker when the cluster has GPUs, else a CPU worker. Returns the device, whether bf16 is
    native, and what each `--param_dtype` resolves to there (`rlhf hardware` prints it)."""
    import ray

    from rlhf_core.distributed.resources import detect_devices
    from rlhf_core.infra.precision import Precision, resolve, this_hardware

    started = ensure_ray()
    try:
        gpus = detect_devices().use_gpu
        hw = ray.get(ray.remote(num_gpus=1 if gpus else 0, num_cpus=0 if gpus else 1)(this_hardware).remote(),
                     timeout=300)
    finally:
        if started:
            ray.shutdown()
    return {"device": hw.device_type, "name": hw.name, "native_bf16": hw.native_bf16,
            "precision": {p.value: resolve(p, hw)[0].value for p in Precision}}
