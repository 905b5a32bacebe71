"""The embedded default on a machine that never ran it: `rlhf pipeline run` with nothing set, and
the local Ray it starts (127.0.0.1, token authentication on).

The first-run test is the user's first command on a brand-new machine, twice at once: a fresh HOME
(no ~/.prefect, no ~/.ray) and working directory (no .rlhf), a clean environment, the CLI as
subprocesses. Only the compiled DeepSpeed op cache is shared, to save its 40 s build.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import requests
import yaml

import rlhf_core

pytestmark = pytest.mark.integration

ROOT = str(Path(rlhf_core.__file__).resolve().parents[1])
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
TINY = {"settings": {"retries": 0, "stages": ["prep", "sft"]},
        "prep": {"n_train": 128, "n_test": 16},
        "sft": {"max_steps": 2, "train_batch_size": 16, "micro_train_batch_size": 16}}


def _listening(processes) -> set[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket these processes listen on."""
    found = set()
    for p in processes:
        try:
            name = p.name()
            for c in p.net_connections(kind="tcp"):
                if c.status == psutil.CONN_LISTEN:
                    found.add((c.laddr.ip, c.laddr.port, name))
        except psutil.Error:  # it ended meanwhile
            continue
    return found


def _cluster_side(processes) -> list:
    """These processes less the suite's own background preparations (tests/background.py), which
    run beside the tests and are no part of the cluster under test."""
    from tests.background import MARK

    def ours(p) -> bool:
        try:
            return MARK in p.environ()
        except psutil.Error:
            return False
    return [p for p in processes if not ours(p)]


def _without_token(url: str) -> int:
    return requests.get(url, timeout=5).status_code


def test_local_ray_listens_on_loopback_only_and_refuses_requests_without_the_token(monkeypatch):
    import ray
    from ray._private.authentication.http_token_authentication import get_auth_headers_if_auth_enabled
    from ray.util.state import list_nodes

    from orchestration.ray_jobs import ray_cluster

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with ray_cluster() as address:
        assert address.startswith("http://127.0.0.1:")
        assert not ray.is_initialized()  # the flow is no driver: a keeper process holds the cluster
        assert {n.node_ip for n in list_nodes(address=address)} == {"127.0.0.1"}
        assert os.environ["RAY_AUTH_MODE"] == "token"
        jobs = f"{address}/api/jobs/"
        assert _without_token(jobs) == 401
        assert requests.get(jobs, headers={"Authorization": "Bearer " + "0" * 64}, timeout=5).status_code == 403
        assert requests.get(jobs, headers=get_auth_headers_if_auth_enabled({}), timeout=5).status_code == 200
        # The node's job agent runs what it is sent: without the token it refuses too. Its port is a
        # free one chosen at start (not Ray's fixed 52365), so a second local Ray can run beside it.
        (agent_port,) = _agent_ports(address)
        assert agent_port > 0 and agent_port != 52365
        assert requests.post(f"http://127.0.0.1:{agent_port}/api/job_agent/jobs/", json={"entrypoint": "true"},
                             timeout=5).status_code == 401

        # Every process of the cluster (GCS, raylet, dashboard, agents, idle workers) binds loopback.
        sockets = _listening(_cluster_side(psutil.Process().children(recursive=True)))
        assert {"gcs_server", "raylet"} <= {name for _, _, name in sockets}
        exposed = {s for s in sockets if s[0] not in LOOPBACK}
        assert not exposed, f"listening beyond loopback: {sorted(exposed)}"


def _agent_ports(address: str) -> set[int]:
    """The job agents' ports, from the node table: read by a brief driver in a process of its own
    (the flow itself is no driver) at the GCS address the keeper reported, with Ray's cluster mode
    off as in the cluster's own processes (else Ray swaps 127.0.0.1 for the machine's address)."""
    from orchestration.ray_jobs import local_cluster
    from rlhf_core.distributed.local_ray import CLUSTER_MODE

    gcs = local_cluster(address).gcs_address
    code = (f"import json, ray; ray.init(address={gcs!r}, log_to_driver=False, configure_logging=False); "
            "print(json.dumps([n['DashboardAgentListenPort'] for n in ray.nodes()]))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, CLUSTER_MODE: "0"}, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


def test_ensure_ray_starts_a_cli_stage_cluster_on_loopback_with_token_auth(monkeypatch):
    import ray

    from rlhf_core.distributed.cluster import ensure_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert ensure_ray() is True
    try:
        assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}
        assert os.environ["RAY_AUTH_MODE"] == "token"
        assert ray.get(ray.remote(lambda: os.environ.get("RAY_AUTH_MODE")).remote()) == "token"
    finally:
        ray.shutdown()


def _probe_dashboard(stop: threading.Event, codes: list) -> None:
    """The Jobs API's answers to a request without the token while the run goes (000: not up)."""
    while not stop.is_set():
        try:
            codes.append(_without_token("http://127.0.0.1:8265/api/jobs/"))
        except requests.RequestException:
            pass
        time.sleep(0.5)


def _the_printed_prefect_ui_command_serves_a_ui_that_reaches_its_api(output: str, env: dict, cwd: Path,
                                                                     flow_runs: int) -> None:
    """The `Prefect UI:` line's command, run as printed: the UI it serves is told the API URL it is
    served from (not Prefect's default port) and that API lists the runs' flow runs, completed."""
    hint = re.search(r"^Prefect UI: (PREFECT_HOME=\S+ .*prefect server start)  \(then open (http://\S+)\)$",
                     output, re.MULTILINE)
    assert hint, "no Prefect UI command in the output"
    command, url = hint.groups()
    assert str(cwd / ".rlhf" / "prefect") in command
    path = f"{Path(sys.executable).parent}:{env['PATH']}"  # `prefect` as the user's activated venv has it
    server = subprocess.Popen(["bash", "-c", command], cwd=cwd, env={**env, "PATH": path}, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if requests.get(f"{url}/api/health", timeout=5).ok:
                    break
            except requests.RequestException:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "the printed command served nothing"
            time.sleep(1)
        assert requests.get(f"{url}/ui-settings", timeout=10).json()["api_url"] == f"{url}/api"
        runs = requests.post(f"{url}/api/flow_runs/filter", json={"limit": 5}, timeout=10).json()
        assert [r["state_type"] for r in runs] == ["COMPLETED"] * flow_runs, "the UI's API shows the flow runs"
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(30)


def _first_runs(cwd: Path, env: dict, seeds: tuple[int, ...]) -> list[subprocess.CompletedProcess]:
    """`rlhf pipeline run --config run<seed>.yaml` for every seed, started together in `cwd`."""
    procs = []
    for seed in seeds:
        (cwd / f"run{seed}.yaml").write_text(yaml.safe_dump({**TINY, "prep": {**TINY["prep"], "seed": seed}}))
        log = open(cwd / f"run{seed}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", "pipeline", "run", "--config",
                                        f"run{seed}.yaml"], cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                       text=True), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=600)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    return [subprocess.CompletedProcess(proc.args, proc.returncode, Path(log.name).read_text(), "")
            for proc, log in procs]


def test_two_first_pipeline_runs_at_once_on_a_fresh_machine_both_pass_with_their_own_runs(tmp_path):
    """The user's first command on a brand-new machine, twice at once (a scheduled run while a manual
    one runs): both start from nothing (one HOME, so one Ray token, created by whichever starts
    first; one working directory, so one state folder: one SQLite MLflow store, one embedded
    Prefect database, one outputs folder), each starts a local Ray of its own (every port free at
    start, the Jobs API agent's included, and a temp dir of its own, through which Ray's job
    supervisor finds the cluster a job's driver joins). Both must pass without an error line, each
    with its own MLflow pipeline run and stage runs, while the other runs. The prep seeds differ,
    so neither run can reuse the other's outputs."""
    from mlflow import MlflowClient

    home, cwd = tmp_path / "home", tmp_path / "project"
    home.mkdir()
    cwd.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": os.environ.get("LANG", "C.UTF-8"),
           "PYTHONPATH": ROOT, "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"]}

    stop, codes = threading.Event(), []
    probe = threading.Thread(target=_probe_dashboard, args=(stop, codes), daemon=True)
    probe.start()
    try:
        done = _first_runs(cwd, env, seeds=(0, 1))
    finally:
        stop.set()
        probe.join()
    outputs = [run.stdout for run in done]
    for run in done:
        assert run.returncode == 0, run.stdout[-5000:]
        errors = [line for line in run.stdout.splitlines() if re.search(r"\bERROR\b|Traceback", line)]
        assert not errors, "\n".join(errors[:20])
        assert "opt out" not in run.stdout, "no nudge to turn Ray's authentication off"

    # Each run submitted its jobs to a Ray of its own (dashboards 8265 and the next free port) ...
    dashboards = [set(re.findall(r"submitted Ray job rlhf-\S+ to (http://127\.0\.0\.1:\d+)", text)) for text in outputs]
    assert all(len(d) == 1 for d in dashboards) and dashboards[0] != dashboards[1], dashboards
    # ... and every job's driver joined the cluster its run submitted it to: Ray's job supervisor
    # resolves that address through its cluster's temp dir, else through any Ray on the machine.
    joined = [set(re.findall(r"Connecting to existing Ray cluster at address: (127\.0\.0\.1:\d+)", text))
              for text in outputs]
    assert all(len(j) == 1 for j in joined) and joined[0] != joined[1], joined

    state = cwd / ".rlhf"
    client = MlflowClient(f"sqlite:///{state / 'mlflow.db'}")
    spans = []
    for text in outputs:
        parent = client.get_run(re.search(r"=== pipeline run (\w+)", text).group(1))
        assert parent.info.status == "FINISHED" and parent.data.tags["rlhf.kind"] == "pipeline"
        children = client.search_runs([parent.info.experiment_id],
                                      f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
        assert {r.data.tags["rlhf.stage_name"] for r in children} == {"prep", "sft"}
        for run in children:
            assert run.info.status == "FINISHED" and "rlhf.cached_from" not in run.data.tags
            assert (Path(run.data.tags["rlhf.output_uri"]) / "stage.json").is_file()
        assert any(k.startswith("train/") for k in next(r for r in children
                                                         if r.data.tags["rlhf.stage_name"] == "sft").data.metrics)
        spans.append((min(r.info.start_time for r in children), max(r.info.end_time for r in children)))
    # The two runs' stages overlapped in time: both local Rays were up and running jobs together.
    (a_start, a_end), (b_start, b_end) = spans
    assert a_start < b_end and b_start < a_end, spans

    assert (state / "prefect" / "prefect.db").is_file() and not (home / ".prefect").exists()
    _the_printed_prefect_ui_command_serves_a_ui_that_reaches_its_api(outputs[0], env, cwd, flow_runs=2)
    token = home / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600
    assert not (home / ".config" / "mlflow" / "telemetry.json").exists(), "MLflow's telemetry stayed off"
    assert 401 in codes and 200 not in codes, f"the Jobs API without the token answered {sorted(set(codes))}"


def test_a_sigkilled_pipeline_run_leaves_nothing_running(tmp_path):
    """`rlhf pipeline run` SIGKILLed while a stage job runs (the OOM killer, `kill -9`): within
    seconds nothing it started runs on: not Prefect's ephemeral API server (uvicorn, which outlived
    such a kill by 10 minutes and more before orchestration/lifeline.py), not the local Ray's keeper, GCS,
    raylet, dashboard and workers, not the job's driver."""
    home = tmp_path / "home"
    home.mkdir()
    config = {**TINY, "sft": {**TINY["sft"], "max_steps": 5000}}
    (tmp_path / "long.yaml").write_text(yaml.safe_dump(config))
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": os.environ.get("LANG", "C.UTF-8"),
           "PYTHONPATH": ROOT, "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"], "RLHF_NO_PROGRESS": "1"}
    with open(tmp_path / "run.log", "w") as log:
        flow = subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", "pipeline", "run", "--config", "long.yaml"],
                                cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 400
        while not any(re.search(r"rlhf_core\.cli (prep|train sft)", _cmdline(p)) for p in started):  # a stage's driver
            assert flow.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no stage job's driver ever started"
            time.sleep(1)
            started = psutil.Process(flow.pid).children(recursive=True)
        names = {p.name() for p in started if _alive(p)} | {"uvicorn" for p in started if "uvicorn" in _cmdline(p)}
        assert {"uvicorn", "gcs_server", "raylet"} <= names, f"the run's processes: {sorted(names)}"

        flow.kill()
        flow.wait(10)
        killed = time.monotonic()
        while (left := [p for p in started if _alive(p)]) and time.monotonic() < killed + 30:
            time.sleep(0.5)
        print(f"{len(started)} processes of the run, all gone {time.monotonic() - killed:.1f}s after its SIGKILL")
        assert not left, "still running after the flow's SIGKILL: " + \
            "; ".join(f"{p.pid} {_cmdline(p)[:120]}" for p in left)
    finally:
        if flow.poll() is None:
            flow.kill()
        for p in started:
            if _alive(p):
                p.kill()


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
