"""Pure pieces of the orchestration layer: cache keys, job commands and environments, the job
runner's log relay / failure typing / cleanup (against an in-memory Jobs API), flow parameters."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from rlhf_core.config import ConfigError
from tasks.cache import cache_key, dataset_digest
from tasks.ray_jobs import RayJobRunner, StageConfigError, StageJobError, job_command, job_env


def test_cache_key_moves_with_every_input_and_nothing_else():
    base = dict(stage="sft", config_hash="sha256:a", upstream={"model": "k1"}, datasets={"d": "x"}, code_version="1")
    key = cache_key(**base)
    assert cache_key(**base) == key
    for change in ({"config_hash": "sha256:b"}, {"upstream": {"model": "k2"}}, {"datasets": {"d": "y"}},
                   {"code_version": "2"}, {"stage": "rm"}):
        assert cache_key(**{**base, **change}) != key, change


def test_dataset_digest_is_content_based(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "train.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    first = dataset_digest(f"json@{d}")
    assert dataset_digest(f"json@{d}") == first
    (d / "train.jsonl").write_text('{"prompt": "a", "response": "c"}\n')
    assert dataset_digest(f"json@{d}") != first
    assert dataset_digest("org/name") == {"org/name": "hub:org/name"}
    assert dataset_digest(None) == {}


def test_job_command_uses_this_interpreter_locally_and_the_installed_cli_on_a_cluster(monkeypatch):
    monkeypatch.delenv("RLHF_JOB_COMMAND", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert job_command(["train", "sft", "--config", "/a b.yaml"]) == \
        f"{sys.executable} -m rlhf_core.cli train sft --config '/a b.yaml'"
    monkeypatch.setenv("RAY_ADDRESS", "http://head:8265")
    assert job_command(["prep"]) == "rlhf prep"
    monkeypatch.setenv("RLHF_JOB_COMMAND", "/opt/venv/bin/rlhf")
    assert job_command(["prep"]) == "/opt/venv/bin/rlhf prep"


def test_job_env_forwards_the_allow_list_only(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("HF_TOKEN", "hf_abcdefghijkl")
    monkeypatch.setenv("RLHF_HOME", "/state")
    env = job_env({"MLFLOW_RUN_ID": "r1"})
    assert env["RLHF_HOME"] == "/state" and env["MLFLOW_RUN_ID"] == "r1"
    assert "AWS_SECRET_ACCESS_KEY" not in env and "HF_TOKEN" not in env


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


def test_runner_polls_a_long_job_less_and_less_often(monkeypatch):
    runner = runner_with(FakeJobs(["step\n"] * 12))
    runner.poll_seconds, runner.max_poll_seconds = 0.5, 5.0
    sleeps = []
    monkeypatch.setattr("tasks.ray_jobs.time.sleep", sleeps.append)
    runner.run("sft", [], {}, lambda line: None)
    assert sleeps[:3] == [0.5, 0.75, 1.125] and max(sleeps) == sleeps[-1] == 5.0
    assert all(a <= b for a, b in zip(sleeps, sleeps[1:], strict=False))


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


def test_flow_parameters_validate_every_section():
    from flows.cli import flow_parameters

    params = flow_parameters({"settings": {"stages": ["sft", "prep"]}, "sft": {"learning_rate": 1e-4}})
    assert [s.value for s in params["settings"].stages] == ["sft", "prep"]
    assert params["sft"].learning_rate == 1e-4 and params["sft"].pretrain is None
    assert params["sft"].data.max_len == 64  # the embedded-default sizes
    with pytest.raises(ConfigError, match="unknown section"):
        flow_parameters({"sfft": {}})
    with pytest.raises(ConfigError, match="(?s)sft.*--learning_rate"):
        flow_parameters({"sft": {"learning_rate": -1}})
    with pytest.raises(ConfigError, match="settings.stages"):
        flow_parameters({"settings": {"stages": ["sft", "ppo2"]}})
    with pytest.raises(ConfigError, match="iterative.n_samples_per_prompt"):
        flow_parameters({"iterative": {"n_samples_per_prompt": 1}})


def test_flows_and_tasks_never_import_torch():
    import subprocess

    code = "import sys, flows.pipeline, flows.cli, tasks.stages; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
