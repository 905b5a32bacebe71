"""What the cluster's ranks would train on, asked once per pipeline run.

A stage's `param_dtype: auto` becomes bf16 or fp32 on the machine its ranks run on, and an
output trained in one precision must not be reused for the other: cache keys hold the resolved
precision, never `auto`. The flow runs no torch, and the cluster may be other machines, so the
answer comes from `rlhf hardware` run as a Ray job (a worker of the kind the ranks get probes
its device).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from orchestration.ray_jobs import RayJobRunner, job_env
from rlhf_core.infra.precision import HARDWARE_PREFIX


def probe_cluster(address: str, log: Callable[[str], None]) -> dict:
    """`rlhf hardware`'s answer from the cluster at `address` (its Jobs API URL)."""
    lines: list[str] = []

    def collect(line: str) -> None:
        lines.append(line)
        log(line)

    RayJobRunner(address).run("hardware", ["hardware"], job_env(), log=collect)
    for line in reversed(lines):
        if HARDWARE_PREFIX in line:
            return json.loads(line.split(HARDWARE_PREFIX, 1)[1])
    raise RuntimeError(f"`rlhf hardware` on {address} printed no '{HARDWARE_PREFIX.strip()}' line")
