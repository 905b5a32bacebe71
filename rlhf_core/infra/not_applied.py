"""Flags whose feature exists only on some hardware (flash-attention and Liger kernels, DeepSpeed's
CUDA sleep, DeepCompile): on a machine without it the stage runs on, and says once, in one line on
stderr, what was not applied and what runs instead. The line starts with `PREFIX`, so a user (or a
test) finds every such line of a run with one grep.
"""

from __future__ import annotations

import sys

PREFIX = "not applied here:"
_SAID: set[str] = set()


def say_once(line: str) -> str:
    """Print `line` on stderr, once per process (a config validated again, a second model loaded); returns it."""
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr, flush=True)
    return line


def not_applied(flag: str, value, needs: str, instead: str) -> str:
    """`not applied here: --flag value needs <needs>; <instead>`, said once (`say_once`)."""
    return say_once(f"{PREFIX} --{flag} {value} needs {needs}; {instead}")
