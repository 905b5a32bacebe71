"""A cluster that stops answering fails the attempt within a bound, retryably (against a fake Jobs API
and a fake clock); the job's driver gets the same bound for Ray's GCS reconnect."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import requests

from orchestration import ray_jobs
from orchestration.ray_jobs import ClusterUnreachable, RayJobRunner, Reachability, StageConfigError, job_env


class Clock:
    def __init__(self):
        self.now = 0.0

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()  # only the runner's clock: other threads keep the real one
    monkeypatch.setattr(ray_jobs, "time", SimpleNamespace(sleep=c.sleep, monotonic=c, time=c))
    return c


class DyingJobs:
    """A Jobs API whose job runs; from poll `dies_at` on every request fails with `error` (until
    poll `back_at`, if given)."""

    def __init__(self, dies_at: int, error: Exception, back_at: int | None = None, ends_at: int | None = None):
        self.dies_at, self.error, self.back_at, self.ends_at = dies_at, error, back_at, ends_at
        self.polls, self.stopped = 0, []

    def _down(self) -> bool:
        return self.polls >= self.dies_at and (self.back_at is None or self.polls < self.back_at)

    def submit_job(self, **kwargs):
        return kwargs["submission_id"]

    def get_job_info(self, submission_id):
        self.polls += 1
        if self._down():
            raise self.error
        done = self.ends_at is not None and self.polls >= self.ends_at
        return SimpleNamespace(status=SimpleNamespace(value="SUCCEEDED" if done else "RUNNING"), driver_exit_code=0,
                               message="", start_time=0, end_time=1000)

    def get_job_logs(self, submission_id):
        if self._down():
            raise self.error
        return "[step 1] loss 1.0\n"

    def stop_job(self, submission_id):
        self.stopped.append(submission_id)
        raise self.error

    def get_job_status(self, submission_id):
        raise self.error


def runner_with(fake) -> RayJobRunner:
    runner = RayJobRunner("http://fake")
    runner.client, runner.poll_seconds, runner.max_poll_seconds = fake, 0.5, 5.0
    return runner


def test_reachability_counts_time_since_the_first_failure_and_resets_on_an_answer():
    clock = Clock()
    reach = Reachability(60, clock)
    assert not reach.expired() and reach.seconds() == 0
    reach.failed(ConnectionError("refused"))
    clock.sleep(59)
    reach.failed(ConnectionError("refused"))
    assert not reach.expired() and reach.failures == 2
    reach.ok()  # one answer: the count starts over
    clock.sleep(30)
    reach.failed(TimeoutError())
    clock.sleep(59.5)
    assert not reach.expired()
    clock.sleep(0.5)
    assert reach.expired() and reach.seconds() == 60 and isinstance(reach.last_error, TimeoutError)


@pytest.mark.parametrize("error", [requests.ConnectionError("Connection refused"), requests.ReadTimeout("read timed out"),
                                   RuntimeError("Request failed with status code 500: GCS unavailable")])
def test_a_cluster_that_stops_answering_fails_the_attempt_retryably_within_the_bound(clock, monkeypatch, error):
    monkeypatch.setenv("RLHF_RAY_UNREACHABLE_S", "20")
    fake = DyingJobs(dies_at=4, error=error)
    lines = []
    with pytest.raises(ClusterUnreachable) as err:
        runner_with(fake).run("sft", [], {}, lines.append)
    assert err.value.retryable and not isinstance(err.value, StageConfigError)
    assert err.value.status == "UNREACHABLE" and err.value.tail == ["[step 1] loss 1.0"]
    died_at = 3 * 0.5  # three polls answered, half a second apart
    assert 20 <= clock.now - died_at <= 21, "failed at the bound, not before, not much after"
    assert "http://fake did not answer for 20 s (RLHF_RAY_UNREACHABLE_S=20)" in str(err.value)
    assert type(error).__name__ in str(err.value)
    assert any("did not answer" in line and "retrying for up to 20 s" in line for line in lines)
    assert len(fake.stopped) == 1  # the job is stopped on the way out (best effort: the cluster is down)


def test_a_cluster_back_within_the_bound_does_not_fail_the_job(clock, monkeypatch):
    monkeypatch.setenv("RLHF_RAY_UNREACHABLE_S", "20")
    fake = DyingJobs(dies_at=3, error=requests.ConnectionError("refused"), back_at=15, ends_at=20)
    lines = []
    result = runner_with(fake).run("sft", [], {}, lines.append)
    assert result.seconds == 1.0 and not fake.stopped
    assert any("answers again after" in line for line in lines)


def test_the_default_bound_is_60_s_and_a_bad_value_is_named(clock, monkeypatch):
    monkeypatch.delenv("RLHF_RAY_UNREACHABLE_S", raising=False)
    assert ray_jobs.unreachable_s() == 60
    with pytest.raises(ClusterUnreachable, match="did not answer for 60 s"):
        runner_with(DyingJobs(dies_at=1, error=requests.ConnectionError("refused"))).run("sft", [], {}, print)
    for bad in ("0", "-5", "soon"):
        monkeypatch.setenv("RLHF_RAY_UNREACHABLE_S", bad)
        with pytest.raises(ValueError, match=f"RLHF_RAY_UNREACHABLE_S='{bad}'"):
            ray_jobs.unreachable_s()


def test_a_cluster_down_at_submission_fails_retryably_too(clock, monkeypatch):
    monkeypatch.setenv("RLHF_RAY_UNREACHABLE_S", "10")

    class Refusing(DyingJobs):
        def submit_job(self, **kwargs):
            raise requests.ConnectionError("Connection refused")

    with pytest.raises(ClusterUnreachable, match="did not answer for 10 s"):
        runner_with(Refusing(dies_at=0, error=requests.ConnectionError("refused"))).run("sft", [], {}, print)
    assert 10 <= clock.now <= 11


def test_the_jobs_driver_and_ranks_give_up_on_a_lost_gcs_at_the_same_bound(monkeypatch):
    monkeypatch.delenv("RLHF_RAY_UNREACHABLE_S", raising=False)
    assert job_env()["RAY_gcs_rpc_server_reconnect_timeout_s"] == "60"
    monkeypatch.setenv("RLHF_RAY_UNREACHABLE_S", "15")
    assert job_env()["RAY_gcs_rpc_server_reconnect_timeout_s"] == "15"


def test_every_request_to_the_jobs_api_has_a_deadline(monkeypatch):
    seen = {}

    def fake_request(method, url, **kwargs):
        seen.update(kwargs)
        raise requests.ConnectionError("refused")

    monkeypatch.setattr("requests.request", fake_request)
    monkeypatch.setattr("ray.dashboard.modules.dashboard_sdk.requests.request", fake_request, raising=False)
    monkeypatch.delenv("RLHF_RAY_UNREACHABLE_S", raising=False)
    with pytest.raises(ConnectionError):
        ray_jobs.timed_client("http://127.0.0.1:1")
    assert seen["timeout"] == ray_jobs.REQUEST_TIMEOUT_S == 30
    monkeypatch.setenv("RLHF_RAY_UNREACHABLE_S", "10")  # never longer than the bound itself
    with pytest.raises(ConnectionError):
        ray_jobs.timed_client("http://127.0.0.1:1")
    assert seen["timeout"] == 10


def test_a_request_that_hangs_counts_from_its_start(clock, monkeypatch):
    """A server that accepts the connection and never answers: the request's own deadline is the
    bound, and the time it hung counts, so the attempt fails at the bound, not the bound plus a deadline."""
    monkeypatch.setenv("RLHF_RAY_UNREACHABLE_S", "20")

    class Hanging(DyingJobs):
        def get_job_info(self, submission_id):
            if self.polls + 1 >= self.dies_at:
                clock.sleep(ray_jobs.request_timeout_s())  # the request hangs until its deadline
            return super().get_job_info(submission_id)

    with pytest.raises(ClusterUnreachable, match="did not answer for 20 s"):
        runner_with(Hanging(dies_at=3, error=requests.ReadTimeout("read timed out"))).run("sft", [], {}, print)
    assert clock.now - 2 * 0.5 <= 20.5  # two polls answered; the third hangs and fails; no fourth


def test_live_address_leaves_addresses_it_did_not_start_alone():
    assert ray_jobs.live_address("http://head:8265") == "http://head:8265"


def test_a_failed_jobs_message_is_one_line_with_the_clis_error_not_rays_copy_of_the_log():
    log = ["[step 20] eval/loss=3.1", "rlhf: error: stage failed: RoleError: role 'train' rank 1: the actor died "
           "during run_stage():", "The actor died unexpectedly before finishing this task.", "\tpid: 9264"]
    message = ("Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):\n"
               + "\n".join(log))
    assert ray_jobs.headline(message, log) == (
        "Job entrypoint command failed with exit code 1; rlhf: error: stage failed: RoleError: role 'train' rank 1: "
        "the actor died during run_stage():")
    assert ray_jobs.headline("Job was intentionally stopped.", ["[step 3]"]) == "Job was intentionally stopped."
    err = ray_jobs.StageJobError("rlhf-sft-1", "FAILED", 1, ray_jobs.headline(message, log), log)
    assert str(err).splitlines()[0].endswith("role 'train' rank 1: the actor died during run_stage():")
    assert str(err).count("The actor died unexpectedly") == 1  # the log once, as the tail


@pytest.mark.parametrize("second_answer", ["job found", "already exists"])
def test_a_submission_whose_answer_is_lost_is_not_submitted_twice(clock, second_answer):
    """The first submit reached the cluster but its answer timed out: the runner finds the job (or
    is told its id already exists) and waits on it, instead of failing and leaving it to run
    unwatched, or starting a second one."""

    class LostAnswer(DyingJobs):
        def __init__(self):
            super().__init__(dies_at=10**6, error=RuntimeError("unused"), ends_at=3)
            self.submitted = []

        def submit_job(self, **kwargs):
            self.submitted.append(kwargs["submission_id"])
            if len(self.submitted) == 1:
                raise requests.ReadTimeout("read timed out")  # ...after the cluster took it
            raise RuntimeError(f"Job with submission_id {kwargs['submission_id']} already exists.")

        def get_job_info(self, submission_id):
            if not self.submitted:
                raise RuntimeError("Job not found")
            if second_answer == "already exists" and self.polls == 0 and len(self.submitted) == 1:
                self.polls -= 1  # the existence check does not count as a poll...
                raise RuntimeError("Job not found")  # ...and says not found (a store that lags)
            return super().get_job_info(submission_id)

    fake = LostAnswer()
    result = runner_with(fake).run("sft", [], {}, print)
    assert result.submission_id == fake.submitted[0]
    assert len(set(fake.submitted)) == 1 and len(fake.submitted) == (2 if second_answer == "already exists" else 1)


def test_the_keepers_ready_line_is_read_when_other_lines_arrive_with_it_in_one_chunk(capsys):
    """Lines printed before the ready line reach the pipe in the same write: all are read (a
    select() on the pipe followed by readline() left the ready line in Python's buffer)."""
    import queue
    import subprocess
    import sys
    import threading

    code = ("import sys; print('Ray says hello'); print('another line'); "
            f"print({ray_jobs.READY_PREFIX!r} + '{{\"address\": \"http://127.0.0.1:1\"}}'); sys.stdout.flush(); "
            "sys.stdin.read()")
    keeper = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=ray_jobs._pump, args=(keeper.stdout, lines), daemon=True).start()
        assert ray_jobs._read_ready_line(keeper, lines, timeout=20) == {"address": "http://127.0.0.1:1"}
        assert "Ray says hello\nanother line\n" in capsys.readouterr().out
    finally:
        keeper.kill()
        keeper.wait()
