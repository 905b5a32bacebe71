"""Rollouts sampled ahead of training (`--train.async_enable`, `--train.async_queue_size`).

With a depth of `q`, the batch of step `b` is sampled by the policy of `max(0, b - q)` actor
updates: while the actor trains step `t`, the engines (still holding the weights of update `t`)
sample the batches up to `t + q` in a background thread, and the weight sync after step `t`
waits for them. So generation overlaps training, and the staleness of every batch (the actor
updates between its sampling and its training) is fixed by the schedule, never by timing: a run
is reproducible, and a resumed run equal to an uninterrupted one. Depth 0 is the synchronous
loop: each batch is sampled at its step, by the current policy.

OpenRLHF's asynchronous trainer lets the generator run free against a bounded queue and locks
weight updates out of an engine call in progress, so there the staleness is up to the queue's
size and depends on timing; here it is exactly the queue's size (after the first `q` steps), the
same overlap with one more wait: a weight sync never starts before the batches it would make
staler are sampled.

The batches waiting to be trained are part of the RL checkpoint (`state_dict`): their policy
is gone once the actor has moved on, so a resume trains on them instead of sampling them again.

With `partial` (`--train.partial_rollout_enable`, `rl/partial.py`) the weight sync does not wait
for the batches ahead: `paused()` stops the background sampling at its next `yield_point` (the
end of a generation segment), the sync runs, and sampling goes on with the new weights.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field


@dataclass
class Rollout:
    """One step's samples, their statistics, the seconds spent generating and scoring them, and the
    policy version (actor updates) that sampled them."""

    samples: list
    stats: dict[str, float]
    times: dict[str, float]
    version: int
    extra: dict = field(default_factory=dict)


class RolloutsAhead:
    """`produce(step)`: the rollout of `step`, sampled by the engines' current weights; called in
    step order, from one thread at a time. `depth`: how many batches ahead of the training step."""

    def __init__(self, produce: Callable[[int], Rollout], depth: int, partial: bool = False):
        self.produce, self.depth, self.partial = produce, depth, partial
        self._pause, self._paused, self._resume = threading.Event(), threading.Event(), threading.Event()
        self.ready: dict[int, Rollout] = {}
        self.next_step = 0  # the first step whose batch is neither ready nor being sampled
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def take(self, step: int) -> Rollout:
        """The batch of `step`: sampled ahead, or (at the start, or in the synchronous loop) now."""
        self.wait()
        if step not in self.ready:
            self.next_step = max(self.next_step, step)
            self._produce_until(step + 1)
        return self.ready.pop(step)

    def start(self, step: int, last_step: int) -> None:
        """Sample the batches of the steps after `step`, up to `step + depth` (none at or past
        `last_step`), in the background while `step` trains."""
        until = min(step + self.depth, last_step - 1) + 1
        if self.depth == 0 or self.next_step >= until:
            return
        self.wait()
        self._error = None
        self._thread = threading.Thread(target=self._background, args=(until,), name="rollouts-ahead", daemon=True)
        self._thread.start()

    def wait(self) -> float:
        """Block until the background sampling is done (before a weight sync, an evaluation or a
        checkpoint); re-raise what it raised. Returns the seconds waited."""
        if self._thread is None:
            return 0.0
        t = time.perf_counter()
        self._thread.join()
        self._thread = None
        waited = time.perf_counter() - t
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        return waited

    def yield_point(self) -> None:
        """Called by `produce` between generation segments: where a pending `paused()` takes effect."""
        if self._pause.is_set() and threading.current_thread() is self._thread:
            self._paused.set()
            self._resume.wait()

    @contextlib.contextmanager
    def held_for_sync(self) -> Iterator[None]:
        """For a weight sync: the background sampling done, or with `partial` held at its next
        segment end (and going on with the new weights after)."""
        if self.partial:
            with self.paused():
                yield
        else:
            self.wait()
            yield

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The background sampling held at its next `yield_point` (or finished) for the duration."""
        thread = self._thread
        if thread is None:
            yield
            return
        self._resume.clear()
        self._pause.set()
        try:
            while not self._paused.wait(0.01) and thread.is_alive():
                pass
            yield
        finally:
            self._pause.clear()
            self._paused.clear()
            self._resume.set()

    def abandon(self) -> None:
        """After a failure in training: wait for the background sampling to end (each engine call
        has its deadline), keeping nothing it raised: the training's error is the one to report."""
        try:
            self.wait()
        except BaseException:  # noqa: BLE001 (the failure in training is already on its way up)
            pass

    def _background(self, until: int) -> None:
        try:
            self._produce_until(until)
        except BaseException as error:  # handed to the training thread by `wait`
            self._error = error

    def _produce_until(self, until: int) -> None:
        while self.next_step < until:
            self.ready[self.next_step] = self.produce(self.next_step)
            self.next_step += 1

    # -- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self._thread is not None:
            raise RuntimeError("rollouts ahead: a checkpoint while a batch is being sampled would miss it")
        return {"ready": dict(self.ready), "next_step": self.next_step}

    def load_state_dict(self, state: dict | None, step: int) -> None:
        """Restore the batches a checkpoint of `step` kept; without any (a checkpoint of the
        synchronous loop), sampling continues from `step`."""
        state = state or {}
        self.ready = {k: v for k, v in state.get("ready", {}).items() if k >= step}
        self.next_step = max([step, *[k + 1 for k in self.ready]])
