"""Run one stage as a Ray job: submit through the Jobs API, stream its log, stop it on the way out.

A stage task never trains in its own process. It submits the `rlhf` CLI as a Ray job, relays the
job's log lines to a callback (the Prefect task logger), and waits for a terminal status. Choices:

- Unique submission ids (`rlhf-<stage>-<8 hex>`), so a retry never collides with the attempt it
  replaces; the attempt's own job is stopped in `finally`, whatever ended the wait (failure,
  Prefect cancellation's TerminationSignal, Ctrl-C). An `atexit` hook stops any job still
  registered when the interpreter exits, so a crashed flow leaves no orphan jobs.
- Failures are typed by the job driver's exit code: 2 is the CLI's "configuration or data
  error" (retrying cannot help), anything else is an infrastructure failure worth a retry.
  Both carry the job's last log lines, so the task failure says what went wrong.
- The embedded default starts a local Ray with its dashboard (the Jobs API lives there) for the
  duration of a flow run and shuts it down after: on 127.0.0.1 with token authentication
  (`rlhf_core/local_ray.py`). With `RAY_ADDRESS` (the dashboard's `http://host:8265`) the same
  code submits to a real cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shlex
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rlhf_core.launch import FORWARDED_ENV
from rlhf_core.redaction import redact_text

EXIT_CONFIG_ERROR = 2  # rlhf_core.cli: configuration or data error
TAIL_LINES = 30
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


class StageJobError(RuntimeError):
    """A stage's Ray job did not succeed; `tail` holds its last log lines."""

    retryable = True

    def __init__(self, submission_id: str, status: str, exit_code: int | None, message: str, tail: list[str]):
        tail = [redact_text(line) for line in tail]  # the message becomes Prefect state and an MLflow tag
        self.submission_id, self.status, self.exit_code, self.tail = submission_id, status, exit_code, tail
        lines = "\n".join(f"  | {line}" for line in tail)
        super().__init__(f"Ray job {submission_id} {status} (exit code {exit_code}): {redact_text(message)}\n"
                         f"last log lines:\n{lines}")


class StageConfigError(StageJobError):
    """The job rejected its configuration or data (exit code 2): not retried."""

    retryable = False


@dataclass
class JobResult:
    submission_id: str
    seconds: float  # time the job itself ran (Ray's start -> end), for the overhead report


def job_command(args: list[str]) -> str:
    """The shell entrypoint for `rlhf <args>`.

    The job's shell runs on the cluster; a bare `python` there is whatever is first on PATH. On
    a local cluster we use this interpreter; on a remote one `RLHF_JOB_COMMAND` (default `rlhf`)
    names the command installed in the cluster's image.
    """
    prefix = os.environ.get("RLHF_JOB_COMMAND")
    if prefix is None:
        prefix = "rlhf" if os.environ.get("RAY_ADDRESS") else f"{shlex.quote(sys.executable)} -m rlhf_core.cli"
    return " ".join([prefix, *(shlex.quote(a) for a in args)])


def job_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for the job: the allow-listed settings of this process plus `extra` (never secrets)."""
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("RLHF_PROGRESS_SECONDS", "30")  # a progress line every 30 s unless the caller set one
    env.update(extra or {})
    return env


_ACTIVE: dict[str, object] = {}  # submission id -> client, for the atexit safety net
_ACTIVE_LOCK = threading.Lock()


@atexit.register
def _stop_orphans() -> None:
    with _ACTIVE_LOCK:
        leftovers = list(_ACTIVE.items())
    for submission_id, client in leftovers:
        with contextlib.suppress(Exception):
            client.stop_job(submission_id)


_LINE_SPLIT = re.compile(r"[\r\n]+")


class RayJobRunner:
    """Submits stage jobs to one cluster's Jobs API (`address`: the dashboard's http URL)."""

    def __init__(self, address: str, poll_seconds: float = 0.5, max_poll_seconds: float = 5.0):
        from ray.job_submission import JobSubmissionClient

        self.address = address
        self.client = JobSubmissionClient(address)
        self.poll_seconds, self.max_poll_seconds = poll_seconds, max_poll_seconds

    def run(self, stage: str, args: list[str], env: dict[str, str], log: Callable[[str], None],
            entrypoint_num_gpus: float | None = None) -> JobResult:
        """Run `rlhf <args>` as a job and wait; raise StageJobError / StageConfigError on failure."""
        submission_id = f"rlhf-{stage}-{uuid.uuid4().hex[:8]}"
        entrypoint = job_command(args)
        self._submit(entrypoint=entrypoint, submission_id=submission_id, runtime_env={"env_vars": env},
                     metadata={"rlhf_stage": stage}, entrypoint_num_gpus=entrypoint_num_gpus)
        with _ACTIVE_LOCK:
            _ACTIVE[submission_id] = self.client
        log(f"submitted Ray job {submission_id} to {self.address}: {entrypoint}")
        finished = False
        try:
            info, tail = self._wait(submission_id, log)
            finished = True
        finally:
            if not finished:
                self.stop(submission_id, log)
            with _ACTIVE_LOCK:
                _ACTIVE.pop(submission_id, None)
        status = str(getattr(info.status, "value", info.status))
        seconds = ((info.end_time or 0) - (info.start_time or 0)) / 1000.0
        if status == "SUCCEEDED":
            return JobResult(submission_id, seconds)
        error = StageConfigError if info.driver_exit_code == EXIT_CONFIG_ERROR else StageJobError
        raise error(submission_id, status, info.driver_exit_code, info.message or "", tail)

    def _submit(self, agent_wait_seconds: float = 60.0, **kwargs) -> None:
        # A cluster that has just started answers "No available agent" until its job agent is up.
        deadline = time.monotonic() + agent_wait_seconds
        while True:
            try:
                self.client.submit_job(**kwargs)
                return
            except RuntimeError as e:
                if "No available agent" not in str(e):
                    raise
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Ray at {self.address} has no job agent after {agent_wait_seconds:.0f}s. A local Ray's agent "
                        "listens on port 52365: is another Ray cluster running on this machine? Stop it, or point "
                        "RAY_ADDRESS at it.") from e
                time.sleep(1.0)

    def _wait(self, submission_id: str, log: Callable[[str], None]):
        """Relay the job's log lines until it ends. The status (small) is polled every
        `poll_seconds`, so the end of a job is seen at once. The Jobs API serves only the whole
        log, so the log is fetched less and less often (x1.5 from `poll_seconds` up to
        `max_poll_seconds`): a long job's growing log is not downloaded twice a second for hours.
        """
        log_delay = self.poll_seconds
        next_fetch = time.monotonic()
        printed = 0
        pending = ""
        tail: list[str] = []
        while True:
            info = self.client.get_job_info(submission_id)
            done = str(getattr(info.status, "value", info.status)) in TERMINAL
            if done or time.monotonic() >= next_fetch:
                text = self.client.get_job_logs(submission_id)
                next_fetch = time.monotonic() + log_delay
                log_delay = min(self.max_poll_seconds, log_delay * 1.5)
                if len(text) > printed:
                    pending += text[printed:]
                    printed = len(text)
                    *lines, pending = _LINE_SPLIT.split(pending)
                    for line in lines:
                        if line.strip():
                            log(line)
                            tail = (tail + [line])[-TAIL_LINES:]
            if done:
                if pending.strip():
                    log(pending)
                    tail = (tail + [pending])[-TAIL_LINES:]
                return info, tail
            time.sleep(self.poll_seconds)

    def stop(self, submission_id: str, log: Callable[[str], None] | None = None, timeout: float = 30.0) -> None:
        """Stop a job and wait (bounded) until Ray reports it terminal."""
        with contextlib.suppress(Exception):
            self.client.stop_job(submission_id)
            if log:
                log(f"stopping Ray job {submission_id}")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if str(self.client.get_job_status(submission_id).value) in TERMINAL:
                    return
                time.sleep(0.5)


@contextlib.contextmanager
def ray_cluster() -> Iterator[str]:
    """The Jobs API address: `RAY_ADDRESS`, or a local Ray with its dashboard for this block."""
    if os.environ.get("RAY_ADDRESS"):
        yield os.environ["RAY_ADDRESS"]
        return
    import ray

    from rlhf_core.launch import prepare_environment
    from rlhf_core.local_ray import init_local

    prepare_environment()  # state dir, compiled-op cache: the local cluster's processes inherit them
    context = init_local(include_dashboard=True, dashboard_host="127.0.0.1", num_cpus=os.cpu_count(),
                         configure_logging=False, log_to_driver=False)
    try:
        yield "http://" + context.dashboard_url
    finally:
        ray.shutdown()
