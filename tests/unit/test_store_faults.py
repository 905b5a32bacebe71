"""MLflow or S3 unreachable at the start of a stage: one clear error, exit 1, within the bound.

No server runs here: a closed port refuses connections, a socket that listens but never accepts
is a black hole (the TCP handshake completes in the kernel, no byte ever comes back). The stores
that go away in the middle of a stage are in tests/integration/test_store_faults.py.
"""

from __future__ import annotations

import socket
import time

import pytest

from rlhf_core.infra import reachability

BOUND_S = 1.5


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture()
def black_hole():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)  # never accepted, never answered
    yield s.getsockname()[1]
    s.close()


@pytest.fixture()
def short_bounds(monkeypatch):
    monkeypatch.setenv("RLHF_STORE_CHECK_S", str(BOUND_S))
    monkeypatch.setenv("RLHF_STORE_WAIT_S", str(BOUND_S))


def _sft_argv(prepared, out: str) -> list[str]:
    return ["train", "sft", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}", "--save_path", out,
            "--apply_chat_template", "--max_len", "48", "--train_batch_size", "16", "--micro_train_batch_size", "8",
            "--max_steps", "1"]


def _run_cli(argv, capsys) -> tuple[int, str, float]:
    from rlhf_core.cli import main

    started = time.monotonic()
    code = main(argv)
    return code, capsys.readouterr().err, time.monotonic() - started


@pytest.mark.parametrize("fault", ["refused", "black hole"])
def test_an_unreachable_tracking_server_fails_the_stage_at_start_within_the_bound(
        fault, black_hole, short_bounds, prepared, tmp_path, monkeypatch, capsys):
    port = _closed_port() if fault == "refused" else black_hole
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://admin:hunter2-secret@127.0.0.1:{port}")
    out = tmp_path / "sft"
    code, err, seconds = _run_cli(_sft_argv(prepared, str(out)), capsys)
    assert code == 1  # infrastructure: the pipeline retries the stage (2 would mean bad input, not retried)
    lines = [line for line in err.splitlines() if line.startswith("rlhf: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert f"MLflow tracking server at http://***@127.0.0.1:{port}/health did not answer within 1.5 s " \
           "(RLHF_STORE_CHECK_S" in lines[0]
    assert "hunter2-secret" not in err and "admin" not in err
    assert seconds < BOUND_S + 3.0, seconds  # the bound, plus the CLI's own start
    assert not out.exists()  # nothing read, trained or written


def test_an_unreachable_s3_endpoint_fails_the_stage_at_start_within_the_bound(short_bounds, prepared, tmp_path,
                                                                             monkeypatch, capsys):
    port = _closed_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    code, err, seconds = _run_cli(_sft_argv(prepared, "s3://models/unreachable/sft") + ["--use_mlflow", "false"],
                                  capsys)
    assert code == 1 and "Traceback" not in err, err
    assert f"S3 endpoint at http://127.0.0.1:{port} did not answer within 1.5 s (RLHF_STORE_CHECK_S" in err
    assert seconds < BOUND_S + 3.0, seconds


def test_a_store_that_answers_passes_the_check_at_once():
    """Any HTTP answer below 500 is a store that is there (MLflow's /health, S3's 403 to an anonymous GET)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            self.send_response(403 if self.path == "/" else 200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        started = time.monotonic()
        url = f"http://127.0.0.1:{server.server_address[1]}"
        reachability.wait_until_reachable("S3 endpoint", url, 5.0, "RLHF_STORE_CHECK_S", "test")
        reachability.wait_until_reachable("MLflow", url + "/health", 5.0, "RLHF_STORE_CHECK_S", "test")
        assert time.monotonic() - started < 1.0
    finally:
        server.shutdown()


def test_the_flow_fails_its_first_mlflow_record_within_the_bound_and_retries_the_stage(short_bounds, monkeypatch):
    from orchestration import lineage
    from orchestration.stages import _retry_infrastructure_only

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_closed_port()}")
    started = time.monotonic()
    with pytest.raises(reachability.StoreUnavailable, match=r"did not answer within 1.5 s \(RLHF_STORE_CHECK_S") as caught:
        lineage.start_pipeline_run("faults", "pipeline-x", {}, {})
    assert time.monotonic() - started < BOUND_S + 1.0

    class State:  # what Prefect hands the retry condition
        def result(self):
            raise caught.value

    assert _retry_infrastructure_only(None, None, State()) is True


def test_publishing_to_an_unreachable_s3_waits_the_bound_and_writes_nothing(short_bounds, tmp_path, monkeypatch):
    import botocore.session  # noqa: F401 - its first import (about 1 s) stays out of the timed window
    import s3fs  # noqa: F401

    from rlhf_core.infra import storage

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(b"w")
    started = time.monotonic()
    with pytest.raises(reachability.StoreUnavailable, match=r"within 1.5 s \(RLHF_STORE_WAIT_S.*nothing was published"):
        storage.publish_dir(tmp_path / "model", "s3://models/down/sft", {"stage": "sft"})
    assert BOUND_S <= time.monotonic() - started < BOUND_S + 1.0


@pytest.mark.parametrize("name", ["RLHF_STORE_CHECK_S", "RLHF_STORE_WAIT_S", "RLHF_METRICS_BUFFER"])
@pytest.mark.parametrize("bad", ["soon", "-5", "0", "inf"])
def test_a_bad_bound_is_a_configuration_error_naming_the_variable(name, bad, monkeypatch):
    """A negative wait would mean no wait at all; a word would be a traceback: both are named."""
    from rlhf_core.infra.settings import ConfigError

    monkeypatch.setenv(name, bad)
    read = {"RLHF_STORE_CHECK_S": reachability.store_check_s, "RLHF_STORE_WAIT_S": reachability.store_wait_s,
            "RLHF_METRICS_BUFFER": reachability.metrics_buffer}[name]
    with pytest.raises(ConfigError, match=f"{name}='{bad}': must be"):
        read()
    monkeypatch.setenv(name, "")
    assert read() > 0  # blank: the default


def test_a_run_created_by_a_request_whose_answer_was_lost_is_found_not_created_again(tmp_path):
    """The store made the run but the answer timed out: the retry finds it by its request id."""
    from mlflow import MlflowClient

    real = MlflowClient(f"sqlite:///{tmp_path}/m.db")
    experiment = real.create_experiment("lost-answers")

    class LosesFirstAnswer:
        def __init__(self):
            self.creates = 0

        def __getattr__(self, name):
            return getattr(real, name)

        def create_run(self, *args, **kwargs):
            self.creates += 1
            run = real.create_run(*args, **kwargs)
            if self.creates == 1:
                raise TimeoutError("read timed out")  # made, but the answer never came
            return run

    flaky = LosesFirstAnswer()
    run = reachability.RetryingClient(flaky, "sqlite").create_run(experiment, run_name="stage", tags={"rlhf.kind": "x"})
    assert flaky.creates == 1
    runs = real.search_runs([experiment])
    assert [r.info.run_id for r in runs] == [run.info.run_id] and run.data.tags["rlhf.kind"] == "x"
