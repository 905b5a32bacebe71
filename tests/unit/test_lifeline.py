"""tasks/lifeline.py: the children of a process that dies (SIGKILL) are ended by its watcher; a
process that leaves its block normally has nothing of its own touched."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from tasks import lifeline

ROOT = str(Path(__file__).resolve().parents[2])

# A flow-like process: a child, and a grandchild that ignores SIGTERM (it needs the SIGKILL);
# prints their pids, then waits to be killed or leaves its block.
SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from tasks.lifeline import lifeline

    def body():
        child = subprocess.Popen(["sleep", "600"])
        stubborn = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"],
            stdout=subprocess.PIPE, text=True)
        stubborn.stdout.readline()
        print(child.pid, stubborn.pid, flush=True)
        time.sleep(float(sys.argv[2]))

    if sys.argv[1] == "watched":
        with lifeline():
            body()
    else:
        body()
""")


def _start(mode: str, linger: float) -> tuple[subprocess.Popen, list[psutil.Process]]:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(linger)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT}, start_new_session=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2, "the script did not start its children"
    time.sleep(2 * lifeline.POLL_S + 0.5)  # the watcher has recorded them
    return proc, [psutil.Process(p) for p in pids]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _cleanup(children: list[psutil.Process]) -> None:
    for p in children:
        if _alive(p):
            p.kill()


@pytest.mark.parametrize("watched", [True, False], ids=["with_lifeline", "without_lifeline_control"])
def test_a_sigkilled_process_leaves_nothing_running(watched):
    proc, children = _start("watched" if watched else "bare", linger=600)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + lifeline.TERM_GRACE_S + 2  # SIGTERM, grace, SIGKILL
        while any(_alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [p.pid for p in children if _alive(p)]
        if watched:
            assert not left, f"processes of the killed process survived: {left}"
        else:  # the control: without the watcher the orphans live on, which is what the test would miss
            assert len(left) == 2
    finally:
        _cleanup(children)


def test_leaving_the_block_normally_touches_nothing():
    proc, children = _start("watched", linger=0)
    try:
        assert proc.wait(30) == 0
        time.sleep(lifeline.POLL_S + 1)
        assert all(_alive(p) for p in children), "the watcher killed the children of a process that left normally"
    finally:
        _cleanup(children)


def test_job_lines_keep_the_set_of_jobs_to_stop():
    jobs: dict[str, str] = {}
    assert not lifeline.apply_line("JOB rlhf-sft-1 http://127.0.0.1:8265", jobs)
    assert not lifeline.apply_line("JOB rlhf-rm-2 http://10.0.0.1:8265", jobs)
    assert not lifeline.apply_line("DONE rlhf-sft-1", jobs)
    assert jobs == {"rlhf-rm-2": "http://10.0.0.1:8265"}
    assert lifeline.apply_line(lifeline.BYE, jobs)


def test_a_reused_pid_is_never_signalled():
    sleeper = subprocess.Popen(["sleep", "600"])
    try:
        started = psutil.Process(sleeper.pid).create_time()
        assert lifeline.terminate({sleeper.pid: started - 100.0}, grace_s=0.5) == []  # another process's start
        assert sleeper.poll() is None
        assert lifeline.terminate({sleeper.pid: started}, grace_s=5) == [sleeper.pid]
        assert sleeper.poll() is not None, "the recorded process was not ended"
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
