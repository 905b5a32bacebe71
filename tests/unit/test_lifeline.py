"""orchestration/lifeline.py: the children of a process that dies (SIGKILL) are ended by its watcher; a
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

from orchestration import lifeline
from rlhf_core.infra.owner import start_time

ROOT = str(Path(__file__).resolve().parents[2])

# A flow-like process: a child, and a grandchild that ignores SIGTERM (it needs the SIGKILL);
# prints their pids, then waits to be killed or leaves its block.
SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from orchestration.lifeline import lifeline

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
    return proc, [psutil.Process(p) for p in pids]


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def test_a_sigkilled_process_leaves_nothing_running_and_one_that_leaves_normally_keeps_its_children():
    """Three at once: a watched process SIGKILLed (its children end, the stubborn one by SIGKILL),
    an unwatched one SIGKILLed (the control: its orphans live on, which is what would go unseen),
    and a watched one that leaves its block normally (the watcher touches nothing of it)."""
    killed, control, leaving = _start("watched", 600), _start("bare", 600), _start("watched", 0)
    children = killed[1] + control[1] + leaving[1]
    try:
        time.sleep(2 * lifeline.POLL_S + 0.5)  # the watchers have recorded the children
        for proc, _ in (killed, control):
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        assert leaving[0].wait(30) == 0
        deadline = time.monotonic() + lifeline.TERM_GRACE_S + 3  # SIGTERM, the grace, SIGKILL
        while any(_alive(p) for p in killed[1]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p.pid for p in killed[1] if _alive(p)], "processes of the killed process survived"
        assert all(_alive(p) for p in control[1]), "the control's orphans ended without a watcher?"
        assert all(_alive(p) for p in leaving[1]), "the watcher killed the children of a process that left normally"
    finally:
        for p in children:
            if _alive(p):
                p.kill()


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
        started = start_time(sleeper.pid)
        assert lifeline.terminate({sleeper.pid: str(int(started) - 100)}, grace_s=0.5) == []  # another's start
        assert sleeper.poll() is None
        assert lifeline.terminate({sleeper.pid: started}, grace_s=5) == [sleeper.pid]
        assert sleeper.poll() is not None, "the recorded process was not ended"
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
