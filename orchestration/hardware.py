"""What the cluster's ranks would train on, asked once per pipeline run.

A stage's `param_dtype: auto` becomes bf16 or fp32 on the machine its ranks run on, and an
output trained in one precision must not be reused for the other: cache keys hold the resolved
precision, never `auto`. The flow runs no torch, and the cluster may be other machines, so the
answer comes from `rlhf hardware` run as a Ray job (a worker of the kind the ranks get probes
its device). A local cluster's answer (this machine's) is kept in the state directory, keyed by
what could change it (the boot, the CPU, torch's build, the visible GPUs), so later runs on this
machine skip the probe's job (about 5 s).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from orchestration.ray_jobs import RayJobRunner, job_env, local_cluster
from rlhf_core.infra.precision import HARDWARE_PREFIX, Precision, cpu_name
from rlhf_core.infra.settings import state_dir


def probe_cluster(address: str, log: Callable[[str], None]) -> dict:
    """`rlhf hardware`'s answer from the cluster at `address` (its Jobs API URL); for a local cluster
    of this run, this machine's answer from an earlier run when nothing that decides it changed."""
    local = local_cluster(address) is not None
    key = machine_key() if local else None
    known = _read_known(key) if key else None
    if known is not None:
        log(f"hardware of this machine, as probed by an earlier run: {HARDWARE_PREFIX}{json.dumps(known)}")
        return known
    answer = _probe(address, log)
    if key:
        _remember(key, answer)
    return answer


def _probe(address: str, log: Callable[[str], None]) -> dict:
    lines: list[str] = []

    def collect(line: str) -> None:
        lines.append(line)
        log(line)

    RayJobRunner(address).run("hardware", ["hardware"], job_env(), log=collect)
    for line in reversed(lines):
        if HARDWARE_PREFIX in line:
            return json.loads(line.split(HARDWARE_PREFIX, 1)[1])
    raise RuntimeError(f"`rlhf hardware` on {address} printed no '{HARDWARE_PREFIX.strip()}' line")


def machine_key() -> str | None:
    """What decides this machine's answer: the boot (a different machine or a changed one boots
    anew), the CPU, torch's build, the GPUs this process may see. None where the boot is unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "none"
    gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "all")
    return f"boot={boot} cpu={cpu_name()} torch={torch} gpus={gpus}"


def _known_file() -> Path:
    return state_dir() / "hardware.json"


def _read_known(key: str) -> dict | None:
    """The answer remembered under `key`, if it answers for every precision this code knows."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        known = json.loads(_known_file().read_text()).get(key)
        if known and {p.value for p in Precision} <= set(known.get("precision", {})):
            return known
    return None


def _remember(key: str, answer: dict) -> None:
    """Written whole to a temporary file and renamed: a reader never sees half of it."""
    path = _known_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    partial.write_text(json.dumps({key: answer}))
    os.replace(partial, path)
