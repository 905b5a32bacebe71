"""Python's cyclic garbage collector in a command's own process.

A stage holds ~650,000 tracked objects once its libraries are imported. `settle()` (stage started)
and the CLI's `entry()` (command finished) `gc.freeze()` them, so later full passes and the exit scan
skip them; cycles made before a freeze stay until exit. Only after `own_process()` (the `rlhf` entry
point): a test runner or notebook running a command in-process keeps its collector as it was.
"""

from __future__ import annotations

import gc

_OWNED = False


def own_process() -> None:
    """This process ends when the command does: `settle` may freeze its heap."""
    global _OWNED
    _OWNED = True


def settle() -> None:
    """`gc.freeze()` the objects alive now; nothing unless `own_process()`."""
    if _OWNED:
        gc.freeze()
