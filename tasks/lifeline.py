"""What a flow starts dies with it, however the flow dies.

A flow process that is SIGKILLed (the OOM killer, `kill -9`, a lost terminal's session torn down)
runs no `finally` and no atexit hook. Its children are re-parented to init and live on: Prefect's
ephemeral API server (uvicorn, ~200 MB; measured still running 10 minutes after a killed
`rlhf pipeline run`, one more for every killed run), the local Ray's keeper and cluster (gone only
~45 s later, once the keeper noticed) and the Ray jobs it submitted to a cluster of `RAY_ADDRESS`,
which would train on with nobody to record them.

`lifeline()` starts a small watcher process in a session of its own (a signal to the flow's
process group does not reach it). The flow's process holds the write end of a pipe to the
watcher's stdin; the kernel closes it when the process dies, whatever killed it. Meanwhile the
watcher records the flow process's descendants once a second (pid and start time, so a reused
pid is never signalled) and the Ray jobs the flow has running (told by `tasks.ray_jobs`). On EOF
without the leaving word (`BYE`) it stops those jobs (bounded requests) and then terminates the
recorded processes still alive: SIGTERM, then SIGKILL after a grace period. A process that leaves
its `with lifeline():` block normally says `BYE` first: the watcher exits and touches nothing.
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
    from tasks.ray_jobs import JOB_WATCHERS  # not at the top: the watcher process needs none of it

    with _current_lock:
        outer = _current
        if outer is None:
            _current = Lifeline(subprocess.Popen(
                [sys.executable, "-c", "from tasks.lifeline import watch; watch()", str(os.getpid())],
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
    """tasks.ray_jobs' watcher hook: a job the watcher stops should this process die, or one that ended."""
    if _current is not None:
        _current.send(f"JOB {submission_id} {address}" if address else f"DONE {submission_id}")


# -- the watcher process ----------------------------------------------------------------------

def descendants(pid: int) -> dict[int, float]:
    """pid -> start time of every living descendant of `pid` ({} once `pid` is gone)."""
    import psutil

    found = {}
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                found[child.pid] = child.create_time()
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
    """Ask each job's cluster to stop it; a cluster that does not answer in time is left."""
    if not jobs:
        return
    from tasks.ray_jobs import timed_client

    for submission_id, address in jobs.items():
        with contextlib.suppress(Exception):
            timed_client(address, JOB_STOP_TIMEOUT_S).stop_job(submission_id)


def terminate(processes: dict[int, float], grace_s: float = TERM_GRACE_S) -> list[int]:
    """SIGTERM the recorded processes still alive (same pid, same start time), SIGKILL them after
    `grace_s`; returns the pids that were signalled."""
    import psutil

    alive = []
    for pid, started in processes.items():
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            if p.create_time() == started:
                alive.append(p)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, left = psutil.wait_procs(alive, timeout=grace_s)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(left, timeout=grace_s)
    return [p.pid for p in alive]


def _same_process(pid: int, started: float) -> bool:
    import psutil

    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE  # a dead one's children are gone
    except psutil.Error:
        return False


def watch() -> None:
    """The watcher's body (`python -c ... <pid>`): record, and clean up after a death."""
    import psutil

    pid = int(sys.argv[1])
    processes: dict[int, float] = {}
    jobs: dict[str, str] = {}
    pending = b""
    stdin = sys.stdin.fileno()
    started = psutil.Process(pid).create_time()
    while True:
        seen = descendants(pid)
        seen.pop(os.getpid(), None)
        if _same_process(pid, started):
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
