"""Calling an agent's environment (or a whole agent episode) with a deadline, and reading what it
answers: shared by the environment loop (`rl/agents.py`) and agents served over HTTP
(`rl/served_agents.py`).

The coroutines run on a few event loops in daemon threads (`EventLoops`); call `k` of a batch on
loop `k % size`. One that misses its deadline fails with `EnvFailure`; one whose thread is blocked
by synchronous code cannot be interrupted: its loop is abandoned (stopped once the code returns)
and replaced, and the calls that shared it fail too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import math
import threading
from collections.abc import Awaitable, Callable

import torch

LOOPS = 8  # event loops the environments' coroutines share
GRACE_S = 5.0  # beyond the deadline: how long a blocked loop gets before it is abandoned


class AgentError(RuntimeError):
    """An environment that failed every episode of a batch."""


class EnvFailure(Exception):
    """An environment call that raised, returned something unusable or missed its deadline."""


async def call_env(fn: Callable, *args):
    out = fn(*args)
    return await out if inspect.isawaitable(out) else out


class EventLoops:
    """A few event loops in daemon threads; call `k` of a batch runs on loop `slot % size`."""

    def __init__(self, size: int = LOOPS):
        self.loops = [self._start() for _ in range(size)]

    @staticmethod
    def _start() -> asyncio.AbstractEventLoop:
        loop = asyncio.new_event_loop()
        # blocking work an environment hands to asyncio.to_thread (tools, HTTP calls): every episode at once
        loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(max_workers=64,
                                                                        thread_name_prefix="rlhf-agent-io"))
        threading.Thread(target=loop.run_forever, name="rlhf-agent-env", daemon=True).start()
        return loop

    def run(self, calls: list[tuple[int, Callable[[], Awaitable]]], timeout_s: float) -> list:
        """Each call's result, or an `EnvFailure` in its place."""
        futures = []
        for slot, make in calls:
            loop = self.loops[slot % len(self.loops)]
            futures.append(asyncio.run_coroutine_threadsafe(asyncio.wait_for(make(), timeout_s), loop))
        _, pending = concurrent.futures.wait(futures, timeout=timeout_s + GRACE_S)
        blocked = {slot % len(self.loops) for (slot, _), future in zip(calls, futures, strict=True)
                   if future in pending}
        for k in blocked:  # blocked by synchronous code: abandoned (stopped once it returns) for a fresh loop
            old, self.loops[k] = self.loops[k], self._start()
            old.call_soon_threadsafe(old.stop)
        out = []
        for future in futures:
            if future in pending:
                future.cancel()
                out.append(EnvFailure(f"no answer within {timeout_s:g} s (its thread was blocked)"))
                continue
            try:
                out.append(future.result())
            except TimeoutError:
                out.append(EnvFailure(f"no answer within {timeout_s:g} s"))
            except Exception as e:
                out.append(EnvFailure(f"{type(e).__name__}: {e}"))
        return out

    def close(self) -> None:
        for loop in self.loops:
            loop.call_soon_threadsafe(loop.stop)


def number(value, what: str) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise EnvFailure(f"{what} must be one number, got a tensor of shape {tuple(value.shape)}")
        value = value.item()
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise EnvFailure(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(out):
        raise EnvFailure(f"{what} must be finite, got {out}")
    return out


def extra_logs(logs) -> dict[str, float]:
    """The numbers of an environment's `extra_logs` (anything else is left out)."""
    out = {}
    for key, value in (logs.items() if isinstance(logs, dict) else ()):
        with contextlib.suppress(EnvFailure):
            out[str(key)] = number(value, f"extra_logs[{key!r}]")
    return out
