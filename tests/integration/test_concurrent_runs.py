"""Two `rlhf pipeline run`s at once on one machine (a scheduled run while a manual one runs).

Both on the embedded default, as two processes started together: each starts its own local Ray
(every port free at start, the Jobs API agent's included, and a temp dir of its own, through which
Ray's job supervisor finds the cluster a job's driver joins), both use one state directory (one
SQLite MLflow store, one embedded Prefect database, one outputs folder) and one HOME (one Ray
token, created by whichever starts first). Both must complete, each with its own MLflow pipeline
run and stage runs, while the other runs. The smallest pipeline the integration tests use (prep
and two SFT steps); the prep seeds differ, so neither run can reuse the other's outputs.

Run this file under the machine's Ray lock as a whole (`flock /tmp/rlhf-ray.lock pytest ...`):
the two runs inside it are what is being tested.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import rlhf_core

pytestmark = pytest.mark.integration

ROOT = str(Path(rlhf_core.__file__).resolve().parents[1])


def config(seed: int) -> dict:
    return {"settings": {"retries": 0, "stages": ["prep", "sft"]},
            "prep": {"n_train": 128, "n_test": 16, "seed": seed},
            "sft": {"max_steps": 2, "train_batch_size": 16, "micro_train_batch_size": 16}}


def test_two_pipeline_runs_at_once_both_complete_with_their_own_runs(tmp_path):
    from mlflow import MlflowClient

    home, state = tmp_path / "home", tmp_path / "state"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": os.environ.get("LANG", "C.UTF-8"),
           "PYTHONPATH": ROOT, "TORCH_EXTENSIONS_DIR": os.environ["TORCH_EXTENSIONS_DIR"],
           "RLHF_HOME": str(state), "RLHF_NO_PROGRESS": "1", "TOKENIZERS_PARALLELISM": "false"}
    procs = []
    for seed in (0, 1):
        (tmp_path / f"run{seed}.yaml").write_text(yaml.safe_dump(config(seed)))
        log = open(tmp_path / f"run{seed}.log", "w")  # noqa: SIM115 - closed below
        procs.append((subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", "pipeline", "run", "--config",
                                        f"run{seed}.yaml"], cwd=tmp_path, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, text=True), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=540)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    outputs = [Path(log.name).read_text() for _, log in procs]
    for (proc, _), text in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, text[-5000:]

    # Each run submitted its jobs to a Ray of its own (dashboards 8265 and the next free port).
    dashboards = [set(re.findall(r"submitted Ray job rlhf-\S+ to (http://127\.0\.0\.1:\d+)", text)) for text in outputs]
    assert all(len(d) == 1 for d in dashboards) and dashboards[0] != dashboards[1], dashboards
    # ... and every job's driver joined the cluster its run submitted it to: Ray's job supervisor
    # resolves that address through its cluster's temp dir, else through any Ray on the machine.
    joined = [set(re.findall(r"Connecting to existing Ray cluster at address: (127\.0\.0\.1:\d+)", text))
              for text in outputs]
    assert all(len(j) == 1 for j in joined) and joined[0] != joined[1], joined

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
