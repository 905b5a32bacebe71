"""Run one stage as a Ray job: submit through the Jobs API, stream its log, stop it on the way out.

A stage task submits the `rlhf` CLI as a Ray job, relays its log lines (to the Prefect task
logger) and waits for a terminal status.

- Submission ids are unique (`rlhf-<stage>-<8 hex>`), so a retry never collides; the attempt's job
  is stopped in `finally` whatever ended the wait, and an `atexit` hook stops any job left.
- Exit code 2 is the CLI's configuration or data error (`StageConfigError`, not retried); anything
  else is an infrastructure failure worth a retry. Both carry the job's last log lines.
- A silent cluster never hangs a stage: every Jobs API request has a deadline, and once every
  request has failed for `RLHF_RAY_UNREACHABLE_S` (60 s) the attempt fails with the retryable
  `ClusterUnreachable`. Jobs get the same bound as Ray's GCS reconnect timeout, so they exit too.
- The embedded default starts a local Ray (127.0.0.1, token auth: `rlhf_core/distributed/local_ray.py`)
  for the flow run. Its driver is a keeper process, not the flow: Ray terminates a driver whose GCS
  is gone, and the flow must outlive its cluster to fail the stage cleanly. A cluster found dead
  before a job is replaced, so a retry can complete. With `RAY_ADDRESS` the jobs go to that cluster.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from rlhf_core.distributed.cluster import RANKS_ON_RAY_ENV, check_no_other_checkout_here, forwarded_env
from rlhf_core.infra.redaction import redact_text
from rlhf_core.infra.settings import EXIT_CONFIG, env_number

TAIL_LINES = 30
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
UNREACHABLE_ENV = "RLHF_RAY_UNREACHABLE_S"
DEFAULT_UNREACHABLE_S = 60.0
REQUEST_TIMEOUT_S = 30.0  # one request to the Jobs API (at most the bound); a hung server answers nothing
GCS_RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"  # Ray's own (src/ray/common/ray_config_def.h)


def unreachable_s() -> float:
    """How long the Jobs API may fail every poll before the attempt fails (`RLHF_RAY_UNREACHABLE_S`)."""
    return env_number(UNREACHABLE_ENV, DEFAULT_UNREACHABLE_S)


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


class ClusterUnreachable(StageJobError):
    """The cluster's Jobs API (the dashboard, or the job agent behind it) failed every request for
    `RLHF_RAY_UNREACHABLE_S` seconds: the cluster is down or cut off. Retried."""

    def __init__(self, submission_id: str, address: str, seconds: float, bound: float, error: BaseException | None,
                 tail: list[str]):
        last = f"{type(error).__name__}: {error}" if error is not None else "no answer"
        super().__init__(submission_id, "UNREACHABLE", None,
                         f"the Ray cluster at {address} did not answer for {seconds:.0f} s ({UNREACHABLE_ENV}="
                         f"{bound:g}); the cluster or its job agent is down or cut off. Last error: {last}", tail)


class Reachability:
    """Bookkeeping of failed requests: how long the cluster has failed every one of them.

    `failed(error)` records one; `ok()` (any answer) starts over. `expired()` once failures have
    lasted `bound_s` seconds without an answer in between."""

    def __init__(self, bound_s: float, clock: Callable[[], float] | None = None):
        self.bound_s, self.clock = bound_s, clock or time.monotonic
        self.since: float | None = None
        self.failures = 0
        self.last_error: BaseException | None = None

    def ok(self) -> None:
        self.since, self.failures, self.last_error = None, 0, None

    def failed(self, error: BaseException, started: float | None = None) -> None:
        """A request that began at `started` (default: now) failed: unanswered time counts from there."""
        if self.since is None:
            self.since = self.clock() if started is None else started
        self.failures += 1
        self.last_error = error

    def seconds(self) -> float:
        return 0.0 if self.since is None else self.clock() - self.since

    def expired(self) -> bool:
        return self.since is not None and self.seconds() >= self.bound_s


def headline(message: str, tail: list[str]) -> str:
    """Ray's message for a failed job in one line, with the CLI's own `rlhf: error:` line when the
    log has one (what failed: the file and row, the rank that died). Ray appends a copy of the
    job's log (up to 20,000 characters) to its message; the tail carries the log instead, so a
    record that keeps only the end of the message still says what failed."""
    first = re.sub(r",?\s*last available logs.*$", "", message.strip().split("\n", 1)[0])
    cli = next((line.strip() for line in reversed(tail) if line.strip().startswith("rlhf: error:")), None)
    return f"{first}; {cli}" if cli else first


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
    """Environment for the job: `cluster.forwarded_env()` (never secrets) plus `extra`."""
    env = forwarded_env()
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("RLHF_PROGRESS_SECONDS", "30")  # a progress line every 30 s unless the caller set one
    if not os.environ.get("RAY_ADDRESS"):  # the flow's own local Ray, on this machine: one rank per role
        env.setdefault(RANKS_ON_RAY_ENV, "0")  # stays in the job's driver (`cluster.ranks_stay_in_driver`)
    # The job's driver and ranks exit once the cluster's GCS has been gone this long, instead of
    # reconnecting while nobody waits for them (Ray would allow 60 s, or what the cluster says).
    env.setdefault(GCS_RECONNECT_ENV, str(max(1, round(unreachable_s()))))
    env.update(extra or {})
    return env


_ACTIVE: dict[str, object] = {}  # submission id -> client, for the atexit safety net
_ACTIVE_LOCK = threading.Lock()
# Told (address, submission id) when a job on a cluster that outlives this process is submitted, and
# (None, submission id) once it is over: orchestration/lifeline.py listens, to stop the jobs of a flow
# process that dies without its `finally` or atexit. (A local cluster's jobs end with its processes.)
JOB_WATCHERS: list[Callable[[str | None, str], None]] = []


@atexit.register
def _stop_orphans() -> None:
    with _ACTIVE_LOCK:
        leftovers = list(_ACTIVE.items())
    for submission_id, client in leftovers:
        with contextlib.suppress(Exception):
            client.stop_job(submission_id)


def _track(submission_id: str, client, address: str) -> None:
    """A job that may run from now on (registered before its submission: an answer may be lost)."""
    with _ACTIVE_LOCK:
        _ACTIVE[submission_id] = client
    if local_cluster(address) is None:
        for watcher in list(JOB_WATCHERS):
            watcher(address, submission_id)


def _untrack(submission_id: str) -> None:
    with _ACTIVE_LOCK:
        _ACTIVE.pop(submission_id, None)
    for watcher in list(JOB_WATCHERS):
        watcher(None, submission_id)


_LINE_SPLIT = re.compile(r"[\r\n]+")


def request_timeout_s() -> float:
    """One request's deadline: REQUEST_TIMEOUT_S, or the unreachable bound when that is shorter."""
    return min(REQUEST_TIMEOUT_S, unreachable_s())


def timed_client(address: str, timeout_s: float | None = None):
    """A JobSubmissionClient whose every request has a deadline (Ray's own waits forever)."""
    from ray.job_submission import JobSubmissionClient

    timeout_s = timeout_s or request_timeout_s()

    class TimedClient(JobSubmissionClient):
        def _do_request(self, method, endpoint, **kwargs):
            kwargs.setdefault("timeout", timeout_s)
            return super()._do_request(method, endpoint, **kwargs)

    return TimedClient(address)


class RayJobRunner:
    """Submits stage jobs to one cluster's Jobs API (`address`: the dashboard's http URL).

    `address` may be the one `ray_cluster()` yielded for a local cluster: each `run` then checks
    that cluster first and starts a fresh one if it died (`live_address`)."""

    def __init__(self, address: str, poll_seconds: float = 0.5, max_poll_seconds: float = 5.0):
        self.address = address
        self.client = None  # connected in `run`, to the cluster serving `address` then
        self.poll_seconds, self.max_poll_seconds = poll_seconds, max_poll_seconds

    def run(self, stage: str, args: list[str], env: dict[str, str], log: Callable[[str], None],
            entrypoint_num_gpus: float | None = None) -> JobResult:
        """Run `rlhf <args>` as a job and wait; raise StageJobError / StageConfigError on failure
        (ClusterUnreachable when the cluster stopped answering)."""
        submission_id = f"rlhf-{stage}-{uuid.uuid4().hex[:8]}"
        self._connect(submission_id, log)
        entrypoint = job_command(args)
        _track(submission_id, self.client, self.address)
        finished = False
        try:
            self._submit(entrypoint=entrypoint, submission_id=submission_id, runtime_env={"env_vars": env},
                         metadata={"rlhf_stage": stage}, entrypoint_num_gpus=entrypoint_num_gpus)
            log(f"submitted Ray job {submission_id} to {self.address}: {entrypoint}")
            info, tail = self._wait(submission_id, log)
            finished = True
        finally:
            if not finished:
                self.stop(submission_id, log)
            _untrack(submission_id)
        status = str(getattr(info.status, "value", info.status))
        seconds = ((info.end_time or 0) - (info.start_time or 0)) / 1000.0
        if status == "SUCCEEDED":
            return JobResult(submission_id, seconds)
        error = StageConfigError if info.driver_exit_code == EXIT_CONFIG else StageJobError
        raise error(submission_id, status, info.driver_exit_code, headline(info.message or "", tail), tail)

    def _connect(self, submission_id: str, log: Callable[[str], None]) -> None:
        """A client for the cluster now serving `self.address` (a dead local one is replaced first)."""
        address = live_address(self.address, log)
        if self.client is not None and address == self.address:
            return
        self.address = address
        reach = Reachability(unreachable_s())
        while True:
            started = time.monotonic()
            try:
                self.client = timed_client(address)
                return
            except Exception as e:  # noqa: BLE001 - ConnectionError, a timeout, an HTTP error: all "no answer"
                reach.failed(e, started)
                if reach.expired():
                    raise ClusterUnreachable(submission_id, address, reach.seconds(), reach.bound_s, e, []) from e
                time.sleep(1.0)

    def _submit(self, agent_wait_seconds: float = 60.0, **kwargs) -> None:
        # A cluster that has just started answers "No available agent" until its job agent is up.
        # A request that timed out may have reached the cluster: before trying again, ask whether the
        # job exists (the submission id is this attempt's own), and take "already exists" as ours.
        deadline = time.monotonic() + agent_wait_seconds
        reach = Reachability(unreachable_s())
        answer_lost = False
        while True:
            started = time.monotonic()
            try:
                if answer_lost and self._exists(kwargs["submission_id"]):
                    return
                self.client.submit_job(**kwargs)
                return
            except RuntimeError as e:
                if answer_lost and "already exists" in str(e):
                    return
                if "No available agent" not in str(e):
                    raise
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"Ray at {self.address} has no job agent after {agent_wait_seconds:.0f}s: the cluster's "
                        "dashboard agent did not start (see the raylet and dashboard_agent logs in its session "
                        "folder), or RAY_ADDRESS names a cluster started without one.") from e
            except Exception as e:  # noqa: BLE001 - no answer at all (refused, timed out)
                if not _is_connection_error(e):
                    raise
                answer_lost = True
                reach.failed(e, started)
                if reach.expired():
                    raise ClusterUnreachable(kwargs["submission_id"], self.address, reach.seconds(), reach.bound_s,
                                             e, []) from e
            time.sleep(1.0)

    def _exists(self, submission_id: str) -> bool:
        """Whether the cluster knows the job (a submission whose answer was lost went through)."""
        try:
            self.client.get_job_info(submission_id)
            return True
        except RuntimeError:  # the Jobs API's "not found": submit it
            return False

    def _wait(self, submission_id: str, log: Callable[[str], None]):
        """Relay the job's log lines until it ends. The status is polled every `poll_seconds`; the
        Jobs API serves only the whole log, so it is fetched less and less often (x1.5 up to
        `max_poll_seconds`). Failed polls are retried; after `RLHF_RAY_UNREACHABLE_S` of nothing
        but failures, ClusterUnreachable.
        """
        log_delay = self.poll_seconds
        next_fetch = time.monotonic()
        printed = 0
        pending = ""
        tail: list[str] = []
        reach = Reachability(unreachable_s())
        while True:
            started = time.monotonic()
            try:
                info = self.client.get_job_info(submission_id)
                done = str(getattr(info.status, "value", info.status)) in TERMINAL
                text = None
                if done or time.monotonic() >= next_fetch:
                    text = self.client.get_job_logs(submission_id)
                    next_fetch = time.monotonic() + log_delay
                    log_delay = min(self.max_poll_seconds, log_delay * 1.5)
            except Exception as e:  # noqa: BLE001 - whatever the failure, the cluster did not answer this poll
                if reach.since is None:
                    log(f"Ray at {self.address} did not answer ({type(e).__name__}: {redact_text(str(e))[:300]}); "
                        f"retrying for up to {reach.bound_s:g} s ({UNREACHABLE_ENV})")
                reach.failed(e, started)
                if reach.expired():
                    raise ClusterUnreachable(submission_id, self.address, reach.seconds(), reach.bound_s, e,
                                             tail) from e
                time.sleep(max(self.poll_seconds, 1.0))
                continue
            if reach.since is not None:
                log(f"Ray at {self.address} answers again after {reach.seconds():.0f} s")
            reach.ok()
            if text is not None and len(text) > printed:
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


def _is_connection_error(e: BaseException) -> bool:
    import requests

    return isinstance(e, (ConnectionError, TimeoutError, requests.ConnectionError, requests.Timeout))


# -- the embedded default: a local cluster kept by a small process of its own ------------------

READY_PREFIX = "RLHF_LOCAL_RAY "
KEEPER_START_S = 300.0  # Ray's own start is slow on a busy machine (benchmarks/README.md)
_LOCAL: dict[str, LocalCluster] = {}  # the address ray_cluster() yielded -> the cluster serving it now
# The dashboard's module processes (`ray-dashboard-<Module>-0`) are not among them: the head restarts
# one that dies, so its death says nothing about the cluster.
_CLUSTER_PROCESSES = {"gcs_server": "the GCS", "raylet": "the raylet", "ray-dashboard-head": "the dashboard"}


def _kind(name: str) -> str | None:
    """Which of the cluster's vital processes a process name is, or None."""
    return name if name in _CLUSTER_PROCESSES else None


def keep_local_ray() -> None:
    """The keeper's body (`python -c`): start the local cluster, print its addresses, hold it
    until stdin closes (the flow ended, or died), then shut it down."""
    import ray

    from rlhf_core.distributed.local_ray import init_local

    context = init_local(include_dashboard=True, dashboard_host="127.0.0.1", num_cpus=os.cpu_count(),
                         configure_logging=False, log_to_driver=False)
    info = context.address_info
    print(READY_PREFIX + json.dumps({"address": "http://" + context.dashboard_url, "session_dir": info["session_dir"],
                                     "gcs_address": info["gcs_address"]}), flush=True)
    sys.stdin.read()
    ray.shutdown()


class LocalCluster:
    """A local Ray started for a flow run, held by a keeper process; `restart()` replaces it."""

    def __init__(self):
        self.lock = threading.Lock()
        self.keeper: subprocess.Popen | None = None
        self.address = self.session_dir = self.gcs_address = ""
        self.processes: list = []  # (name, psutil.Process): the keeper first, then the cluster's processes

    def start(self) -> None:
        import psutil

        keeper = subprocess.Popen([sys.executable, "-c", "from orchestration.ray_jobs import keep_local_ray; keep_local_ray()"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        lines: queue.Queue = queue.Queue()
        # Read by a thread for as long as the keeper lives: nothing it prints can block it, and no
        # line waits in a read buffer that select() cannot see.
        threading.Thread(target=_pump, args=(keeper.stdout, lines), daemon=True).start()
        try:
            ready = _read_ready_line(keeper, lines, KEEPER_START_S)
        except BaseException:
            keeper.kill()
            keeper.wait()
            raise
        self.keeper = keeper
        self.address, self.session_dir, self.gcs_address = ready["address"], ready["session_dir"], ready["gcs_address"]
        self.processes = _named([psutil.Process(keeper.pid)])

    def dead(self) -> str | None:
        """None while the cluster runs; else what is gone (the keeper, the GCS, the raylet, the dashboard)."""
        gone = [] if self.keeper is not None and self.keeper.poll() is None else ["its keeper process"]
        gone += [_CLUSTER_PROCESSES[_kind(name)] for name, p in self.processes
                 if _kind(name) and not _running(p)]
        return ", ".join(dict.fromkeys(gone)) or None

    def stop(self, timeout: float = 60.0) -> None:
        """Close the keeper's stdin (it shuts Ray down), then kill whatever of the cluster is left."""
        import psutil

        if self.processes and _running(self.processes[0][1]):  # what the cluster started since
            known = {p.pid for _, p in self.processes}
            self.processes += [(n, p) for n, p in _named([self.processes[0][1]]) if p.pid not in known]
        if self.keeper is not None:
            with contextlib.suppress(Exception):
                self.keeper.stdin.close()
            try:
                self.keeper.wait(max(timeout, 0.001))
            except subprocess.TimeoutExpired:
                self.keeper.kill()
                self.keeper.wait()
        for _, p in self.processes[1:]:
            with contextlib.suppress(psutil.Error):
                if p.is_running():
                    p.kill()
        self.keeper, self.processes = None, []

    def restart(self) -> None:
        self.stop(timeout=0.0)  # the cluster is dead: nothing to shut down gracefully
        self.start()


def _named(roots: list) -> list[tuple[str, object]]:
    """(name, psutil.Process) of `roots` and all their descendants (names kept: a dead one has none)."""
    import psutil

    found = []
    for root in roots:
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                name = p.name()
                if any(a.endswith("dashboard/dashboard.py") for a in p.cmdline()):
                    name = "ray-dashboard-head"  # the head is a plain `python .../dashboard.py`
                found.append((name, p))
    return found


def _running(p) -> bool:
    """Whether a process still runs (a zombie, killed but not yet reaped, does not)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _pump(stream, lines: queue.Queue) -> None:
    """The keeper's stdout lines into `lines` until its ready line; after it, read and dropped."""
    ready = False
    for line in stream:
        if not ready:
            lines.put(line)
            ready = line.startswith(READY_PREFIX)
    lines.put(None)


def _read_ready_line(keeper: subprocess.Popen, lines: queue.Queue, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"the local Ray cluster did not start within {timeout:.0f} s")
        try:
            line = lines.get(timeout=min(left, 1.0))
        except queue.Empty:
            continue
        if line is None:  # stdout closed: the keeper is gone
            with contextlib.suppress(subprocess.TimeoutExpired):
                keeper.wait(10)
            raise RuntimeError(f"the local Ray cluster's keeper process exited with code {keeper.returncode} "
                               "before the cluster was up (its error is above)")
        if line.startswith(READY_PREFIX):
            return json.loads(line[len(READY_PREFIX):])
        sys.stdout.write(line)


def local_cluster(address: str) -> LocalCluster | None:
    """The local cluster `ray_cluster()` started under `address`, or None (a cluster of RAY_ADDRESS)."""
    return _LOCAL.get(address)


def live_address(address: str, log: Callable[[str], None] | None = None) -> str:
    """The Jobs API address serving `address` now. For a local cluster of `ray_cluster()` whose
    processes died, a fresh cluster is started first (a retried attempt then has somewhere to run);
    any other address is returned as it is."""
    cluster = _LOCAL.get(address)
    if cluster is None:
        return address
    with cluster.lock:
        gone = cluster.dead()
        if gone:
            if log:
                log(f"the local Ray cluster of this run ({cluster.address}) is down ({gone} gone); starting a fresh one")
            cluster.restart()
            if log:
                log(f"a fresh local Ray cluster is up at {cluster.address}")
        return cluster.address


@contextlib.contextmanager
def ray_cluster() -> Iterator[str]:
    """The Jobs API address: `RAY_ADDRESS`, or a local Ray with its dashboard for this block."""
    if os.environ.get("RAY_ADDRESS"):
        yield os.environ["RAY_ADDRESS"]
        return
    check_no_other_checkout_here()
    from rlhf_core.distributed.cluster import prepare_environment
    from rlhf_core.distributed.local_ray import prepare_auth, reread_ray_config

    prepare_environment()  # state dir, compiled-op cache: the local cluster's processes inherit them
    warning = prepare_auth()  # token auth on, a token in place: the keeper inherits it, our client sends it
    if warning:
        print(f"rlhf: warning: {warning}", file=sys.stderr, flush=True)
    reread_ray_config()
    cluster = LocalCluster()
    cluster.start()
    key = cluster.address
    _LOCAL[key] = cluster
    try:
        yield key
    finally:
        _LOCAL.pop(key, None)
        cluster.stop()
