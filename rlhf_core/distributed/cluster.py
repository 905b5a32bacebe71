"""Joining or starting the Ray cluster a stage's ranks run on, and what its processes inherit.

With `RAY_ADDRESS` set a stage joins that cluster; otherwise a local Ray is started for the run
(`local_ray.py`: 127.0.0.1, token authentication on) and shut down after it. Settings the ranks
need (state directory, MLflow run, S3 endpoint) travel as an explicit allow-list of environment
variables, never the whole environment, so secrets stay where the cluster keeps them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rlhf_core.infra.settings import ConfigError, state_dir, tracking_uri

FORWARDED_ENV = ("RLHF_HOME", "RLHF_ARTIFACT_ROOT", "RLHF_NO_PROGRESS", "RLHF_PROGRESS_SECONDS", "MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID",
                 "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION", "TORCH_EXTENSIONS_DIR", "HF_HUB_OFFLINE",
                 "TOKENIZERS_PARALLELISM")
# The bounds of a stage's waits for MLflow and S3 (rlhf_core/infra/reachability.py) reach its job and ranks too.
FORWARDED_ENV += ("RLHF_STORE_CHECK_S", "RLHF_STORE_WAIT_S", "RLHF_METRICS_BUFFER", "MLFLOW_HTTP_REQUEST_TIMEOUT",
                  "MLFLOW_HTTP_REQUEST_MAX_RETRIES")
# Paths on this machine's disk. A driver joining a running cluster (`RAY_ADDRESS`) does not impose
# its own on the ranks: a rank's node has its own state directory (where `ray start` ran, or what
# the job's environment says), so no rank depends on a folder of the driver's machine.
NODE_LOCAL_ENV = ("RLHF_HOME", "TORCH_EXTENSIONS_DIR")
# "0": a job whose roles have one rank each keeps them in its driver on a one-node CPU cluster
# (`ranks_stay_in_driver`); "1", or unset on a cluster of RAY_ADDRESS: Ray actors. A flow sets "0"
# for the local Ray it starts (`orchestration/ray_jobs.job_env`), as deployments/stack.sh does.
RANKS_ON_RAY_ENV = "RLHF_RANKS_ON_RAY"
FORWARDED_ENV += (RANKS_ON_RAY_ENV,)


def forwarded_env() -> dict[str, str]:
    """The allow-listed settings of this process that its jobs and ranks get (`FORWARDED_ENV`, never
    secrets). With `RAY_ADDRESS` (a cluster of its own, perhaps of many machines) this machine's
    disk paths (`NODE_LOCAL_ENV`) stay here: each node uses the ones it was started with. The
    MLflow store is named in any case (`MLFLOW_TRACKING_URI`; by default this state directory's
    SQLite file): the runs this process made or hands over are there, not in a node's own state
    directory (a store on no shared disk: the job says its run is missing, `mlflow_ops`)."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    if os.environ.get("RAY_ADDRESS"):
        env = {k: v for k, v in env.items() if k not in NODE_LOCAL_ENV}
    env.setdefault("MLFLOW_TRACKING_URI", tracking_uri())
    return env


def prepare_environment() -> None:
    """Defaults every process of a stage shares (set before Ray starts, so actors inherit them)."""
    home = state_dir()
    os.environ.setdefault("RLHF_HOME", str(home))
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(home / "torch_extensions"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning,ignore::UserWarning")


def check_no_other_checkout_here(cwd: Path | None = None) -> None:
    """ConfigError when the working directory holds a copy of `rlhf_core` other than the one running.
    A local Ray's jobs and ranks run in this directory: `python -m rlhf_core.cli` puts it first on a
    job driver's path and Ray puts the driver's working directory on every rank's, so they would
    import that copy, not this code."""
    here = Path(cwd or Path.cwd())
    other, mine = here / "rlhf_core", Path(__file__).resolve().parents[1]  # rlhf_core/distributed/cluster.py
    if other.is_dir() and other.resolve() != mine:
        raise ConfigError(f"the working directory {here} holds another copy of this project's code ({other}); a "
                          f"local Ray's jobs and ranks run there and would import it instead of the running code "
                          f"({mine}): start from another directory")


def ensure_ray() -> bool:
    """Connect to RAY_ADDRESS or start a local Ray; returns True when we started it."""
    import ray

    if ray.is_initialized():
        return False
    env = forwarded_env()
    # Inside a Ray job the job's runtime env already reaches our actors; Ray refuses to merge a
    # driver runtime env that names the same variables again, so pass only what it lacks.
    job_config = json.loads(os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR", "{}"))
    job_vars = (job_config.get("runtime_env") or {}).get("env_vars") or {}
    env = {k: v for k, v in env.items() if k not in job_vars}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env={"env_vars": env}, log_to_driver=True)
        return False
    from rlhf_core.distributed.local_ray import init_local  # on 127.0.0.1, token authentication on

    check_no_other_checkout_here()
    init_local(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True,
               runtime_env={"env_vars": env}, configure_logging=False)
    return True


def ranks_stay_in_driver(max_ranks: int, pinned: bool = False, what: str = "it trains") -> bool:
    """Joined to a cluster (`RAY_ADDRESS`) with `RLHF_RANKS_ON_RAY=0`: whether this driver runs its
    roles of `max_ranks` ranks each in the driver's own process (`resources.ranks_in_driver`: one
    rank each, one CPU node, the driver's), as `rlhf train` does with no cluster at all; says so
    in one line. Connects (`ensure_ray`) and stays connected, so the driver still exits when the
    cluster goes (Ray's GCS reconnect bound). `pinned`: a role names custom Ray resources, which
    only actors can take. Unset or "1": actors (a cluster of RAY_ADDRESS may scale up, or be
    reached through Ray Client from another machine: only its owner knows)."""
    value = os.environ.get(RANKS_ON_RAY_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ConfigError(f"{RANKS_ON_RAY_ENV}={value!r}: give 0 (one rank per role stays in the job's driver on a "
                          "one-node CPU cluster) or 1 (Ray actors)")
    if value == "1" or pinned or max_ranks > 1:
        return False
    import ray

    from rlhf_core.distributed.resources import cluster_devices, ranks_in_driver

    ensure_ray()
    alive = [node for node in ray.nodes() if node.get("Alive")]
    here = ray.get_runtime_context().get_node_id()
    stays = ranks_in_driver(max_ranks, len(alive), cluster_devices(ray.cluster_resources()),
                            any(node.get("NodeID") == here for node in alive))
    if stays:
        print(f"rlhf: one rank per role on a one-node CPU cluster: {what} in the job's driver ({RANKS_ON_RAY_ENV}=1 "
              "for Ray actors)", file=sys.stderr, flush=True)
    return stays
