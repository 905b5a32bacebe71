"""What a flow starts dies with it, however the flow dies.

A SIGKILLed flow process runs no `finally` or atexit: its children (Prefect's server, the local
Ray) live on, and its jobs on a `RAY_ADDRESS` cluster train on with nobody to record them.

`lifeline()` starts a watcher in a session of its own (out of reach of signals to the flow's
process group), holding the read end of a pipe the kernel closes when the flow dies. It records
the flow's descendants every second (with start times, so a reused pid is never signalled) and
its jobs on clusters that outlive it (from `orchestration.ray_jobs`). On EOF without `BYE` it
stops those jobs and SIGTERMs, then SIGKILLs, the recorded processes. A normal exit says `BYE`.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

from rlhf_core.infra.owner import start_time

BYE = "BYE"
POLL_S = 1.0  # how often the watcher records the flow's descendants
TERM_GRACE_S = 5.0  # SIGTERM, then SIGKILL for what is left after this
JOB_STOP_TIMEOUT_S = 5.0  # one stop request to a cluster's Jobs API

_current: Lifeline | None = None
_current_lock = threading.Lock()


class Lifeline:
    """The flow process's end of the pipe to its watcher."""

    def __init__(self, watcher: subprocess.Popen):
        self.watcher = watcher
        self.lock = threading.Lock()

    def send(self, line: str) -> None:
        with self.lock, contextlib.suppress(OSError, ValueError):
            self.watcher.stdin.write(line + "\n")
            self.watcher.stdin.flush()

    def release(self) -> None:
        """Leave normally: the watcher exits without stopping or killing anything."""
        self.send(BYE)
        with contextlib.suppress(OSError, ValueError):
            self.watcher.stdin.close()
        try:
            self.watcher.wait(10)
        except subprocess.TimeoutExpired:
            self.watcher.kill()
            self.watcher.wait()


@contextlib.contextmanager
def lifeline() -> Iterator[Lifeline]:
    """Watch this process for the block's duration (reentrant: an inner block shares the outer's)."""
    global _current
    from orchestration.ray_jobs import JOB_WATCHERS  # not at the top: the watcher process needs none of it

    with _current_lock:
        outer = _current
        if outer is None:
            _current = Lifeline(subprocess.Popen(
                [sys.executable, "-c", "from orchestration.lifeline import watch; watch()", str(os.getpid())],
                stdin=subprocess.PIPE, text=True, start_new_session=True))
        mine = _current
    if outer is None:
        JOB_WATCHERS.append(_on_job)
    try:
        yield mine
    finally:
        if outer is None:
            JOB_WATCHERS.remove(_on_job)
            with _current_lock:
                _current = None
            mine.release()


def _on_job(address: str | None, submission_id: str) -> None:
    """orchestration.ray_jobs' watcher hook: a job the watcher stops should this process die, or one that ended."""
    if _current is not None:
        _current.send(f"JOB {submission_id} {address}" if address else f"DONE {submission_id}")


# -- the watcher process ----------------------------------------------------------------------

def descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every living descendant of `pid` ({} once `pid` is gone)."""
    import psutil

    found = {}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            started = start_time(child.pid)
            if started is not None:
                found[child.pid] = started
    return found


def apply_line(line: str, jobs: dict[str, str]) -> bool:
    """Update `jobs` (submission id -> Jobs API address) from one line; True for the leaving word."""
    word, _, rest = line.strip().partition(" ")
    if word == "JOB":
        submission_id, _, address = rest.partition(" ")
        jobs[submission_id] = address
    elif word == "DONE":
        jobs.pop(rest, None)
    return word == BYE


def stop_jobs(jobs: dict[str, str]) -> None:
    """Ask each job's cluster to stop it; one that cannot (no answer in time, a refusal) is named on
    stderr, which is all the watcher of a dead process can do about it."""
    if not jobs:
        return
    from orchestration.ray_jobs import timed_client

    for submission_id, address in jobs.items():
        try:
            timed_client(address, JOB_STOP_TIMEOUT_S).stop_job(submission_id)
        except Exception as e:  # noqa: BLE001 - any failure: say so, go on with the next job
            print(f"rlhf lifeline: could not stop Ray job {submission_id} at {address} after its flow process "
                  f"died: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def terminate(processes: dict[int, str], grace_s: float = TERM_GRACE_S) -> list[int]:
    """SIGTERM the recorded processes still alive (same pid, same start time), SIGKILL them after
    `grace_s`; returns the pids that were signalled."""
    import psutil

    alive = []
    for pid, started in processes.items():
        if start_time(pid) == started:
            with contextlib.suppress(psutil.Error):
                alive.append(psutil.Process(pid))
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=grace_s)
    return [p.pid for p in alive]


def _running(pid: int, started: str) -> bool:
    """Is `pid` still the process that started at `started`, and not yet dead (a zombie's children are gone)?"""
    import psutil

    try:
        return start_time(pid) == started and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def watch() -> None:
    """The watcher's body (`python -c ... <pid>`): record, and clean up after a death."""
    pid = int(sys.argv[1])
    processes: dict[int, str] = {}
    jobs: dict[str, str] = {}
    pending = b""
    stdin = sys.stdin.fileno()
    started = start_time(pid)
    while True:
        seen = descendants(pid)
        seen.pop(os.getpid(), None)
        if _running(pid, started):
            processes = seen  # the flow still runs: what it has now is all it has
        else:
            processes.update(seen)  # it died while we looked: keep the last whole record
        deadline = time.monotonic() + POLL_S
        while (wait := deadline - time.monotonic()) > 0:
            if not select.select([stdin], [], [], wait)[0]:
                continue
            chunk = os.read(stdin, 65536)
            if not chunk:  # the flow's process is gone without leaving: it died
                stop_jobs(jobs)
                terminate(processes)
                return
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if apply_line(line.decode(errors="replace"), jobs):
                    return
