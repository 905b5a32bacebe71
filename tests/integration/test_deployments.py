"""The deployments on the local stack: `deployments/stack.sh start`, then the flow runs through a
Prefect server and a process worker, submits its stages to the stack's Ray head as jobs and logs
to its MLflow server; a single-stage rerun reuses the first run's outputs without touching them.
The three UIs are then used as a person uses them, in a real browser (tests/integration/browser.py):
the Prefect UI's flow-run graph and report, a single-stage rerun submitted from its custom-run
form, the MLflow UI's registry and report, the Ray dashboard's token prompt.

Sized to finish in a few minutes on 2 CPU cores: 256 training rows, 4 optimizer steps a stage,
two RL steps. `RLHF_UI_SCREENSHOTS=docs/images` saves the README's screenshots there.
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

from tests.integration import browser

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
STACK_SH = REPO / "deployments" / "stack.sh"
PREFECT = str(REPO / ".venv" / "bin" / "prefect")
TINY = {"max_steps": 4, "train_batch_size": 16, "micro_train_batch_size": 16}
TINY_PPO = {"train.max_steps": 2, "rollout.batch_size": 8, "rollout.n_samples_per_prompt": 4,
            "train.batch_size": 32, "train.micro_batch_size": 16, "rollout.micro_batch_size": 32,
            "critic.freezing_steps": 0, "eval.n_samples_per_prompt": 1}
STAGES = ["prep", "sft", "rm", "ppo", "eval"]  # the default pipeline
RERUN_LR = 5e-4  # the SFT rerun's learning rate, typed into the Prefect UI's form (the first run's: 1e-3)


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


@pytest.fixture(scope="module")
def first_run(stack):
    """The full pipeline (the default stages, tiny) through `prefect deployment run rlhf/full-pipeline`."""
    client = _mlflow(stack)
    tiny_params = _params(settings={"stages": STAGES}, prep={"n_train": 256, "n_test": 32},
                          sft=TINY, rm=TINY, ppo=TINY_PPO, evaluation={"max_samples": 16, "n_samples_per_prompt": 2})
    flow_run_id = _run_deployment(stack, "rlhf/full-pipeline", tiny_params)
    parent, children = _pipeline_run(client, flow_run_id)
    outputs = {stage: Path(run.data.tags["rlhf.output_uri"]) for stage, run in children.items()}
    return {"flow_run_id": flow_run_id, "parent": parent, "children": children, "outputs": outputs,
            "snapshots": {stage: _snapshot(outputs[stage]) for stage in ("prep", "sft")}}


def test_full_pipeline_then_single_stage_rerun(stack, first_run):
    client = _mlflow(stack)
    parent, children = first_run["parent"], first_run["children"]
    assert parent.info.status == "FINISHED"
    assert set(STAGES) <= set(children), f"child runs per stage: {sorted(children)}"
    assert all(c.info.status == "FINISHED" and "rlhf.cached_from" not in c.data.tags for c in children.values())
    sft_out = first_run["outputs"]["sft"]
    assert (sft_out / "stage.json").is_file()
    assert str(sft_out).startswith(str(stack["home"])), "outputs belong under the stack's RLHF_HOME"

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
    _upstream_untouched(first_run)


def _upstream_untouched(first_run) -> None:
    for stage, before in first_run["snapshots"].items():
        assert _snapshot(first_run["outputs"][stage]) == before, f"a rerun modified the first run's {stage} output"


# -- the UIs, in a real browser ----------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium():
    with browser.browser() as b:
        yield b


@pytest.fixture
def shots(tmp_path) -> Path:
    """Where screenshots go: RLHF_UI_SCREENSHOTS (the README's docs/images) or the test's tmp dir."""
    folder = os.environ.get("RLHF_UI_SCREENSHOTS")
    return Path(folder).resolve() if folder else tmp_path


def _prefect_ui(stack) -> str:
    return stack["PREFECT_API_URL"].rstrip("/").removesuffix("/api")


def test_prefect_ui_shows_the_flow_run_graph_and_the_report(stack, first_run, chromium, shots):
    ui, flow_run_id = _prefect_ui(stack), first_run["flow_run_id"]
    assert _get_json(f"{ui}/ui-settings")["api_url"] == stack["PREFECT_API_URL"], "the UI asks the API it is served by"
    with browser.page(chromium) as page:
        page.goto(ui)  # as a user opens the URL stack.sh prints, then Runs and the run
        page.get_by_role("link", name="Runs", exact=True).first.click()
        run_name = _api(stack, f"/flow_runs/{flow_run_id}")["name"]
        with page.expect_response(lambda r: r.url.endswith(f"/flow_runs/{flow_run_id}/graph-v2")) as graph:
            page.get_by_role("link", name=run_name, exact=True).first.click()
        assert graph.value.ok
        nodes = {node_id: node for node_id, node in graph.value.json()["nodes"]}
        label = {node_id: node["label"] for node_id, node in nodes.items()}
        assert sorted(label.values()) == sorted(STAGES), "the graph's task nodes are the pipeline's stages"
        edges = {(label[p["id"]], label[node_id]) for node_id, node in nodes.items() for p in node["parents"]}
        assert {("prep", "sft"), ("prep", "rm"), ("sft", "ppo"), ("rm", "ppo"), ("ppo", "eval")} <= edges, edges
        assert page.get_by_text("Completed").first.is_visible()
        canvas = page.locator("canvas").first
        canvas.wait_for(state="visible")
        page.wait_for_timeout(1500)  # the graph's layout animates in
        assert _green_fraction(canvas.screenshot()) > 0.01, "no completed task node is drawn on the graph"
        assert not page.get_by_text("Can't connect to Server API").count()
        browser.screenshot(page, shots, "prefect-flow-run-graph.png")

        page.get_by_role("tab", name="Artifacts").click()
        page.get_by_text("rlhf-pipeline-report", exact=True).first.click()
        page.get_by_role("heading", name="RLHF pipeline report").wait_for()
        table = page.locator("table").filter(has_text="sampled accuracy").first
        assert "ppo" in table.inner_text() and "reference" in table.inner_text()
        page.wait_for_function("() => Array.from(document.images).filter(i => i.src.startsWith('data:image/png')"
                               " && i.complete && i.naturalWidth > 100).length >= 4")
        charts = page.evaluate("() => Array.from(document.images).filter(i => i.naturalWidth > 100).map(i => i.alt)")
        assert {"sft: training curves", "rm: training curves", "ppo: training curves"} <= set(charts), charts


def _green_fraction(png: bytes) -> float:
    """The share of a graph's pixels, above its state bar, in the strong green of a completed task
    node (about 3% for this pipeline's five nodes; the completed run's background tint is not)."""
    import io

    import numpy as np
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    pixels = np.asarray(image.crop((0, 0, image.width, image.height - 30))).astype(int)
    red, green, blue = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    return float(((green > red + 60) & (green > blue + 40)).mean())


def _submit_until_accepted(page, stack, tries: int = 3) -> dict:
    """Clicks the custom-run form's Submit and returns the created flow run.

    Prefect's server answers 503 "Service Unavailable" when its SQLite database was busy (a
    deferred transaction that read the deployment lost the race to write against the stack's
    background writers); Prefect's own clients retry such answers, and a person clicks Submit
    again. Any other failure, or a 503 on every try, fails with the server's log.
    """
    for attempt in range(1, tries + 1):
        with page.expect_response(lambda r: r.request.method == "POST" and r.url.endswith("/create_flow_run")) as made:
            page.get_by_role("button", name="Submit").click()
        if made.value.ok:
            return made.value.json()
        if made.value.status != 503:
            break
        print(f"create_flow_run answered 503 on try {attempt}")
        page.wait_for_timeout(2000)
    log = Path(stack["home"]) / "stack" / "logs" / "prefect-server.log"
    tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no server log)"
    pytest.fail(f"create_flow_run answered {made.value.status} on try {attempt}: {made.value.text()}\n{log}:\n{tail}")


def test_a_single_stage_rerun_submitted_from_the_prefect_ui(stack, first_run, chromium, shots):
    """Deployments -> sft -> Run -> Custom run: from_run and a new learning rate typed into the form,
    submitted; the flow run completes, trains SFT alone, and the first run's outputs are untouched."""
    parent = first_run["parent"]
    with browser.page(chromium) as page:
        page.goto(_prefect_ui(stack))
        page.get_by_role("link", name="Deployments", exact=True).first.click()
        # More deployments than a page shows: found as a user finds one, by its name
        page.get_by_placeholder(re.compile("^Search deployments")).first.fill("sft")
        page.get_by_role("link", name="sft", exact=True).click()
        page.get_by_role("button", name="Run").first.click()
        page.get_by_role("menuitem", name="Custom run").click()
        from_run = browser.form_group(page, "From Run (Optional)")
        from_run.get_by_role("tab", name="str").click()
        from_run.locator("textarea, input").first.fill(parent.info.run_id)
        sft = browser.form_group(page, "sft (Optional)")
        train = browser.form_group(sft, "train (Optional)")  # the config's sections are the form's
        max_steps = browser.form_group(train, "Max Steps (Optional)")
        max_steps.get_by_role("tab", name="int").click()
        max_steps.locator("input").fill(str(TINY["max_steps"]))
        browser.form_group(train, "Batch Size (Optional)").locator("input").fill(str(TINY["train_batch_size"]))
        browser.form_group(train, "Micro Batch Size (Optional)").locator("input").fill(
            str(TINY["micro_train_batch_size"]))
        browser.form_group(browser.form_group(sft, "adam (Optional)"), "Lr (Optional)").locator("input").fill(
            str(RERUN_LR))
        from_run.scroll_into_view_if_needed()
        browser.screenshot(page, shots, "prefect-custom-run-form.png")
        made = _submit_until_accepted(page, stack)
        flow_run_id, run_name = made["id"], made["name"]
        page.get_by_text(run_name).first.wait_for()  # the UI shows the new run

    state = _wait_for_flow_run(stack, flow_run_id, timeout=420)
    assert state["type"] == "COMPLETED", f"the UI-submitted rerun ended {state['type']}: {state.get('message')}"
    rerun, children = _pipeline_run(_mlflow(stack), flow_run_id)
    assert rerun.data.tags.get("rlhf.from_run") == parent.info.run_id
    trained = {stage for stage, run in children.items() if "rlhf.cached_from" not in run.data.tags
               and "rlhf.reused_from_run" not in run.data.tags}
    assert trained == {"sft"}, f"the rerun trains SFT alone, trained {sorted(trained)}"
    assert children["prep"].data.tags.get("rlhf.reused_from_run") == first_run["children"]["prep"].info.run_id
    sft = children["sft"]
    assert float(sft.data.params["adam.lr"]) == RERUN_LR, "the form's learning rate reached the stage"
    assert Path(sft.data.tags["rlhf.output_uri"]) != first_run["outputs"]["sft"]
    _upstream_untouched(first_run)


def test_mlflow_ui_shows_the_champion_and_the_pipeline_report(stack, first_run, chromium):
    mlflow_ui, parent = stack["MLFLOW_TRACKING_URI"], first_run["parent"]
    with browser.page(chromium) as page:
        page.goto(f"{mlflow_ui}/#/models/rlhf-policy")
        version = page.get_by_role("row").filter(has_text="Version 1")
        version.wait_for()
        assert "champion" in version.inner_text(), version.inner_text()
        page.goto(f"{mlflow_ui}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}/artifacts")
        page.get_by_text("report", exact=True).first.click()
        page.get_by_text("report.md", exact=True).first.click()
        page.get_by_text("Did RLHF help?").first.wait_for()


def test_ray_dashboard_refuses_without_the_token_and_opens_with_it(stack, first_run, chromium):
    token = _ray_token()
    jobs_page = stack["RAY_ADDRESS"] + "/#/jobs"
    with browser.page(chromium) as page:
        answered = []
        page.on("response", lambda r: answered.append(r.status) if "/api/jobs/" in r.url else None)
        with page.expect_response(lambda r: "/api/jobs/" in r.url) as first:
            page.goto(jobs_page)  # the jobs page asks the Jobs API at once
        assert first.value.status == 401, f"the Jobs API without the token answered {first.value.status}"
        page.get_by_text("Authentication Token Required").wait_for()
        assert 200 not in answered, f"the Jobs API without the token answered {answered}"
        page.get_by_role("textbox", name="Authentication Token").click()
        page.keyboard.insert_text(token)  # not fill(): a failing fill prints its value, and this is a secret
        # Submit checks the token, stores it and reloads the page (the jobs page again).
        with page.expect_event("load"):
            page.get_by_role("button", name="Submit").click()
        page.get_by_text(re.compile(r"^rlhf-[a-z]+-[0-9a-f]{8}$")).first.wait_for()  # the stage jobs, listed
        assert 200 in answered, f"the Jobs API with the token answered {answered}"


def _ray_token() -> str:
    """The token the stack's Ray runs with: where `ray get-auth-token` reads it (stack.sh's rule)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"]
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.expanduser("~/.ray/auth_token")
    return Path(path).read_text().strip()


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.load(r)


def _wait_for_flow_run(stack, flow_run_id: str, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = _api(stack, f"/flow_runs/{flow_run_id}")["state"]
        if state["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") or time.monotonic() > deadline:
            return state
        time.sleep(3)


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


def _start_long_sft(stack) -> tuple[str, str]:
    """A flow run of rlhf/sft with a long SFT; returns (flow run id, submission id) once its SFT job runs."""
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
    return flow_run_id, running[0]


def _wait_for_job(stack, submission_id: str, timeout: float) -> str:
    deadline = time.time() + timeout
    while (status := _ray_jobs(stack)[submission_id]) == "RUNNING" and time.time() < deadline:
        time.sleep(2)
    return status


def test_cancelling_a_flow_run_stops_its_ray_job(stack):
    """Cancel from Prefect while a stage job runs: the job is stopped, not left training."""
    flow_run_id, job = _start_long_sft(stack)
    cancel = subprocess.run([PREFECT, "--no-prompt", "flow-run", "cancel", flow_run_id], env=stack["env"],
                            capture_output=True, text=True, timeout=60)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    # STOPPED, not FAILED: the flow run's task stopped its job on the way out (RayJobRunner.stop).
    assert _wait_for_job(stack, job, 120) == "STOPPED", "the cancelled flow's Ray job was not stopped by the flow"
    deadline = time.time() + 60
    while (state := _api(stack, f"/flow_runs/{flow_run_id}")["state"]["type"]) == "CANCELLING" and \
            time.time() < deadline:
        time.sleep(2)
    assert state == "CANCELLED", state


def test_a_sigkilled_flow_run_process_leaves_no_job_running(stack):
    """The worker's flow-run process SIGKILLed (the OOM killer) while its SFT job trains on the
    stack's Ray: no `finally` runs in it, and its watcher (orchestration/lifeline.py) stops the job."""
    import psutil

    flow_run_id, job = _start_long_sft(stack)
    worker = psutil.Process(int((stack["home"] / "stack" / "pids" / "prefect-worker.pid").read_text()))
    watchers = [p for p in worker.children(recursive=True) if "orchestration.lifeline" in _cmdline(p)]
    assert len(watchers) == 1, "one flow run, one watcher"
    flow_process = psutil.Process(int(watchers[0].cmdline()[-1]))  # the process running the flow's code
    assert flow_process.environ().get("PREFECT__FLOW_RUN_ID") == flow_run_id
    flow_process.kill()
    started = time.monotonic()
    assert _wait_for_job(stack, job, 60) == "STOPPED", "the killed flow's Ray job trained on"
    print(f"job stopped {time.monotonic() - started:.1f}s after the flow process was killed")


def _cmdline(p) -> str:
    import psutil

    try:
        return " ".join(p.cmdline())
    except psutil.Error:  # it ended meanwhile
        return ""
