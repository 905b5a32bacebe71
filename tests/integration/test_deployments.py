"""The deployments on the local stack: `deployments/stack.sh start`, then the flow runs through a
Prefect server and a process worker, submits its stages to the stack's Ray head as jobs and logs
to its MLflow server; a single-stage rerun reuses the first run's outputs without touching them.

Sized to finish in a few minutes on 2 CPU cores: 256 training rows, 4 optimizer steps a stage.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STACK_SH = REPO / "deployments" / "stack.sh"
PREFECT = str(REPO / ".venv" / "bin" / "prefect")
TINY = {"max_steps": 4, "train_batch_size": 16, "micro_train_batch_size": 16}
STAGES = ["prep", "sft", "rm", "dpo", "eval"]


def _clean_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI", "RLHF_JOB_COMMAND",
                        "RLHF_ARTIFACT_ROOT")}
    env["RLHF_HOME"] = str(home)
    # Reuse the session's compiled DeepSpeed ops (tests/conftest.py) instead of compiling them again.
    env.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/rlhf-torch-extensions"))
    return env


def _read_env_file(path: Path) -> dict[str, str]:
    values = {}
    for line in path.read_text().splitlines():
        if line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            values[key] = shlex.split(value)[0] if value else ""
    return values


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A started stack in a fresh RLHF_HOME; always stopped afterwards, even when start fails."""
    home = tmp_path_factory.mktemp("stack_home")
    env = _clean_env(home)
    started = time.perf_counter()
    try:
        proc = subprocess.run(["bash", str(STACK_SH), "start"], env=env, capture_output=True, text=True,
                              timeout=360)
        assert proc.returncode == 0, f"stack.sh start failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        values = _read_env_file(home / "stack" / "stack.env")
        for key in ("PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI", "RAY_AUTH_MODE", "RLHF_JOB_COMMAND",
                    "RLHF_HOME"):
            assert values.get(key), f"stack.env lacks {key}"
        client_env = {**env, **values, "PREFECT_HOME": str(home / "stack" / "prefect")}
        print(f"stack up in {time.perf_counter() - started:.0f}s")
        yield {"home": home, "env": client_env, **values}
    finally:
        started_pids = _recorded_pids(home / "stack" / "pids")
        stop = subprocess.run(["bash", str(STACK_SH), "stop"], env=env, capture_output=True, text=True,
                              timeout=180)
        print(stop.stdout[-2000:], stop.stderr[-2000:])
    assert stop.returncode == 0, stop.stderr[-2000:]
    assert not (home / "stack" / "stack.env").exists(), "stack.sh stop left its env file behind"
    assert not (home / "stack" / "pids").exists(), "stack.sh stop left pid files behind"
    assert not [p for p in started_pids if _running(p)], "stack.sh stop left some of its processes running"


def _recorded_pids(folder: Path) -> set[int]:
    if not folder.is_dir():
        return set()
    return {int(p) for f in folder.iterdir() for p in f.read_text().split()}


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # zombies are gone
    except (OSError, IndexError):
        return False


def _params(**sections) -> dict:
    """Whole flow-parameter sections, built the way `rlhf pipeline run --config` builds them.

    A section given at run time replaces the deployment's; stage sections are completed from the
    pipeline's tuned defaults either way.
    """
    from flows.cli import flow_parameters

    built = flow_parameters(sections)
    return {name: built[name].model_dump(mode="json") for name in sections}


def _run_deployment(stack, name: str, params: dict, timeout: int = 420) -> str:
    """`prefect deployment run <name> --watch`; returns the flow run id after checking it COMPLETED."""
    started = time.perf_counter()
    proc = subprocess.run([PREFECT, "--no-prompt", "deployment", "run", name, "--params", json.dumps(params),
                           "--watch", "--watch-timeout", str(timeout)], env=stack["env"], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout + 60)
    out = proc.stdout + proc.stderr
    match = re.search(r"UUID: ([0-9a-f-]{36})", out)
    assert match, f"no flow run id in the output of prefect deployment run:\n{out[-3000:]}"
    flow_run_id = match.group(1)
    state = _api(stack, f"/flow_runs/{flow_run_id}")["state"]
    print(f"{name}: {state['type']} in {time.perf_counter() - started:.0f}s")
    if state["type"] != "COMPLETED":
        logs = subprocess.run([PREFECT, "flow-run", "logs", flow_run_id, "--tail", "--num-logs", "60"],
                              env=stack["env"], capture_output=True, text=True, timeout=120).stdout
        pytest.fail(f"{name} ended {state['type']}: {state.get('message')}\n{out[-2000:]}\n{logs[-6000:]}")
    assert proc.returncode == 0, out[-3000:]
    return flow_run_id


def _api(stack, path: str) -> dict:
    with urllib.request.urlopen(stack["PREFECT_API_URL"].rstrip("/") + path, timeout=30) as r:
        return json.load(r)


def _mlflow(stack):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=stack["MLFLOW_TRACKING_URI"])


def _pipeline_run(client, flow_run_id: str):
    exp = client.get_experiment_by_name("rlhf")
    runs = client.search_runs([exp.experiment_id], f"tags.`rlhf.kind` = 'pipeline' and "
                              f"tags.`rlhf.prefect_flow_run_id` = '{flow_run_id}'")
    assert len(runs) == 1, f"expected one MLflow pipeline run for flow run {flow_run_id}, got {len(runs)}"
    children = client.search_runs([exp.experiment_id], f"tags.`mlflow.parentRunId` = '{runs[0].info.run_id}'")
    return runs[0], {c.data.tags["rlhf.stage"]: c for c in children}


def _snapshot(folder: Path) -> dict[str, tuple[int, str]]:
    return {str(p.relative_to(folder)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_full_pipeline_then_single_stage_rerun(stack):
    client = _mlflow(stack)
    tiny_params = _params(settings={"stages": STAGES}, prep={"n_train": 256, "n_test": 32},
                          sft=TINY, rm=TINY, dpo=TINY, evaluation={"max_samples": 32})
    first = _run_deployment(stack, "rlhf/full-pipeline", tiny_params)

    parent, children = _pipeline_run(client, first)
    assert parent.info.status == "FINISHED"
    assert set(STAGES) <= set(children), f"child runs per stage: {sorted(children)}"
    assert all(c.info.status == "FINISHED" and "rlhf.cached_from" not in c.data.tags for c in children.values())
    sft_out = Path(children["sft"].data.tags["rlhf.output_uri"])
    assert (sft_out / "stage.json").is_file()
    assert str(sft_out).startswith(str(stack["home"])), "outputs belong under the stack's RLHF_HOME"
    before = _snapshot(sft_out)
    prep_before = _snapshot(Path(children["prep"].data.tags["rlhf.output_uri"]))

    # Single-stage rerun from the per-stage deployment, on the first run's SFT model and data.
    rerun_params = _params(settings={"stages": ["dpo"], "from_run": parent.info.run_id, "force_stages": ["dpo"]},
                           dpo=TINY)
    second = _run_deployment(stack, "rlhf/dpo", rerun_params)

    parent2, children2 = _pipeline_run(client, second)
    assert parent2.info.status == "FINISHED"
    assert parent2.data.tags.get("rlhf.from_run") == parent.info.run_id
    trained = {stage for stage, run in children2.items() if "rlhf.cached_from" not in run.data.tags}
    assert trained == {"dpo"}, f"only dpo trains in the rerun (force_stages=[dpo]), got {sorted(trained)}"
    for stage in set(children2) - trained:  # the upstream outputs it took from the first run, recorded
        assert children2[stage].data.tags.get("rlhf.reused_from_run") == children[stage].info.run_id
    dpo = children2["dpo"]
    assert dpo.data.tags["rlhf.upstream.model.model_uri"] == children["sft"].data.tags["rlhf.output_uri"]
    assert dpo.data.tags["rlhf.upstream.model.run_id"] == children2["sft"].info.run_id
    assert Path(dpo.data.tags["rlhf.output_uri"]) != Path(children["dpo"].data.tags["rlhf.output_uri"])
    assert _snapshot(sft_out) == before, "the rerun modified the first run's SFT output"
    assert _snapshot(Path(children["prep"].data.tags["rlhf.output_uri"])) == prep_before


def _ray_jobs(stack) -> dict[str, str]:
    """Submission id -> status on the stack's Ray, asked from a fresh process (Ray reads its auth mode
    from the environment once per process; the stack's clients need RAY_AUTH_MODE=token)."""
    code = ("import json, os\nfrom ray.job_submission import JobSubmissionClient\n"
            "jobs = JobSubmissionClient(os.environ['RAY_ADDRESS']).list_jobs()\n"
            "print(json.dumps({j.submission_id: j.status.value for j in jobs if j.submission_id}))")
    out = subprocess.run([str(REPO / ".venv" / "bin" / "python"), "-c", code], env=stack["env"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cancelling_a_flow_run_stops_its_ray_job(stack):
    """Cancel from Prefect while a stage job runs: the job is stopped, not left training."""
    long_sft = {**TINY, "max_steps": 5000, "max_epochs": 400}
    params = _params(settings={"stages": ["prep", "sft"], "force_stages": ["sft"]},
                     prep={"n_train": 256, "n_test": 32}, sft=long_sft)
    proc = subprocess.run([PREFECT, "--no-prompt", "deployment", "run", "rlhf/sft", "--params", json.dumps(params)],
                          env=stack["env"], cwd=REPO, capture_output=True, text=True, timeout=120)
    flow_run_id = re.search(r"UUID: ([0-9a-f-]{36})", proc.stdout + proc.stderr).group(1)

    def running_sft() -> list[str]:
        return [j for j, status in _ray_jobs(stack).items() if j.startswith("rlhf-sft-") and status == "RUNNING"]

    deadline = time.time() + 300
    while not running_sft() and time.time() < deadline:
        time.sleep(2)
    running = running_sft()
    assert running, "the SFT job never started"
    cancel = subprocess.run([PREFECT, "--no-prompt", "flow-run", "cancel", flow_run_id], env=stack["env"],
                            capture_output=True, text=True, timeout=60)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    deadline = time.time() + 120
    while _ray_jobs(stack)[running[0]] == "RUNNING" and time.time() < deadline:
        time.sleep(2)
    # STOPPED, not FAILED: the flow run's task stopped its job on the way out (RayJobRunner.stop).
    assert _ray_jobs(stack)[running[0]] == "STOPPED", "the cancelled flow's Ray job was not stopped by the flow"
    deadline = time.time() + 60
    while (state := _api(stack, f"/flow_runs/{flow_run_id}")["state"]["type"]) == "CANCELLING" and \
            time.time() < deadline:
        time.sleep(2)
    assert state == "CANCELLED", state
