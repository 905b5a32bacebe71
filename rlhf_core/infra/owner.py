"""Which process owns an MLflow run, and whether that process is gone.

A killed process (SIGKILL, OOM) cannot mark its run FAILED, and `rlhf prune` keeps everything a
RUNNING pipeline run wrote. So every run carries `rlhf.owner` = `<machine>|<pid>|<start>`; the
machine (host name, boot id, PID namespace) tells containers and reboots apart, and the start time
tells a reused PID. Only owners on this machine are judged. Linux reads `/proc`, elsewhere psutil
(if installed); with neither no owner is recorded, and such runs are never judged gone.
"""

from __future__ import annotations

import os
import socket
from functools import cache
from pathlib import Path

OWNER_TAG = "rlhf.owner"


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


@cache
def machine() -> str:
    """This machine as its processes see it: host name, boot id and PID namespace (Linux)."""
    parts = [socket.gethostname()]
    boot = _read("/proc/sys/kernel/random/boot_id")
    if boot:
        parts.append(boot)
    try:
        parts.append(os.readlink("/proc/self/ns/pid").removeprefix("pid:").strip("[]"))
    except OSError:
        pass
    return "/".join(parts).replace("|", "_")


def start_time(pid: int) -> str | None:
    """When process `pid` started, as a string that differs between two processes that held the
    same PID; None when no such process exists (or nothing here can tell)."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is not None:
        # Field 22 (start time in clock ticks since boot) counts from after the command name,
        # which is in parentheses and may itself hold spaces or parentheses.
        fields = stat.rsplit(")", 1)[-1].split()
        return fields[19] if len(fields) > 19 else None
    if Path("/proc/self/stat").exists():
        return None  # Linux: no /proc/<pid> means no such process
    try:
        import psutil
    except ImportError:
        return None
    try:
        return f"{psutil.Process(pid).create_time():.3f}"
    except psutil.Error:  # no such process, or one this user may not read
        return None


def owner_tag(pid: int | None = None) -> str | None:
    """`rlhf.owner`'s value for process `pid` (this one by default); None where its start time is
    unknown (then nothing could later prove the owner gone)."""
    pid = os.getpid() if pid is None else pid
    started = start_time(pid)
    return None if started is None else f"{machine()}|{pid}|{started}"


def parse(owner: str | None) -> tuple[str, int, str] | None:
    """`(machine, pid, start)` of an `rlhf.owner` value; None when it is not one."""
    try:
        where, pid, started = (owner or "").rsplit("|", 2)
        return where, int(pid), started
    except ValueError:
        return None


def is_gone(owner: str | None) -> bool:
    """True only when `owner` (an `rlhf.owner` value) names a process of this machine that no
    longer runs; False for a live owner, another machine's, or a value this code cannot read."""
    parsed = parse(owner)
    if parsed is None or parsed[0] != machine():
        return False
    return start_time(parsed[1]) != parsed[2]
