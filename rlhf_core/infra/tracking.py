"""MLflow tracking for training stages, from rank 0 only.

Embedded default: a SQLite store (the model registry needs a database) and an artifact folder
under the project's state directory. `MLFLOW_TRACKING_URI` points at a server instead. An
orchestrator hands a pre-created run through `MLFLOW_RUN_ID`; a parent pipeline run through
`--mlflow_parent_run_id`.

Everything a Tracker sends (params, tags, text artifacts) passes `rlhf_core.infra.redaction` first.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from rlhf_core.infra.redaction import REDACTED, redact, redact_text
from rlhf_core.infra.settings import tracking_uri

__all__ = ["REDACTED", "AttemptAbandoned", "redact", "redact_params", "Tracker"]


STATUS_READ_S = 2.0  # how long a checkpoint waits to learn whether the attempt was given up


class AttemptAbandoned(RuntimeError):
    """The stage's run was ended by another process while this one ran: its orchestrator gave this
    attempt up (e.g. its Ray cluster stopped answering) and retries the stage elsewhere, so this
    process must neither publish nor record its output."""


def redact_params(values: dict, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into MLflow params (strings), secrets redacted."""
    flat: dict[str, str] = {}
    for key, value in redact(values).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(redact_params(value, prefix=f"{name}."))
        else:
            flat[name] = str(value.value if hasattr(value, "value") else value)[:6000]
    return flat


TEXT_ARTIFACTS = {".json", ".yaml", ".yml", ".md", ".txt", ".log"}
FLUSH_SECONDS = 10.0  # buffered metrics reach MLflow at least this often while a stage trains
METRICS_PER_BATCH = 1000  # MLflow's limit for one log_batch
MAX_BACKOFF_SECONDS = 60.0  # the longest pause between two tries of a store that does not answer
FAILED_STATUS_WAIT_S = 10.0  # a failing stage tries this long to mark its run FAILED (its own error matters more)


class MetricQueue:
    """Metric values on their way to the store: never raises into the caller.

    `add` appends and a background thread sends batches every `FLUSH_SECONDS` (a write per step
    would cost a SQLite transaction per step). A failed send keeps the values, warns once per outage
    and retries with backoff (up to `MAX_BACKOFF_SECONDS`), held values first. Beyond `capacity` the
    oldest are dropped (counted in `dropped`). `drain` sends everything from the caller's thread.
    """

    def __init__(self, send, capacity: int, store: str):
        import collections

        self._send, self.capacity, self.store = send, capacity, store
        self._queue: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._in_flight = 0
        self.dropped = 0
        self.failing: str | None = None  # the last error while the store is away; None when it answers
        self._warned_full = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue) + self._in_flight

    def add(self, metrics: list) -> None:
        import threading

        with self._lock:
            self._queue.extend(metrics)
            self._trim()
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="rlhf-metrics", daemon=True)
                self._thread.start()

    def wake(self) -> None:
        self._wake.set()

    def _trim(self) -> None:  # under the lock
        over = len(self._queue) - self.capacity
        if over <= 0:
            return
        for _ in range(over):
            self._queue.popleft()
        self.dropped += over
        if not self._warned_full:
            self._warned_full = True
            _warn(f"more than {self.capacity} metric values are waiting for MLflow at {self.store} "
                  "(RLHF_METRICS_BUFFER): the oldest are dropped; training goes on")

    def _send_batch(self) -> bool | None:
        """Send the oldest batch; True sent, False failed (kept), None nothing to send."""
        with self._lock:
            batch = [self._queue.popleft() for _ in range(min(METRICS_PER_BATCH, len(self._queue)))]
            self._in_flight += len(batch)
        if not batch:
            return None
        try:
            self._send(batch)
        except Exception as e:  # noqa: BLE001 - whatever the store says, training goes on
            with self._lock:
                self._in_flight -= len(batch)
                self._queue.extendleft(reversed(batch))
                self._trim()
                held = len(self._queue)
                first = self.failing is None
                self.failing = f"{type(e).__name__}: {redact_text(str(e))[:300]}"
                self._changed.notify_all()
            if first:
                _warn(f"MLflow at {self.store} did not take metrics ({self.failing}); training goes on: "
                      f"{held} values are held (at most {self.capacity}, RLHF_METRICS_BUFFER) and retried with backoff")
            return False
        with self._lock:
            self._in_flight -= len(batch)
            recovered = self.failing is not None
            self.failing = None
            self._warned_full = False
            self._changed.notify_all()
        if recovered:
            print(f"rlhf: MLflow at {self.store} answers again; sending the held metrics"
                  + (f" ({self.dropped} of the oldest were dropped)" if self.dropped else ""), file=sys.stderr,
                  flush=True)
        return True

    def _run(self) -> None:
        delay = FLUSH_SECONDS
        while not self._stopped:
            self._wake.wait(delay)
            self._wake.clear()
            if self._stopped:
                return
            while (sent := self._send_batch()) is True:
                pass
            delay = FLUSH_SECONDS if sent is None else min(max(1.0, delay * 2), MAX_BACKOFF_SECONDS)

    def drain(self, seconds: float) -> bool:
        """Send everything held, retrying with backoff for up to `seconds`; True when nothing is left."""
        deadline = time.monotonic() + seconds
        delay = 0.25
        while True:
            sent = self._send_batch()
            if sent is True:
                delay = 0.25
                continue
            if sent is None:
                with self._lock:
                    while self._in_flight and time.monotonic() < deadline:  # the thread's batch, in flight
                        self._changed.wait(min(1.0, max(0.0, deadline - time.monotonic())))
                    if not self._queue and not self._in_flight:
                        return True
                    if self._in_flight:  # the deadline passed with the thread's batch still out
                        return False
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(delay * 2, 5.0)

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()


def _warn(message: str) -> None:
    print(f"rlhf: warning: {message}", file=sys.stderr, flush=True)


class Tracker:
    """Rank-0 MLflow run for one stage; every method is a no-op on other ranks or when disabled.

    Faults (bounds in `rlhf_core/infra/reachability.py`): opening the run waits at most
    `RLHF_STORE_CHECK_S`; metrics never raise into training; recording the output (`await_store`,
    `set_tags`, `log_artifact`, `finish`) waits at most `RLHF_STORE_WAIT_S`, then `StoreUnavailable`,
    and an output published before its record failed is withdrawn (`storage.withdraw`). Every call
    names its run (no fluent active run), so a background thread can send. The calls go to MLflow in
    this process (`mlflow_ops.DirectOps`), or in the `rlhf` command to its MLflow process
    (`mlflow_side`), whose failures come back classified the same way.
    """

    def __init__(self, enabled: bool, experiment: str, run_name: str | None, parent_run_id: str | None,
                 tags: dict[str, str] | None = None):
        self.enabled = enabled
        self.run_id: str | None = None
        self.sinks = None  # `loggers.MetricSinks`: W&B and TensorBoard, fed the same metrics (`attach_sinks`)
        self._published: tuple[str, str] | None = None  # (uri, stage) published before the run finished
        if not enabled:
            return
        import uuid

        from rlhf_core.infra import mlflow_side
        from rlhf_core.infra.owner import owner_tag
        from rlhf_core.infra.reachability import bound_mlflow_requests, metrics_buffer, store_check_s

        bound_mlflow_requests()
        uri = tracking_uri()
        self.store = redact_text(uri)
        if (ops := mlflow_side.ops_for(uri)) is None:
            from rlhf_core.infra.mlflow_ops import DirectOps

            ops = DirectOps(uri)
        self.ops = ops
        self.metrics = MetricQueue(self._send_metrics, metrics_buffer(), self.store)
        all_tags = dict(tags or {})
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        all_tags = {k: redact_text(str(v)) for k, v in all_tags.items()}
        given = os.environ.get("MLFLOW_RUN_ID") or None
        request, owner = uuid.uuid4().hex, owner_tag()  # one creation however often it is tried; this process owns it
        self.run_id = self._retry("open the stage's run",
                                  lambda: ops.open_run(experiment, run_name, all_tags, given, request, owner),
                                  store_check_s(), "RLHF_STORE_CHECK_S")

    def _retry(self, what: str, call, seconds: float | None = None, setting: str = "RLHF_STORE_WAIT_S"):
        """`call()`, retried with backoff for up to `seconds` (RLHF_STORE_WAIT_S), then StoreUnavailable."""
        from rlhf_core.infra.reachability import retry, store_wait_s

        return retry(call, what, self.store, store_wait_s() if seconds is None else seconds, setting)

    def _record(self, what: str, call) -> None:
        """A call that records the stage's output: on failure a published output is withdrawn first."""
        from rlhf_core.infra.reachability import StoreUnavailable

        try:
            self._retry(what, call)
        except StoreUnavailable as e:
            raise StoreUnavailable(f"{e}{self._withdraw()}") from None

    def _withdraw(self) -> str:
        if self._published is None:
            return ""
        from rlhf_core.infra import storage

        uri, stage = self._published
        self._published = None
        try:
            storage.withdraw(uri, stage)
        except Exception as e:  # noqa: BLE001 - say so; the stage fails either way
            return (f"; the output at {redact_text(uri)} was published but could not be withdrawn ({type(e).__name__}: "
                    f"{redact_text(str(e))}): its stage.json names a run that did not finish")
        return (f"; the output published at {redact_text(uri)} was withdrawn (its stage.json removed, marked unfinished: "
                "a retry replaces it)")

    def log_params(self, params: dict) -> None:
        if self.enabled:
            items = list(redact_params(params).items())
            for i in range(0, len(items), 100):
                batch = items[i : i + 100]
                self._retry("take the stage's params", lambda batch=batch: self.ops.log_batch(self.run_id, params=batch))

    def attach_sinks(self, sinks) -> None:
        """Send every metric to `sinks` too (`loggers.MetricSinks`), MLflow on or off; closed by `finish`."""
        self.sinks = sinks

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Held and sent in the background (`MetricQueue`); never raises, never waits for the store."""
        if self.sinks is not None and metrics:
            self.sinks.log(metrics, step)
        if self.enabled and metrics:
            now = int(time.time() * 1000)
            self.metrics.add([(k, float(v), now, step) for k, v in metrics.items()])

    def _send_metrics(self, batch: list) -> None:
        self.ops.log_batch(self.run_id, metrics=batch)

    def flush(self, seconds: float | None = None) -> bool:
        """Send the held metrics now (waiting up to `seconds`, default RLHF_STORE_WAIT_S); True when all went."""
        if not self.enabled:
            return True
        from rlhf_core.infra.reachability import store_wait_s

        return self.metrics.drain(store_wait_s() if seconds is None else seconds)

    def await_store(self, doing: str = "") -> None:
        """Before the output is published: every held metric sent, waiting up to RLHF_STORE_WAIT_S for the
        store; StoreUnavailable (nothing published yet) when it stays away. AttemptAbandoned when the
        run is no longer RUNNING: an orchestrator that gave this attempt up marked it ended."""
        if not self.enabled:
            return
        from rlhf_core.infra.reachability import StoreUnavailable, store_wait_s

        seconds = store_wait_s()
        if not self.metrics.drain(seconds):
            raise StoreUnavailable(f"MLflow at {self.store} did not answer within {seconds:g} s (RLHF_STORE_WAIT_S; "
                                   f"last error: {self.metrics.failing}) when the stage had to record its output; "
                                   f"{doing or 'the output was not published'}; an unreachable store is an "
                                   "infrastructure failure (exit 1): a pipeline retries the stage")
        status = self._retry("read the stage's run", lambda: self.ops.run_status(self.run_id))
        if status != "RUNNING":
            raise self.abandoned(status, doing or "nothing was published")

    def ended_elsewhere(self, wait_s: float = STATUS_READ_S) -> str | None:
        """The run's status when another process ended it (its orchestrator gave this attempt up), else
        None: RUNNING, tracking off, or the store not answering within `wait_s` (training goes on; the
        check before publishing waits for the store). Asked before each checkpoint, so an abandoned
        attempt stops writing into the checkpoint folder its retry resumes from."""
        if not self.enabled:
            return None
        answer: dict[str, str] = {}

        def read() -> None:
            try:
                answer["status"] = self.ops.run_status(self.run_id)
            except Exception:  # noqa: BLE001 - the store away: not known now, never a reason to stop training
                pass

        reading = threading.Thread(target=read, name="rlhf-run-status", daemon=True)
        reading.start()
        reading.join(wait_s)  # a store that hangs delays a checkpoint this long at most
        status = answer.get("status")
        return None if status in (None, "RUNNING") else status

    def abandoned(self, status: str, doing: str) -> AttemptAbandoned:
        """The error for a run another process ended with `status`, saying `doing`; from here on this
        process never withdraws the output it published (a retry may own it by now)."""
        self._published = None  # a retry may own that output by now: never withdraw it from here
        return AttemptAbandoned(f"the stage's MLflow run {self.run_id} was marked {status} by another process while "
                                "this one ran: its orchestrator gave this attempt up (for example when its Ray "
                                f"cluster stopped answering) and retries the stage; {doing}")

    def stop_if_ended_elsewhere(self, doing: str) -> None:
        """AttemptAbandoned (saying `doing`) when another process ended the run (`ended_elsewhere`)."""
        status = self.ended_elsewhere()
        if status is not None:
            raise self.abandoned(status, doing)

    def published(self, uri: str, stage: str) -> None:
        """The output is at `uri` now; withdrawn again if its record fails before the run finishes."""
        if self.enabled:
            self._published = (uri, stage)

    def log_datasets(self, described: list[dict], context: str) -> None:
        if not self.enabled:
            return
        inputs = []  # (name, digest, local path or None, hub URL or None, context): mlflow_ops.DirectOps.log_inputs
        for d in described:
            spec = redact_text(d["spec"])
            local = Path(d["path"]).exists()
            inputs.append((f"{spec}[{d['split']}]", d["digest"][-32:], redact_text(d["path"]) if local else None,
                           None if local else f"https://huggingface.co/datasets/{spec}", context))
        if inputs:
            self._retry("take the stage's datasets", lambda: self.ops.log_inputs(self.run_id, inputs))

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.enabled:
            batch = [(k, redact_text(str(v))) for k, v in tags.items()]
            self._record("take the stage's tags", lambda: self.ops.log_batch(self.run_id, tags=batch))

    def log_artifact(self, path: str) -> None:
        """Log a file; a text file (json, yaml, md, txt, log) is logged with its credentials redacted."""
        if self.enabled:
            source = Path(path)
            if source.suffix not in TEXT_ARTIFACTS:
                self._record(f"take the artifact {source.name}", lambda: self.ops.log_artifact(self.run_id, path))
                return
            text = redact_text(source.read_text(encoding="utf-8"))
            self._record(f"take the artifact {source.name}",
                         lambda: self.ops.log_text(self.run_id, text, source.name))

    def finish(self, status: str = "FINISHED") -> None:
        """End the run. FINISHED: metrics and status recorded within RLHF_STORE_WAIT_S, else
        StoreUnavailable (a published output withdrawn). Any other status: a published output is
        withdrawn and the status tried for a few seconds; never raises (the stage's own error matters)."""
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None
        if not self.enabled:
            return
        from rlhf_core.infra.reachability import StoreUnavailable, store_wait_s

        self.metrics.stop()
        if os.environ.get("MLFLOW_RUN_ID") == self.run_id:
            os.environ.pop("MLFLOW_RUN_ID")  # as mlflow.end_run does: a later run in this process is its own
        if status != "FINISHED":
            withdrawn = self._withdraw()
            if withdrawn:
                _warn(f"the stage failed after publishing its output{withdrawn}")
            seconds = min(FAILED_STATUS_WAIT_S, store_wait_s())
            self.metrics.drain(seconds)  # a crashed stage keeps what it measured, if the store is there
            try:
                self._retry(f"mark the run {status}", lambda: self.ops.set_terminated(self.run_id, status), seconds)
            except Exception as e:  # noqa: BLE001 - a refusal too (e.g. INVALID_STATE): never hide the stage's error
                _warn(str(e) if isinstance(e, StoreUnavailable)
                      else f"MLflow at {self.store} did not mark the run {status}: {type(e).__name__}: "
                           f"{redact_text(str(e))[:300]}")
            return
        try:
            self.await_store("the stage's run was not marked FINISHED")
        except StoreUnavailable as e:
            raise StoreUnavailable(f"{e}{self._withdraw()}") from None
        if self.metrics.dropped:
            self.set_tags({"rlhf.metrics_dropped": str(self.metrics.dropped)})
        self._record("mark the run FINISHED", lambda: self.ops.set_terminated(self.run_id, status))
        self._published = None
