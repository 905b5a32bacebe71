"""rlhf_core/infra/heap.py: the `rlhf` process freezes its heap once a stage has started and when the
command ends; a process that only calls the code (this test runner) keeps its collector as it was."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

from rlhf_core.infra import heap

REPO = Path(__file__).resolve().parents[2]


def test_settle_freezes_only_in_a_process_that_ends_with_its_command():
    before = gc.get_freeze_count()
    heap.settle()
    assert gc.get_freeze_count() == before, "settle froze the heap of a process that is not the command's"

    code = ("import gc; from rlhf_core.infra import heap; keep = [[i] for i in range(50_000)]; heap.own_process(); "
            "heap.settle(); print(gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert int(out.stdout) >= 50_000


def test_the_rlhf_entry_point_freezes_the_heap_before_the_interpreter_exits():
    """What the last collector pass would scan is frozen by the time the exit handlers run."""
    code = ("import atexit, gc, sys\n"
            "import rlhf_core.cli as cli\n"
            "atexit.register(lambda: print('frozen', gc.get_freeze_count(), flush=True))\n"
            "sys.argv = ['rlhf', 'prune', '--keep_last', '-1']\n"  # fails fast: exit 2
            "cli.entry()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "--keep_last must be >= 0" in out.stderr
    frozen = int(out.stdout.split("frozen", 1)[1])
    assert frozen > 10_000, out.stdout


def test_full_passes_are_rarer_only_while_the_command_starts():
    code = ("import gc; from rlhf_core.infra import heap; own = gc.get_threshold(); heap.own_process(); "
            "start = gc.get_threshold(); heap.settle(); print(own[2], start[2], gc.get_threshold() == own)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.split() == ["10", str(heap.START_FULL_PASS_EVERY), "True"]
    assert gc.get_threshold()[2] == 10  # this process never owned: untouched
