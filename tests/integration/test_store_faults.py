"""A real MLflow tracking server that goes away in the middle of a stage and maybe comes back.

`mlflow server` (SQLite, artifacts served over HTTP) runs once for the module; each test reaches
it through `StoreProxy`, a TCP proxy in a thread that can refuse connections or black-hole them
(accept, never answer) and come back, cutting every open connection when it switches. No Ray.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


class StoreProxy:
    """127.0.0.1:`port` forwards to `target_port` while up; `refuse()` closes the port, `black_hole()`
    accepts and never answers, `up()` forwards again."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.mode = "up"
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._listen()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self._listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            with self._lock:
                self._open.append(client)
            if self.mode == "black_hole":
                continue  # held open; nothing read, nothing answered
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.append(upstream)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _cut(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def _close_listener(self) -> None:
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() of the thread
            except OSError:
                pass
            self._listener.close()
            self._listener = None

    def refuse(self) -> None:
        self.mode = "refuse"
        self._close_listener()
        self._cut()

    def black_hole(self) -> None:
        self.mode = "black_hole"
        self._cut()
        if self._listener is None:
            self._listen()

    def up(self) -> None:
        self.mode = "up"
        self._cut()
        if self._listener is None:
            self._listen()

    def close(self) -> None:
        self._close_listener()
        self._cut()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(root / "server.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--backend-store-uri",
                             f"sqlite:///{root}/mlflow.db", "--artifacts-destination", str(root / "artifacts"),
                             "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    import requests

    deadline = time.monotonic() + 120
    while True:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except requests.RequestException:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
        time.sleep(0.25)
    yield port
    proc.terminate()
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture()
def proxy(mlflow_server, monkeypatch):
    from rlhf_core.infra import tracking

    p = StoreProxy(mlflow_server)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", p.url)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")  # a black-holed request gives up after 1 s
    monkeypatch.setenv("RLHF_STORE_CHECK_S", "5")
    monkeypatch.setenv("RLHF_STORE_WAIT_S", "20")
    monkeypatch.setattr(tracking, "FLUSH_SECONDS", 0.05)
    monkeypatch.setattr(tracking, "MAX_BACKOFF_SECONDS", 0.3)
    yield p
    p.close()


def _client(port: int):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"http://127.0.0.1:{port}")  # straight to the server, not the proxy


def _wait(condition, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.parametrize("fault", ["refuse", "black_hole"])
def test_metrics_logged_while_the_store_is_away_never_block_and_arrive_when_it_returns(fault, proxy, mlflow_server,
                                                                                      capsys):
    from rlhf_core.infra.tracking import Tracker

    tracker = Tracker(True, "faults", f"away-{fault}", None)
    for step in range(1, 11):
        tracker.log_metrics({"train/loss": 1.0 / step}, step)
    _wait(lambda: len(tracker.metrics) == 0)
    getattr(proxy, fault)()
    slowest = 0.0
    for step in range(11, 61):
        started = time.monotonic()
        tracker.log_metrics({"train/loss": 1.0 / step}, step)  # the training loop's call
        slowest = max(slowest, time.monotonic() - started)
        time.sleep(0.01)
    _wait(lambda: tracker.metrics.failing is not None)  # the sender saw the outage
    assert slowest < 0.5, slowest  # logging never waited for the store (a wait would take >= 1 s)
    history = _client(mlflow_server).get_metric_history(tracker.run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 11))  # nothing got through while away
    proxy.up()
    _wait(lambda: len(tracker.metrics) == 0)  # the sender sends the held values on its own
    tracker.finish()
    err = capsys.readouterr().err
    assert err.count(f"rlhf: warning: MLflow at {proxy.url} did not take metrics") == 1, err  # once per outage
    assert f"rlhf: MLflow at {proxy.url} answers again" in err
    run = _client(mlflow_server).get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    history = _client(mlflow_server).get_metric_history(tracker.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, 61))


def test_the_held_metrics_are_bounded_oldest_dropped_with_a_warning(proxy, mlflow_server, monkeypatch, capsys):
    from rlhf_core.infra.tracking import Tracker

    monkeypatch.setenv("RLHF_METRICS_BUFFER", "50")
    tracker = Tracker(True, "faults", "bounded", None)
    proxy.refuse()
    for step in range(1, 201):
        tracker.log_metrics({"train/loss": float(step)}, step)
    assert len(tracker.metrics) <= 50 and tracker.metrics.dropped >= 150
    proxy.up()
    tracker.finish()
    err = capsys.readouterr().err
    assert err.count("metric values are waiting for MLflow") == 1 and "(RLHF_METRICS_BUFFER)" in err
    run = _client(mlflow_server).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and int(run.data.tags["rlhf.metrics_dropped"]) == tracker.metrics.dropped
    steps = [m.step for m in _client(mlflow_server).get_metric_history(tracker.run_id, "train/loss")]
    assert sorted(steps) == list(range(151, 201))  # the newest 50 kept


def test_a_published_output_whose_run_cannot_finish_is_withdrawn(proxy, mlflow_server, monkeypatch, tmp_path):
    from rlhf_core.infra import storage
    from rlhf_core.infra.reachability import StoreUnavailable
    from rlhf_core.infra.tracking import Tracker

    monkeypatch.setenv("RLHF_STORE_WAIT_S", "1.5")
    tracker = Tracker(True, "faults", "withdrawn", None)
    (tmp_path / "build").mkdir()
    (tmp_path / "build" / "weights.bin").write_bytes(b"w")
    out = tmp_path / "out"
    tracker.await_store()
    storage.publish_dir(tmp_path / "build", str(out), {"stage": "sft"})
    tracker.published(str(out), "sft")
    assert storage.read_manifest(str(out)) is not None
    proxy.refuse()  # gone between publishing and finishing
    started = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"did not (mark the run FINISHED|read the stage.s run) within 1.5 s \(RLHF_STORE_WAIT_S.*was withdrawn"):
        tracker.finish()
    assert time.monotonic() - started < 1.5 + 4.0  # the bound, one request (MLFLOW_HTTP_REQUEST_TIMEOUT), the withdrawal
    assert storage.read_manifest(str(out)) is None  # nothing looks finished
    assert (out / "weights.bin").exists() and (out / storage.WRITING).exists()
    assert storage.check_destination(str(out), "sft").state == storage.UNFINISHED  # a retry replaces it
    proxy.up()
    assert _client(mlflow_server).get_run(tracker.run_id).info.status == "RUNNING"


def test_the_flows_records_wait_for_a_store_that_comes_back_and_not_for_its_answers(proxy, mlflow_server):
    from mlflow.exceptions import MlflowException

    from orchestration import lineage

    parent = lineage.start_pipeline_run("faults", "pipeline-blink", {}, {})
    client = lineage.client()
    proxy.refuse()
    threading.Timer(1.0, proxy.up).start()
    started = time.monotonic()
    client.set_tag(parent, "rlhf.blink", "survived")  # retried until the store is back
    assert 1.0 <= time.monotonic() - started < 10.0
    assert _client(mlflow_server).get_run(parent).data.tags["rlhf.blink"] == "survived"
    started = time.monotonic()
    with pytest.raises(MlflowException) as caught:  # an answer ("no such run") is not retried
        client.get_run("0" * 32)
    assert caught.value.error_code == "RESOURCE_DOES_NOT_EXIST" and time.monotonic() - started < 2.0


# --- a real stage (tiny SFT, one in-process rank) -------------------------------------------------

STEPS, SAVE_STEPS = 6, 2


def _sft_argv(prepared, out: Path, ckpt: Path) -> list[str]:
    return ["train", "sft", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}",
            "--save_path", str(out), "--apply_chat_template", "--max_len", "48", "--train_batch_size", "16",
            "--micro_train_batch_size", "16", "--max_samples", "96", "--max_eval_samples", "16",
            "--max_steps", str(STEPS), "--learning_rate", "1e-3", "--param_dtype", "fp32", "--zero_stage", "0",
            "--save_steps", str(SAVE_STEPS), "--ckpt_path", str(ckpt), "--mlflow_experiment", "faults"]


def _on_step(monkeypatch, actions: dict):
    """Run `actions[step]()` right after the training loop logs step `step` (rank 0, in-process)."""
    from rlhf_core.infra import tracking

    original = tracking.Tracker.log_metrics
    seen = {}

    def log_metrics(self, metrics, step):
        original(self, metrics, step)
        seen["tracker"] = self
        if any(k.startswith("train/") for k in metrics) and step in actions:
            actions.pop(step)(self)

    monkeypatch.setattr(tracking.Tracker, "log_metrics", log_metrics)
    return seen


def _stage_run(port: int, run_id: str):
    return _client(port).get_run(run_id)


def test_a_stage_keeps_training_while_mlflow_is_away_and_its_metrics_arrive_after(
        proxy, mlflow_server, prepared, tmp_path, monkeypatch, capsys, one_torch_thread):
    from rlhf_core.cli import main
    from rlhf_core.infra import storage

    def back(tracker):
        _wait(lambda: tracker.metrics.failing is not None)  # the outage was seen by the sender
        proxy.up()

    seen = _on_step(monkeypatch, {2: lambda tracker: proxy.black_hole(), 4: back})
    out, ckpt = tmp_path / "sft", tmp_path / "ckpt"
    assert main(_sft_argv(prepared, out, ckpt)) == 0, capsys.readouterr().err
    err = capsys.readouterr().err
    assert "did not take metrics" in err and "answers again" in err
    manifest = storage.read_manifest(str(out))
    run = _stage_run(mlflow_server, seen["tracker"].run_id)
    assert manifest["mlflow_run_id"] == run.info.run_id and run.info.status == "FINISHED"
    assert run.data.tags["rlhf.output_uri"] == str(out)
    steps = sorted(m.step for m in _client(mlflow_server).get_metric_history(run.info.run_id, "train/loss"))
    assert steps == list(range(1, STEPS + 1))  # every step's loss, those logged while away included


def test_a_stage_whose_store_stays_away_fails_after_the_bound_with_checkpoints_intact_and_nothing_published(
        proxy, mlflow_server, prepared, tmp_path, monkeypatch, capsys, one_torch_thread):
    from rlhf_core.cli import main
    from rlhf_core.infra import storage

    monkeypatch.setenv("RLHF_STORE_WAIT_S", "2")
    seen = _on_step(monkeypatch, {2: lambda tracker: proxy.refuse()})
    out, ckpt = tmp_path / "sft", tmp_path / "ckpt"
    code = main(_sft_argv(prepared, out, ckpt))
    err = capsys.readouterr().err
    assert code == 1, err  # infrastructure: retried by a pipeline
    error = [line for line in err.splitlines() if line.startswith("rlhf: error:")]
    assert len(error) == 1 and "Traceback" not in err, err
    assert f"MLflow at {proxy.url} did not answer within 2 s (RLHF_STORE_WAIT_S" in error[0]
    assert f"nothing was published at {out}; checkpoints are kept in {ckpt}" in error[0]
    assert not out.exists() and storage.read_manifest(str(out)) is None
    folders = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    steps = [f"global_step{s}" for s in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS)]
    assert folders == sorted(steps), f"the checkpoints of steps 2, 4, 6, whole (no .partial): {folders}"
    assert all(any((ckpt / t).iterdir()) for t in steps), "a checkpoint folder is empty"
    assert (ckpt / "latest").read_text().strip() == f"global_step{STEPS}"
    proxy.up()
    run = _stage_run(mlflow_server, seen["tracker"].run_id)
    assert run.info.status != "FINISHED"  # the flow's cache only reuses FINISHED runs with a stage.json
    assert "rlhf.output_uri" not in run.data.tags


def test_a_stage_whose_run_its_orchestrator_ended_stops_before_publishing(
        proxy, mlflow_server, prepared, tmp_path, monkeypatch, capsys, one_torch_thread):
    """A job driver that outlived its Ray cluster: the flow gave the attempt up and marked its run
    FAILED (then retries elsewhere) while the process still trained. It stops at its next checkpoint
    (writing nothing more where the retry resumes from), never publishes or marks the run FINISHED:
    exit 1 with one line saying why, no output, the run still FAILED."""
    from rlhf_core.cli import main
    from rlhf_core.infra import storage

    seen = _on_step(monkeypatch, {2: lambda tracker: _client(mlflow_server).set_terminated(tracker.run_id, "FAILED")})
    out, ckpt = tmp_path / "sft", tmp_path / "ckpt"
    code = main(_sft_argv(prepared, out, ckpt))
    err = capsys.readouterr().err
    assert code == 1, err
    error = [line for line in err.splitlines() if line.startswith("rlhf: error:")]
    assert len(error) == 1 and "Traceback" not in err, err
    assert "was marked FAILED by another process" in error[0]
    assert f"it stopped at step 2 of {STEPS}: checkpoint global_step2 was not written" in error[0]
    assert storage.read_manifest(str(out)) is None and not list(ckpt.glob("global_step*"))
    assert _stage_run(mlflow_server, seen["tracker"].run_id).info.status == "FAILED"
