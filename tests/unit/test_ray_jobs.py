"""orchestration/ray_jobs.py: job commands and environments, the runner's log relay, failures and cleanup."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestration.ray_jobs import RayJobRunner, StageConfigError, StageJobError, job_command, job_env
from rlhf_core.distributed.cluster import forwarded_env


def test_job_command_uses_this_interpreter_locally_and_the_installed_cli_on_a_cluster(monkeypatch):
    monkeypatch.delenv("RLHF_JOB_COMMAND", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert job_command(["train", "sft", "--config", "/a b.yaml"]) == \
        f"{sys.executable} -m rlhf_core.cli train sft --config '/a b.yaml'"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert job_command(["prep"]) == "rlhf prep"
    monkeypatch.setenv("RLHF_JOB_COMMAND", "/opt/venv/bin/rlhf")
    assert job_command(["prep"]) == "/opt/venv/bin/rlhf prep"


def test_a_local_ray_is_refused_in_a_directory_holding_another_copy_of_the_code(monkeypatch, tmp_path):
    """Its jobs and ranks run in the working directory, where `python -m` (a job's driver) and Ray
    (every rank) would import that copy instead of the running code: refused before any cluster
    starts, for a pipeline's cluster and for the one `rlhf train` starts for its ranks."""
    import ray

    import rlhf_core
    from orchestration import ray_jobs
    from rlhf_core.distributed import cluster, local_ray
    from rlhf_core.infra.settings import ConfigError

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_jobs, "LocalCluster", lambda: pytest.fail("a cluster was started"))
    monkeypatch.setattr(local_ray, "init_local", lambda **kwargs: pytest.fail("a local Ray was started"))
    (tmp_path / "rlhf_core").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=f"{tmp_path} holds another copy of this project's code"):
        with ray_jobs.ray_cluster():
            pass
    if not ray.is_initialized():  # `rlhf train` with several ranks starts its own local Ray: the same refusal
        with pytest.raises(ConfigError, match="holds another copy"):
            cluster.ensure_ray()
    cluster.check_no_other_checkout_here(Path(rlhf_core.__file__).resolve().parents[1])  # this checkout: fine
    cluster.check_no_other_checkout_here(tmp_path / "elsewhere")


def test_job_env_forwards_the_allow_list_only(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijkl")
    monkeypatch.setenv("RLHF_HOME", "/state")
    env = job_env({"MLFLOW_RUN_ID": "r1"})
    assert env["RLHF_HOME"] == "/state" and env["MLFLOW_RUN_ID"] == "r1"
    assert "AWS_SECRET_ACCESS_KEY" not in env and "HF_TOKEN" not in env


def test_a_cluster_of_its_own_gets_no_path_of_this_machine(monkeypatch):
    """With RAY_ADDRESS the jobs may run on other machines: each node keeps its own state directory
    and compiled-op cache; settings that are not paths still travel."""
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    monkeypatch.setenv("RLHF_HOME", "/state")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/state/ext")
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://s3:9000")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    env = job_env()
    assert "RLHF_HOME" not in env and "TORCH_EXTENSIONS_DIR" not in env
    assert env["AWS_ENDPOINT_URL"] == "http://s3:9000"
    # ...except the store the job's run is in: this process's, whose default is a file under its
    # state directory (the nodes' own would not hold the run; docs/multinode.md: a server for many
    # machines). The ranks a driver joined to the cluster starts get the same (`ensure_ray`).
    assert env["MLFLOW_TRACKING_URI"] == forwarded_env()["MLFLOW_TRACKING_URI"] == "sqlite:////state/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert job_env()["MLFLOW_TRACKING_URI"] == forwarded_env()["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"


def test_the_jobs_on_a_flows_own_local_ray_may_keep_one_rank_per_role_in_their_driver(monkeypatch):
    """`RLHF_RANKS_ON_RAY=0` for the local Ray a flow starts (one machine); a cluster of RAY_ADDRESS
    keeps Ray actors unless its user says otherwise; a user's value travels as given."""
    monkeypatch.delenv("RLHF_RANKS_ON_RAY", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert job_env()["RLHF_RANKS_ON_RAY"] == "0"
    monkeypatch.setenv("RLHF_RANKS_ON_RAY", "1")
    assert job_env()["RLHF_RANKS_ON_RAY"] == "1"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert job_env()["RLHF_RANKS_ON_RAY"] == "1"
    monkeypatch.delenv("RLHF_RANKS_ON_RAY")
    assert "RLHF_RANKS_ON_RAY" not in job_env()


class FakeJobs:
    """An in-memory Jobs API: the job's log grows by one chunk per poll, then it ends."""

    def __init__(self, chunks, status="SUCCEEDED", exit_code=0, hang=False):
        self.chunks, self.final, self.exit_code, self.hang = list(chunks), status, exit_code, hang
        self.log, self.stopped, self.submitted = "", [], []

    def submit_job(self, **kwargs):
        self.submitted.append(kwargs)
        return kwargs["submission_id"]

    def get_job_info(self, submission_id):
        if self.hang:
            raise KeyboardInterrupt  # the waiting task is interrupted (cancellation, Ctrl-C)
        done = not self.chunks
        if self.chunks:
            self.log += self.chunks.pop(0)
        status = SimpleNamespace(value=self.final if done else "RUNNING")
        return SimpleNamespace(status=status, driver_exit_code=self.exit_code if done else None, message="boom",
                               start_time=1000, end_time=3500)

    def get_job_logs(self, submission_id):
        return self.log

    def get_job_status(self, submission_id):
        return SimpleNamespace(value="STOPPED")

    def stop_job(self, submission_id):
        self.stopped.append(submission_id)


def runner_with(fake) -> RayJobRunner:
    runner = RayJobRunner.__new__(RayJobRunner)
    runner.address, runner.client, runner.poll_seconds, runner.max_poll_seconds = "http://fake", fake, 0, 0
    return runner


def test_runner_relays_log_lines_and_reports_job_time():
    fake = FakeJobs(["loading\nstep 1\r", "step 2\rst", "ep 3\ndone"])
    lines = []
    result = runner_with(fake).run("sft", ["train", "sft"], {"A": "1"}, lines.append)
    assert lines[1:] == ["loading", "step 1", "step 2", "step 3", "done"]
    assert result.seconds == 2.5 and result.submission_id.startswith("rlhf-sft-")
    assert fake.submitted[0]["runtime_env"] == {"env_vars": {"A": "1"}} and not fake.stopped


def test_runner_sees_a_job_end_at_once_but_fetches_its_log_less_and_less_often(monkeypatch):
    fake = FakeJobs(["step\n"] * 40)
    runner = runner_with(fake)
    runner.poll_seconds, runner.max_poll_seconds = 0.5, 5.0
    clock = [0.0]
    fetched_at = []
    monkeypatch.setattr("orchestration.ray_jobs.time.sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr("orchestration.ray_jobs.time.monotonic", lambda: clock[0])
    real_logs = fake.get_job_logs
    monkeypatch.setattr(fake, "get_job_logs", lambda sid: fetched_at.append(clock[0]) or real_logs(sid))
    lines = []
    runner.run("sft", [], {}, lines.append)
    assert lines[1:] == ["step"] * 40  # every line relayed: the final fetch comes when the job ends
    assert clock[0] == 40 * 0.5  # status polled every 0.5 s: the end is seen on the first poll after it
    gaps = [b - a for a, b in zip(fetched_at, fetched_at[1:-1], strict=False)]
    assert gaps[:3] == [0.5, 1.0, 1.5] and max(gaps) <= 5.0 and len(fetched_at) < 15
    assert all(a <= b for a, b in zip(gaps, gaps[1:], strict=False))


def test_runner_types_failures_by_exit_code_and_keeps_the_log_tail():
    with pytest.raises(StageConfigError) as err:
        runner_with(FakeJobs(["rlhf: error: data.jsonl: row 2: missing key\n"], "FAILED", 2)).run(
            "sft", [], {}, lambda line: None)
    assert not err.value.retryable and "row 2" in str(err.value)
    with pytest.raises(StageJobError) as err:
        runner_with(FakeJobs(["Killed\n"], "FAILED", -9)).run("sft", [], {}, lambda line: None)
    assert err.value.retryable and "Killed" in str(err.value) and err.value.exit_code == -9


def test_runner_stops_its_job_when_the_wait_is_interrupted():
    fake = FakeJobs([], hang=True)
    with pytest.raises(KeyboardInterrupt):
        runner_with(fake).run("dpo", [], {}, lambda line: None)
    assert len(fake.stopped) == 1 and fake.stopped[0].startswith("rlhf-dpo-")
