"""The `rlhf` flow on the embedded default: Prefect in-process, a local Ray with the Jobs API, SQLite MLflow.

One full tiny pipeline (the default stages: prep -> SFT -> reward model -> PPO -> eval) is run
once per module; the other tests build on it: a cached rerun, single-stage reruns (DPO, PPO) from
it, DPO and PPO evaluated side by side, a configuration error, a Ray job killed mid-stage, S3
outputs, and two iterative-DPO rounds. Models are tiny and steps few: these tests prove the
orchestration (jobs, retries, caching, lineage, registry), the unit and trainer tests prove the
learning.

The evaluation stage calls `rlhf eval --pretrain A,B --policy_names dpo,ppo` and reads
`eval/<name>/<metric>`: every test here that uses `first_run` depends on that `rlhf eval`.
"""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

STEPS = {"max_steps": 4, "train_batch_size": 16, "micro_train_batch_size": 16}
# Two RL steps of 8 prompts x 4 samples, a checkpoint after each (the folder a retry resumes from).
PPO_STEPS = {"train.max_steps": 2, "rollout.batch_size": 8, "rollout.n_samples_per_prompt": 4,
             "train.batch_size": 32, "train.micro_batch_size": 16, "rollout.micro_batch_size": 32,
             "critic.freezing_steps": 0, "eval.n_samples_per_prompt": 1}
TINY = {
    "settings": {"retries": 0, "checkpoint_steps": 1},
    "prep": {"n_train": 256, "n_test": 32, "student_size": "nano"},  # a student base for runs that distill
    "sft": STEPS,
    "rm": STEPS,
    "dpo": STEPS,
    "ppo": PPO_STEPS,
    "distill": STEPS,
    "evaluation": {"max_samples": 16, "n_samples_per_prompt": 2},
}
DEFAULT_STAGES = {"prep", "sft", "rm", "ppo", "eval"}
# Credential variables set while the first run runs; test_planted_secrets_reach_no_store searches for them.
PLANTED = {"HF_TOKEN": "hf_plantedPipelineToken42", "WANDB_API_KEY": "planted-wandb-key-9f3a",
           "MLFLOW_TRACKING_TOKEN": "planted-mlflow-token-c0de", "RLHF_RM_TOKEN": "planted-rm-token-5e5e"}


def params(**sections) -> dict:
    from flows.cli import flow_parameters

    config = {k: dict(v) for k, v in TINY.items()}
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    return flow_parameters(config)


@pytest.fixture(scope="module")
def harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="module")
def first_run(harness, tmp_path_factory):
    """The README's main command, `rlhf pipeline run`, with tiny settings; its saved summary."""
    import contextlib
    import io
    import json
    import re

    import yaml

    from rlhf_core.cli import main

    config = tmp_path_factory.mktemp("pipeline") / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY))
    printed = io.StringIO()
    saved = {name: os.environ.get(name) for name in PLANTED}
    started = time.time()
    os.environ.update(PLANTED)  # credentials in the flow's environment: no record may carry them
    try:
        with contextlib.redirect_stdout(printed):
            assert main(["pipeline", "run", "--config", str(config)]) == 0
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    text = printed.getvalue()
    summary = json.loads(Path(re.search(r"summary:\s+(\S+)", text).group(1)).read_text())
    return {**summary, "printed": text, "job_logs": job_driver_logs(started)}


def job_driver_logs(since: float) -> list[Path]:
    """The driver logs of the Ray jobs that ran since `since`: each local Ray a flow starts has a temp
    dir of its own (`/tmp/rlhf-ray-<pid of its keeper>`), whose session logs hold every job's log."""
    import tempfile

    logs = Path(tempfile.gettempdir()).glob("rlhf-ray-*/session_*/logs/job-driver-rlhf-*")
    return [p for p in logs if p.stat().st_mtime >= since]


def mlflow_client():
    from mlflow import MlflowClient

    from rlhf_core.infra.settings import tracking_uri

    return MlflowClient(tracking_uri())


def child_runs(parent_run_id: str) -> dict:
    c = mlflow_client()
    experiment = c.get_run(parent_run_id).info.experiment_id
    runs = c.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    return {r.data.tags["rlhf.stage_name"]: r for r in runs}


def tree_digest(path: str) -> str:
    h = hashlib.sha256()
    for f in sorted(Path(path).rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes() + str(f.stat().st_mtime_ns).encode())
    return h.hexdigest()


def test_full_pipeline_records_lineage_registry_and_evaluation(first_run):
    """The default pipeline runs SFT -> RM -> PPO -> eval, registers the PPO policy and promotes it."""
    from rlhf_core.infra import storage
    from rlhf_core.stages.provenance import build, render

    assert set(first_run["stages"]) == DEFAULT_STAGES
    assert not any(t["cached"] for t in first_run["stages"].values())
    for name, uri in first_run["outputs"].items():
        assert storage.read_manifest(uri) is not None, name

    parent = mlflow_client().get_run(first_run["pipeline_run_id"])
    assert parent.info.status == "FINISHED" and parent.data.tags["rlhf.kind"] == "pipeline"
    runs = child_runs(first_run["pipeline_run_id"])
    assert set(runs) == DEFAULT_STAGES
    ppo_tags = runs["ppo"].data.tags
    for role, stage in (("model", "sft"), ("reference", "sft"), ("reward", "rm"), ("critic", "rm"), ("data", "prep")):
        assert ppo_tags[f"rlhf.upstream.{role}.run_id"] == runs[stage].info.run_id, role
    assert ppo_tags["rlhf.upstream.model.model_uri"] == first_run["outputs"]["sft"]
    assert ppo_tags["rlhf.upstream.critic.model_uri"] == first_run["outputs"]["rm"]
    assert ppo_tags["rlhf.prefect_flow_run_id"] == first_run["prefect_flow_run_id"]
    assert ppo_tags["rlhf.code_version"] and ppo_tags["rlhf.cache_key"].startswith("sha256:")
    assert runs["sft"].inputs.dataset_inputs, "datasets logged as MLflow inputs"
    assert runs["sft"].data.metrics["eval/loss"] < runs["sft"].data.metrics["eval_initial/loss"]
    ppo_manifest = storage.read_manifest(first_run["outputs"]["ppo"])
    assert ppo_manifest["stage"] == "ppo" and "eval/sampled_accuracy" in ppo_manifest["metrics"]
    # The RL state was checkpointed in the run's output area, claimed by the stage's cache key.
    checkpoints = Path(ppo_tags["rlhf.checkpoint_uri"])
    assert checkpoints.parent.name == "checkpoints" and (checkpoints / "latest").is_file()
    assert ppo_tags["rlhf.cache_key"] in (checkpoints / "rlhf-stage-key.json").read_text()

    evaluation = first_run["evaluation"]["metrics"]
    assert first_run["evaluation"]["policies"] == ["ppo"]
    for key in ("eval/ppo/sampled_accuracy", "eval/ppo/greedy_accuracy", "eval/ppo/win_rate", "eval/ppo/kl",
                "eval/ppo/reward", "eval/ppo/response_len", "eval/ppo/pass_at_2", "eval/reference/sampled_accuracy"):
        assert key in evaluation, key

    c = mlflow_client()
    for name in ("rlhf-sft", "rlhf-reward", "rlhf-policy"):
        assert c.get_model_version_by_alias(name, "candidate").tags["rlhf.output_uri"]
    champion = c.get_model_version_by_alias("rlhf-policy", "champion")
    assert champion.tags["rlhf.output_uri"] == first_run["outputs"]["ppo"] and champion.tags["rlhf.stage"] == "ppo"
    assert float(champion.tags["rlhf.eval.sampled_accuracy"]) == evaluation["eval/ppo/sampled_accuracy"]

    text = render(build("models:/rlhf-policy@champion"))
    for expected in ("ppo [model]", "sft [model, reference]", "rm [critic, reward]", "prep [data"):
        assert expected in text, (expected, text)

    for stage, timing in first_run["stages"].items():
        assert timing["job_seconds"] > 0 and timing["overhead_seconds"] >= 0, stage
    # One rank per role on the flow's local (one-node CPU) Ray: each job's driver trains, no actors
    logs = {p.name.split("-")[3]: p.read_text() for p in first_run["job_logs"]}
    for stage in ("sft", "rm"):
        assert "it trains in the job's driver" in logs[stage] and "role 'train': rank 0" not in logs[stage], stage
    assert "every role runs in the job's driver" in logs["ppo"] and "RL roles on Ray" not in logs["ppo"]
    printed = first_run["printed"]
    for expected in ("champion: models:/rlhf-policy@champion -> " + first_run["outputs"]["ppo"], "MLflow UI:",
                     "Prefect UI:", "pairwise accuracy:", "best policy: ppo"):
        assert expected in printed, expected


def test_planted_secrets_reach_no_store(first_run, tmp_path):
    """Every store the run wrote (Prefect's database, MLflow's database and artifacts, the stage
    outputs, the Ray jobs' driver logs) and everything it printed is free of the credential values
    that were in the flow's environment."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    prefect_db = Path(PREFECT_API_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    home = Path(os.environ["RLHF_HOME"])
    job_logs = first_run["job_logs"]
    assert prefect_db.is_file() and (home / "mlflow.db").is_file()
    assert {p.name.split("-")[3] for p in job_logs} >= {"sft", "rm", "ppo"}, job_logs
    stores = [prefect_db, *home.rglob("*"), *job_logs]
    stores = [p for p in stores if p.is_file() and "torch_extensions" not in p.parts]
    leaks = [(value, str(path)) for path in stores for value in PLANTED.values()
             if value.encode() in path.read_bytes()]
    leaks += [(value, "printed") for value in PLANTED.values() if value in first_run["printed"]]
    assert not leaks, leaks
    # the search reads real records: the flow's parameters are in Prefect's database
    assert b"pipeline" in prefect_db.read_bytes()


def test_cached_rerun_trains_nothing(first_run):
    import subprocess
    import sys

    from flows.pipeline import rlhf
    from rlhf_core.infra.settings import tracking_uri

    # A run left RUNNING by a flow of this machine that was killed: the next pipeline closes it.
    experiment = mlflow_client().get_experiment_by_name("rlhf").experiment_id
    killed = subprocess.run(
        [sys.executable, "-c", "import os, signal, sys\nfrom mlflow import MlflowClient\n"
         "from rlhf_core.infra.reachability import create_run_once\n"
         f"run = create_run_once(MlflowClient({tracking_uri()!r}), 'killed', {{'rlhf.kind': 'pipeline'}})({experiment!r})\n"
         "print(run.info.run_id, flush=True); os.kill(os.getpid(), signal.SIGKILL)"],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2], timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    orphan = killed.stdout.split()[-1]
    assert mlflow_client().get_run(orphan).info.status == "RUNNING"

    again = rlhf(**params())
    assert mlflow_client().get_run(orphan).info.status == "KILLED"
    assert all(t["cached"] for t in again["stages"].values()), again["stages"]
    assert again["job_seconds"] == 0
    assert again["outputs"] == first_run["outputs"]
    runs = child_runs(again["pipeline_run_id"])
    assert runs["sft"].data.tags["rlhf.cached_from"] == child_runs(first_run["pipeline_run_id"])["sft"].info.run_id


def test_single_stage_rerun_reuses_upstream_and_leaves_it_untouched(first_run):
    from flows.pipeline import rlhf
    from rlhf_core.infra import storage

    before = {s: tree_digest(first_run["outputs"][s]) for s in ("prep", "sft")}
    rerun = rlhf(**params(settings={"stages": ["dpo"], "from_run": first_run["pipeline_run_id"],
                                    "force_stages": ["dpo"]}))
    assert not rerun["stages"]["dpo"]["cached"] and "dpo" not in first_run["outputs"]  # DPO: one stage away
    assert rerun["outputs"]["sft"] == first_run["outputs"]["sft"]
    manifest = storage.read_manifest(rerun["outputs"]["dpo"])
    assert manifest["inputs"]["pretrain"] == first_run["outputs"]["sft"]
    assert {s: tree_digest(first_run["outputs"][s]) for s in ("prep", "sft")} == before
    runs = child_runs(rerun["pipeline_run_id"])
    assert runs["sft"].data.tags["rlhf.reused_from_run"] == child_runs(first_run["pipeline_run_id"])["sft"].info.run_id


def test_dpo_and_a_forced_ppo_rerun_from_the_same_sft_and_rm_are_evaluated_side_by_side(first_run):
    """A rerun of PPO alone (forced) beside DPO, from the first run's SFT and reward model: the new PPO
    run starts at step 0 in a folder of its own, the upstream outputs are reused untouched, and
    the evaluation ranks DPO and PPO side by side, with a smaller student distilled from that PPO
    policy beside them (registered as `rlhf-student`, never the champion)."""
    from flows.pipeline import rlhf

    before = {s: tree_digest(first_run["outputs"][s]) for s in ("prep", "sft", "rm")}
    result = rlhf(**params(settings={"stages": ["dpo", "ppo", "distill", "eval"],
                                     "from_run": first_run["pipeline_run_id"], "force_stages": ["ppo"]}))
    assert set(result["stages"]) == {"prep", "sft", "rm", "dpo", "ppo", "distill", "eval"}
    assert not result["stages"]["ppo"]["cached"] and result["outputs"]["ppo"] != first_run["outputs"]["ppo"]
    assert {s: result["outputs"][s] for s in before} == {s: first_run["outputs"][s] for s in before}
    assert {s: tree_digest(first_run["outputs"][s]) for s in before} == before
    first, runs = child_runs(first_run["pipeline_run_id"]), child_runs(result["pipeline_run_id"])
    tags = runs["ppo"].data.tags
    assert tags["rlhf.upstream.reward.model_uri"] == first_run["outputs"]["rm"]
    assert runs["rm"].data.tags["rlhf.reused_from_run"] == first["rm"].info.run_id
    assert "rlhf.resumed_from_checkpoints" not in tags  # a new run's folder: it starts at step 0

    assert result["evaluation"]["policies"] == ["dpo", "ppo", "distill"]
    metrics = result["evaluation"]["metrics"]
    for name in ("dpo", "ppo", "distill"):
        for metric in ("sampled_accuracy", "greedy_accuracy", "win_rate", "kl"):
            assert f"eval/{name}/{metric}" in metrics, (name, metric)
    student = runs["distill"].data.tags
    assert student["rlhf.upstream.teacher.model_uri"] == result["outputs"]["ppo"]  # this run's policy teaches
    assert student["rlhf.upstream.model.model_uri"] == first_run["outputs"]["prep"]  # from prep's student base
    assert runs["eval"].data.tags["rlhf.upstream.policy-distill.model_uri"] == result["outputs"]["distill"]
    from transformers import AutoConfig

    sizes = {n: AutoConfig.from_pretrained(result["outputs"][n]).hidden_size for n in ("ppo", "distill")}
    assert sizes["distill"] < sizes["ppo"], sizes
    registered = result["registry"]["student"]
    assert registered["model"] == "rlhf-student" and registered["teacher_uri"] == result["outputs"]["ppo"]
    version = mlflow_client().get_model_version("rlhf-student", registered["version"])
    assert version.tags["rlhf.teacher_uri"] == result["outputs"]["ppo"]
    assert "Distilled student `distill` (" in result["report"] and "of its teacher `ppo`'s" in result["report"]
    for name in ("dpo", "ppo"):
        assert runs[name].data.tags["rlhf.upstream.model.model_uri"] == first_run["outputs"]["sft"]
        assert runs["eval"].data.tags[f"rlhf.upstream.policy-{name}.model_uri"] == result["outputs"][name]
    registry = result["registry"]
    assert set(registry["policies"]) == {"dpo", "ppo"}
    best = registry["policy"]["best"]
    assert registry["policy"]["metric"] == "sampled_accuracy"
    assert metrics[f"eval/{best}/sampled_accuracy"] == max(metrics[f"eval/{n}/sampled_accuracy"] for n in ("dpo", "ppo"))
    candidate = mlflow_client().get_model_version_by_alias("rlhf-policy", "candidate")
    assert candidate.version == registry["policies"][best]["version"]


def test_rejection_sampling_and_conditional_sft_train_from_the_first_run_and_are_evaluated_and_registered(first_run):
    """Two rounds of OpenRLHF's rejection sampling from the first run's SFT model and reward model:
    each round samples its own window of prompts from the policy the round before trained, keeps each
    prompt's best, trains on them; the last round's policy is evaluated and registered. Beside it,
    conditional SFT: the first run's reward model scores prep's SFT rows into the prompts, the base
    learns on them, and is evaluated asking for the 90th percentile's score."""
    import json

    from flows.pipeline import rlhf

    result = rlhf(**params(settings={"stages": ["rejection_sampling", "conditional_sft", "eval"],
                                     "from_run": first_run["pipeline_run_id"]},
                           rejection_sampling={"rounds": 2, "n_prompts": 16, "best_of_n": 2},
                           sft={"train_batch_size": 4, "micro_train_batch_size": 4}))
    names = ["rejection_sampling-generate-round1", "rejection_sampling-score-round1", "rejection_sampling-sft-round1",
             "rejection_sampling-generate-round2", "rejection_sampling-score-round2", "rejection_sampling"]
    assert set(names) <= set(result["stages"]) and not any(result["stages"][n]["cached"] for n in names)
    out = result["outputs"]

    def rows(name):
        return [json.loads(line) for line in Path(out[name], "train.jsonl").read_text().splitlines()]
    first, second = rows(names[0]), rows(names[3])
    assert len(first) == len(second) == 16 * 2
    # (generation sharded over several engines: tests/unit/test_batch_inference.py and, the flow
    # passing num_engines on, tests/unit/test_flow_jobs.py)
    assert not {r["answer"] + r["input"] for r in first} & {r["answer"] + r["input"] for r in second}  # new prompts
    kept = rows(names[1])
    assert 0 < len(kept) <= 16 and len({r["input"] for r in kept}) == len(kept) and all("reward" in r for r in kept)

    runs = child_runs(result["pipeline_run_id"])
    upstream = {n: upstream_of(runs, n) for n in names}
    assert upstream[names[0]]["policy"] == first_run["outputs"]["sft"]
    assert upstream[names[1]] == {"data": out[names[0]], "reward": first_run["outputs"]["rm"]}
    assert upstream[names[2]]["model"] == first_run["outputs"]["sft"] and upstream[names[2]]["data"] == out[names[1]]
    assert upstream[names[3]]["policy"] == out[names[2]]  # round 2 samples the policy round 1 trained
    assert upstream[names[5]]["model"] == out[names[2]]

    scored = rows("conditional_sft-score")
    assert len(scored) == 256 and all(" <rm_score>: " in r["input"] for r in scored)
    p90 = result["stages"]["conditional_sft-score"]["metrics"]["batch_inference/written_reward_p90"]
    assert upstream_of(runs, "conditional_sft-score") == {"data": first_run["outputs"]["prep"],
                                                          "reward": first_run["outputs"]["rm"]}
    assert upstream_of(runs, "conditional_sft") == {"model": first_run["outputs"]["prep"],
                                                    "data": out["conditional_sft-score"]}
    from transformers import AutoTokenizer

    asked = AutoTokenizer.from_pretrained(out["conditional_sft"]).apply_chat_template(
        [{"role": "user", "content": "sort: CBA"}], tokenize=False, add_generation_prompt=True)
    assert asked.endswith(f"<|assistant|> <rm_score>: {p90:.2f} ")  # the model asks for a high score itself

    assert result["evaluation"]["policies"] == ["rejection_sampling", "conditional_sft"]
    for name in ("rejection_sampling", "conditional_sft"):
        assert f"eval/{name}/sampled_accuracy" in result["evaluation"]["metrics"]
        registered = result["registry"]["policies"][name]
        assert registered["model"] == "rlhf-policy" and registered["uri"] == out[name]
    report = json.loads(Path(out["eval"], "eval.json").read_text())
    assert report["policies"][1]["asked_as"].endswith(f" <rm_score>: {p90:.2f} ")


def upstream_of(runs: dict, name: str) -> dict[str, str]:
    """A stage run's upstream outputs by role, from its lineage tags."""
    return {k.split(".")[2]: v for k, v in runs[name].data.tags.items()
            if k.startswith("rlhf.upstream.") and k.endswith(".model_uri")}


def test_a_stage_without_its_upstream_is_a_configuration_error(harness, tmp_path, capsys):
    """PPO alone, with no SFT model in the run or in a from_run: exit 2 with the stage named, no traceback."""
    import yaml

    from rlhf_core.cli import main

    config = tmp_path / "ppo_only.yaml"
    config.write_text(yaml.safe_dump({**TINY, "settings": {**TINY["settings"], "stages": ["ppo"]}}))
    assert main(["pipeline", "run", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "stage 'sft' is needed but not run here (ppo) and no from_run names an earlier run" in err, err[-2000:]
    assert "Traceback" not in err


def test_bad_data_fails_once_with_the_file_row_and_key(first_run, tmp_path):
    from flows.pipeline import rlhf
    from orchestration.ray_jobs import StageConfigError

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "c"}\n')
    with pytest.raises(StageConfigError) as err:
        rlhf(**params(settings={"stages": ["sft"], "from_run": first_run["pipeline_run_id"], "retries": 2,
                                "retry_delay_seconds": 0, "force_stages": ["sft"]},
                      sft={"dataset": str(bad)}))
    assert str(bad) in str(err.value) and "row 2" in str(err.value) and "response" in str(err.value)
    failed = [r for r in mlflow_client().search_runs(
        [mlflow_client().get_experiment_by_name("rlhf").experiment_id],
        "tags.`rlhf.stage` = 'sft' and attributes.status = 'FAILED'") if str(bad) in r.data.tags.get("rlhf.error", "")]
    assert len(failed) == 1, "configuration errors are not retried"


def _kill_first_running_job(stop: threading.Event, addresses: list, killed: list, errors: list,
                            prefix: str = "rlhf-sft", ready=lambda log: "[step" in log) -> None:
    """SIGKILL the driver of the flow's first job named `prefix...` once `ready(its log)`, on the
    cluster the flow started (its Jobs API address arrives in `addresses`). Errors end the watch
    and are kept."""
    from ray.job_submission import JobSubmissionClient

    try:
        while not stop.is_set():
            if addresses:
                client = JobSubmissionClient(addresses[0])
                for job in client.list_jobs():  # also lists drivers without a submission id (ray.init)
                    if not (job.submission_id or "").startswith(prefix) or job.status.value != "RUNNING":
                        continue
                    if ready(client.get_job_logs(job.submission_id)) and job.driver_info:
                        os.kill(int(job.driver_info.pid), signal.SIGKILL)
                        killed.append(job.submission_id)
                        return
            time.sleep(0.5)
    except Exception as e:  # noqa: BLE001 - reported by the test
        errors.append(repr(e))


def _run_killing_one_job(monkeypatch, prefix: str, ready, **sections) -> tuple[dict, list, list]:
    """Run the flow with `sections` while a watcher SIGKILLs the first job named `prefix...` once
    `ready(its log)`; returns the flow's result, the killed submission ids and the watcher's errors."""
    import contextlib

    import flows.pipeline
    from flows.pipeline import rlhf

    stop, addresses, killed, errors = threading.Event(), [], [], []
    real_cluster = flows.pipeline.ray_cluster

    @contextlib.contextmanager
    def recorded_cluster():
        with real_cluster() as address:
            addresses.append(address)
            yield address

    monkeypatch.setattr(flows.pipeline, "ray_cluster", recorded_cluster)
    watcher = threading.Thread(target=_kill_first_running_job, args=(stop, addresses, killed, errors, prefix, ready),
                               daemon=True)
    watcher.start()
    try:
        result = rlhf(**params(**sections))
    finally:
        stop.set()
    return result, killed, errors


def test_killed_job_fails_the_attempt_with_its_log_tail_and_is_retried_from_its_checkpoint(first_run, monkeypatch):
    import re

    from rlhf_core.infra import storage

    def past_two_checkpoints(log: str) -> bool:
        return any(int(step) >= 60 for step in re.findall(r"\[step (\d+)\]", log))

    result, killed, errors = _run_killing_one_job(
        monkeypatch, "rlhf-sft", past_two_checkpoints,
        settings={"stages": ["sft"], "from_run": first_run["pipeline_run_id"], "retries": 1, "retry_delay_seconds": 0,
                  "force_stages": ["sft"], "supervised_checkpoint_steps": 25},
        sft={"max_steps": 300, "max_epochs": 40, "eval_steps": 25})
    assert not errors and killed, f"the watcher never saw the SFT job running: {errors}"
    assert not result["stages"]["sft"]["cached"]
    c = mlflow_client()
    runs = c.search_runs([c.get_experiment_by_name("rlhf").experiment_id],
                         f"tags.`mlflow.parentRunId` = '{result['pipeline_run_id']}' and tags.`rlhf.stage` = 'sft'")
    statuses = sorted(r.info.status for r in runs)
    assert statuses == ["FAILED", "FINISHED"]
    error = next(r for r in runs if r.info.status == "FAILED").data.tags["rlhf.error"]
    assert killed[0] in error and "last log lines" in error and "[step" in error
    # The retry resumed from the killed attempt's newest checkpoint and trained only what was left.
    retry = next(r for r in runs if r.info.status == "FINISHED")
    assert retry.data.tags["rlhf.resumed_from_checkpoints"] == retry.data.tags["rlhf.checkpoint_uri"]
    metrics = storage.read_manifest(result["outputs"]["sft"])["metrics"]
    assert metrics["train/start_step"] >= 50 and metrics["train/steps_run"] == 300 - metrics["train/start_step"]


def test_a_killed_ppo_attempt_is_retried_from_its_checkpoint(first_run, monkeypatch):
    """Retries resume: the RL stage checkpoints every step in the run's output area; the attempt
    killed after its first checkpoint is retried, and the retry resumes there, not at step 0. GRPO
    with the task's verifier: the resume is the RL stage's whatever its roles, and without a critic
    and a reward model each attempt starts two Ray actors fewer."""
    from rlhf_core.infra import storage

    result, killed, errors = _run_killing_one_job(
        monkeypatch, "rlhf-ppo", lambda log: "[rl step 2" in log,
        settings={"stages": ["ppo"], "from_run": first_run["pipeline_run_id"], "retries": 1, "retry_delay_seconds": 0,
                  "force_stages": ["ppo"], "checkpoint_steps": 1},
        ppo={"train.max_steps": 4, "algo.advantage.estimator": "group_norm", "reward.task": "sort"})
    assert not errors and killed, f"the watcher never saw the PPO job at step 2: {errors}"
    c = mlflow_client()
    runs = c.search_runs([c.get_experiment_by_name("rlhf").experiment_id],
                         f"tags.`mlflow.parentRunId` = '{result['pipeline_run_id']}' and tags.`rlhf.stage` = 'ppo'")
    assert sorted(r.info.status for r in runs) == ["FAILED", "FINISHED"]
    retry = next(r for r in runs if r.info.status == "FINISHED")
    folder = retry.data.tags["rlhf.checkpoint_uri"]
    assert retry.data.tags["rlhf.resumed_from_checkpoints"] == folder
    assert (Path(folder) / "latest").read_text().strip() == "global_step4"
    metrics = storage.read_manifest(result["outputs"]["ppo"])["metrics"]
    assert metrics["train/start_step"] >= 1 and metrics["train/steps_run"] == 4 - metrics["train/start_step"]


def test_prep_data_and_models_on_s3_and_a_process_reward_model_picks_rejection_samples(first_run, s3_endpoint):
    """Every output on S3, for the task of steps (`addition_steps`): prep writes step-labelled rows,
    the process reward model trains from SFT on them (stage `prm`), rejection sampling keeps the
    samples it scores best (`reward: prm`), and PPO takes a reward per step from it
    (`reward.process_enable`); with no reward model in the run, the evaluation reports the
    verifier's metrics."""
    import json

    import fsspec

    from flows.pipeline import rlhf
    from rlhf_core.infra import storage

    fsspec.config.conf.clear()
    result = rlhf(**params(settings={"stages": ["prep", "sft", "prm", "ppo", "rejection_sampling", "eval"],
                                     "output_root": "s3://models/pipelines", "force_stages": ["prep", "sft"],
                                     "register_models": False},
                           prep={"task": "addition_steps", "n_train": 128, "n_test": 16}, prm=STEPS,
                           ppo={**PPO_STEPS, "reward.process_enable": True, "algo.advantage.estimator": "group_norm",
                                "algo.kl.init_coef": 0, "train.max_steps": 1},
                           rejection_sampling={"rounds": 1, "n_prompts": 16, "best_of_n": 2, "reward": "prm"}))
    out = result["outputs"]
    prep, sft = out["prep"], out["sft"]
    assert prep.startswith("s3://models/pipelines/") and storage.read_manifest(prep)["stage"] == "prep"
    manifest = storage.read_manifest(sft)
    assert manifest["inputs"]["pretrain"] == prep + "/base"
    assert [d["spec"] for d in manifest["inputs"]["datasets"]][0] == f"json@{prep}/data/sft"
    fs = fsspec.filesystem("s3")
    assert fs.exists(sft + "/model.safetensors") and fs.exists(sft.rsplit("/", 1)[0] + "/configs/sft.yaml")
    assert manifest["metrics"]["eval/loss"] < manifest["metrics"]["eval_initial/loss"]

    prm = storage.read_manifest(out["prm"])
    assert prm["inputs"]["pretrain"] == sft and prm["inputs"]["datasets"][0]["spec"] == f"json@{prep}/data/prm"
    assert prm["config"]["data"]["placeholder_token"] == "ки" and "eval/acc" in prm["metrics"]
    with fs.open(out["rejection_sampling-score-round1"] + "/train.jsonl") as f:
        kept = [json.loads(line) for line in f.read().decode().splitlines()]
    assert len(kept) == 16 and all(r["input"].startswith("<|bos|>") and "step_rewards" in r for r in kept)
    runs = child_runs(result["pipeline_run_id"])
    assert runs["rejection_sampling-score-round1"].data.tags["rlhf.upstream.reward.model_uri"] == out["prm"]
    ppo = storage.read_manifest(out["ppo"])
    assert ppo["config"]["reward"]["model_name_or_path"] == out["prm"] and ppo["config"]["reward"]["process_enable"]
    assert runs["ppo"].data.tags["rlhf.upstream.reward.model_uri"] == out["prm"]
    metrics = result["evaluation"]["metrics"]
    assert "eval/rejection_sampling/sampled_accuracy" in metrics and "eval/rejection_sampling/reward" not in metrics
    assert "eval/ppo/sampled_accuracy" in metrics


def test_a_scheduled_round_from_the_champion_beats_it_or_stops_and_says_why(first_run):
    """What the `iterative-dpo` deployment runs on its schedule (deployments/prefect.yaml: from the
    registered champion, whichever run trained it, with that run's prompts and SFT model), at a
    reduced size: a round either beats the champion on held-out sampled accuracy and replaces it, or
    leaves it and ends the run, saying why with both figures (iterative.stop_early)."""
    from flows.pipeline import rlhf
    from orchestration.lineage import CHAMPION, POLICY_MODEL

    client = mlflow_client()
    before = client.get_model_version_by_alias(POLICY_MODEL, CHAMPION)
    result = rlhf(**params(settings={"stages": ["iterative_dpo"], "from_run": "champion"},
                           iterative={"start_from": "champion", "rounds": 2, "n_prompts": 16}))
    rounds, stopped = result["iterative"]["rounds"], result["iterative"]["stopped_early"]
    after = client.get_model_version_by_alias(POLICY_MODEL, CHAMPION)
    first = rounds[0]
    assert first["policy_in"] == before.tags["rlhf.output_uri"]
    if first.get("trained") is not False:
        assert first["metric"] == "sampled_accuracy"
        assert first["previous_champion_value"] == float(before.tags["rlhf.eval.sampled_accuracy"])
    if first["promoted"]:  # held-out sampled accuracy rose: the round's policy is the champion now
        assert first["value"] > first["previous_champion_value"]
        assert len(rounds) == 2 and rounds[1]["policy_in"] == first["policy_out"]
        assert after.version != before.version
        return
    # it did not: the champion stays and the run stops after round 1, saying why
    assert len(rounds) == 1 and after.version == before.version and "stopped after round 1 of 2" in stopped
    if first.get("trained") is False:  # a weak champion: the verifier scored every sample alike, no pair to learn
        assert first["pairs"]["pairs/num_pairs"] == 0 and stopped.startswith("round 1 made no preference pair")
        assert first["skipped"] in stopped and before.tags["rlhf.output_uri"] in stopped
    else:
        assert f"did not beat the champion ({first['previous_champion_value']:.4f})" in stopped
        assert f"sampled_accuracy {first['value']:.4f}" in stopped


def test_two_iterative_dpo_rounds_are_linked(first_run):
    from flows.pipeline import rlhf
    from orchestration.lineage import CHAMPION, REGISTERED_NAMES
    from rlhf_core.stages.provenance import build

    # With no champion, round 1 is promoted for certain, so round 2 must start from its policy
    # (with one, round 1 would rarely beat it and both rounds would start from SFT).
    mlflow_client().delete_registered_model_alias(REGISTERED_NAMES["dpo"], CHAMPION)
    result = rlhf(**params(settings={"stages": ["iterative_dpo"], "from_run": first_run["pipeline_run_id"]},
                           iterative={"rounds": 2, "n_prompts": 16, "n_samples_per_prompt": 4, "start_from": "sft",
                                      "reward": "reward_model",
                                      "seed": 1}))
    rounds = result["iterative"]["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert rounds[0]["policy_in"] == first_run["outputs"]["sft"]
    assert rounds[0]["promoted"] and rounds[1]["policy_in"] == rounds[0]["policy_out"]
    runs = child_runs(result["pipeline_run_id"])
    first_policy = runs["dpo-round1"].info.run_id
    assert runs["dpo-round2"].data.tags["rlhf.upstream.model.run_id"] == first_policy
    assert runs["pairs-round2"].data.tags["rlhf.upstream.policy.run_id"] == first_policy
    tree = build(runs["dpo-round2"].info.run_id)
    assert first_policy in {p.run_id for p in tree.parents}, "round 2 leads back to round 1's policy"
