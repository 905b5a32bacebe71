"""Python's cyclic garbage collector in a command's own process.

A stage holds ~650,000 tracked objects once its libraries are imported. `settle()` (stage started)
and the CLI's `entry()` (command finished) `gc.freeze()` them, so later full passes and the exit scan
skip them; cycles made before a freeze stay until exit. Only after `own_process()` (the `rlhf` entry
point): a test runner or notebook running a command in-process keeps its collector as it was.
Until the first `settle()`, full passes are rarer (`own_process`): the start imports, and creates
little garbage.
"""

from __future__ import annotations

import gc

_OWNED = False
_THRESHOLDS: tuple[int, int, int] | None = None  # the collector's own, while the start's are in force
START_FULL_PASS_EVERY = 1000  # second-generation passes per full pass while the command starts (CPython: 10)


def own_process() -> None:
    """This process ends when the command does: `settle` may freeze its heap. Until it does, the
    heap is mostly modules being imported, which no full pass frees: full passes come 100x less often
    (a stage's start did seven, 0.6 s of its 5 s on a 2-core AMD EPYC, Zen 4 class; benchmarks/README.md,
    "Start-up")."""
    global _OWNED, _THRESHOLDS
    _OWNED = True
    if _THRESHOLDS is None:
        _THRESHOLDS = gc.get_threshold()
        first, second, full = _THRESHOLDS
        gc.set_threshold(first, second, max(full, START_FULL_PASS_EVERY))


def settle() -> None:
    """`gc.freeze()` the objects alive now, and the collector's own thresholds back; nothing unless
    `own_process()`."""
    global _THRESHOLDS
    if _OWNED:
        gc.freeze()
        if _THRESHOLDS is not None:
            gc.set_threshold(*_THRESHOLDS)
            _THRESHOLDS = None
