"""The cloud and Kubernetes launch files (deployments/skypilot/, deployments/kuberay/) checked the way
their tools read them, without a cloud or a cluster:

- every SkyPilot task loads with SkyPilot's own task loader; its secrets are declared without values
  (all of them resolved by `--secret`, none inline), its GPUs are spot instances SkyPilot knows by
  name, the managed job's recovery settings are ones SkyPilot acts on;
- every task's `setup:` and `run:` scripts run in bash with the outside world stubbed (ray, pip,
  mlflow, ...) on a head and on a worker: the first thing `run:` does is the secrets check (exit 2
  naming each missing one, before Ray starts), workers only join Ray, and every `rlhf` command the
  head runs, after the shell has expanded it with the task's defaults, parses with the project's
  parser, flag by exact spelling, and builds the stage config or pipeline parameters `rlhf` would;
- the KubeRay manifests validate against KubeRay's CRD schemas (tests/data/kuberay/), a broken
  manifest fails that validation, credentials come only from Secrets, and the RayJob's entrypoint
  parses as an `rlhf` command;
- `python -m rlhf_core.infra.require_env` exits 2 naming what is missing, 0 otherwise, and never
  prints a value.

SkyPilot is not a dependency of the project: its tests skip where it is not installed.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SKYPILOT = ROOT / "deployments" / "skypilot"
KUBERAY = ROOT / "deployments" / "kuberay"
SCHEMAS = ROOT / "tests" / "data" / "kuberay"
SKY_TASKS = sorted(SKYPILOT.glob("*.yaml"))
HEAD_IP = "10.0.0.1"


# --- `rlhf` command lines: the project's parser, then the config `rlhf` would build -----------------

def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def check_rlhf_command(argv: list[str]):
    """`rlhf <argv>` as `rlhf_core.cli.main` reads it, short of running it: parsed by the project's
    parser (argparse would take an abbreviation of a flag, so every flag must be spelled out), then
    the stage config, the prep task or the pipeline's parameters built and validated. Returns
    `(args, what was built)`."""
    from rlhf_core.cli import _parser, train_config
    from rlhf_core.config import load_yaml

    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse printed why on stderr
        pytest.fail(f"`rlhf {shlex.join(argv)}` does not parse (exit {e.code})")
    command = _subparser(parser, args.command)
    if args.command == "train":
        command = _subparser(command, args.stage)
    flags = {option for action in command._actions for option in action.option_strings}
    for token in argv:
        if token.startswith("--"):
            assert token.split("=", 1)[0] in flags, f"`rlhf {shlex.join(argv)}`: {token} is not a flag of its command"

    if args.command == "train":
        return args, train_config(args)
    if args.command == "prep":  # the task must exist (the rest of prep's checks import torch: seconds)
        from rlhf_core.data.synthetic import get_task

        return args, get_task(args.task)
    if args.command == "pipeline":
        from flows.cli import flow_parameters

        return args, flow_parameters((load_yaml(args.config) if args.config else None) or {}, args)
    pytest.fail(f"no check for `rlhf {args.command}` yet: add one here")


def test_the_command_check_catches_a_typo_an_abbreviation_and_a_bad_value():
    check_rlhf_command(["train", "sft", "--pretrain", "s3://b/base", "--dataset", "json@s3://b/data", "--save_path",
                        "s3://b/sft", "--save_steps", "10", "--ckpt_path", "/ckpt"])
    for argv in (["train", "sft", "--pretrain", "m", "--dataset", "d", "--save_stepz", "10"],
                 ["train", "sft", "--pretrain", "m", "--dataset", "d", "--save_step", "10"],
                 ["train", "dpo", "--pretrain", "m", "--dataset", "d", "--zero_stage", "7"],
                 ["train", "sft", "--pretrain", "m", "--dataset", "d", "--ckpt_path", "ftp://h/c"],  # no ftp://
                 ["pipeline", "run", "--stages", "prep,sft,rlhf"],
                 ["prep", "--out", "s3://b/prep", "--task", "sorting"]):
        with pytest.raises((pytest.fail.Exception, AssertionError, ValueError)):
            check_rlhf_command(argv)


# --- require_env ----------------------------------------------------------------------------------

def test_require_env_exits_2_naming_every_missing_variable_and_how_to_pass_it(capsys):
    from rlhf_core.infra.require_env import main

    environ = {"AWS_ACCESS_KEY_ID": "AKIAPLANTED0VALUE123", "AWS_SECRET_ACCESS_KEY": "",
               "MLFLOW_TRACKING_URI": "https://mlflow.planted.example"}
    code = main(["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RAY_AUTH_TOKEN", "--env", "MLFLOW_TRACKING_URI",
                 "--env", "BUCKET"], environ)
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 3, err  # an empty value is missing too
    assert "secret AWS_SECRET_ACCESS_KEY is not set" in lines[0] and "--secret AWS_SECRET_ACCESS_KEY" in lines[0]
    assert "secret RAY_AUTH_TOKEN is not set" in lines[1] and "--secret RAY_AUTH_TOKEN" in lines[1]
    assert "BUCKET is not set" in lines[2] and "--env BUCKET=" in lines[2]
    for value in environ.values():
        if value:
            assert value not in err


def test_require_env_passes_silently_when_everything_is_set(capsys):
    from rlhf_core.infra.require_env import main

    environ = {"HF_TOKEN": "hf_plantedTokenValue42", "MLFLOW_TRACKING_URI": "http://10.0.0.1:5000"}
    assert main(["HF_TOKEN", "--env", "MLFLOW_TRACKING_URI"], environ) == 0
    assert capsys.readouterr() == ("", "")
    assert main([], {}) == 0


def test_require_env_runs_as_a_module():
    env = {"PATH": os.environ.get("PATH", ""), "PLANTED_SECRET": "planted-secret-value-7f3a"}
    ok = subprocess.run([sys.executable, "-m", "rlhf_core.infra.require_env", "PLANTED_SECRET"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and ok.stdout == ok.stderr == ""
    bad = subprocess.run([sys.executable, "-m", "rlhf_core.infra.require_env", "PLANTED_SECRET", "MISSING_ONE"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "MISSING_ONE" in bad.stderr
    assert "planted-secret-value-7f3a" not in bad.stdout + bad.stderr


# --- SkyPilot tasks -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sky():
    """SkyPilot is part of the test environment (README); absent, these skip. Present but broken
    (a dependency of its own missing), they fail: importorskip would skip them silently."""
    import importlib.util

    if importlib.util.find_spec("sky") is None:
        pytest.skip("SkyPilot is not installed (the README's test command installs it)")
    import sky

    return sky


def _raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _task(sky, path: Path, envs: dict[str, str] | None = None, secrets: dict[str, str] | None = None):
    """The task as `sky launch path --env K=V --secret K=V` builds it."""
    return sky.Task.from_yaml_config(_raw(path), env_overrides=list((envs or {}).items()) or None,
                                     secrets_overrides=list((secrets or {}).items()) or None)


def planted(names) -> dict[str, str]:
    return {name: f"planted-{name.lower()}-0123456789" for name in names}


def test_the_skypilot_tasks_are_there():
    assert {p.name for p in SKY_TASKS} == {"cluster.yaml", "managed-job.yaml", "stage.yaml"}


@pytest.mark.parametrize("path", SKY_TASKS, ids=lambda p: p.name)
def test_the_task_loads_and_declares_its_secrets_without_values(sky, path, monkeypatch):
    raw = _raw(path)
    declared = raw["secrets"]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RAY_AUTH_TOKEN"} <= set(declared)
    assert all(value is None for value in declared.values()), f"{path.name}: a secret has an inline value"

    task = sky.Task.from_yaml(str(path))
    assert task.secrets == {}  # nothing inline: every secret is a reference resolved at launch
    assert {ref.name for ref in task.managed_secret_refs} == set(declared)
    # `--secret NAME` resolves each of them; then none is left to a secrets provider
    launched = _task(sky, path, secrets=planted(declared))
    assert set(launched.secrets) == set(declared) and not launched.managed_secret_refs
    # the settings a launch overrides are plain envs with defaults, none of them a credential
    from rlhf_core.infra.redaction import is_secret_key

    assert not [k for k in task.envs if is_secret_key(k)]
    assert "BUCKET" in task.envs and task.envs["BUCKET"]

    task.validate_name()
    task.validate_run()
    monkeypatch.chdir(ROOT)  # `sky launch` resolves `workdir: .` from where it runs: the repository's root
    task.expand_and_validate_workdir()
    assert Path(task.workdir) == ROOT


@pytest.mark.parametrize("path", SKY_TASKS, ids=lambda p: p.name)
def test_the_task_asks_for_spot_gpus_skypilot_knows(sky, path):
    from sky.utils.gpu_names import CANONICAL_GPU_NAMES

    task = sky.Task.from_yaml(str(path))
    assert task.resources
    for r in task.resources:
        assert r.use_spot, f"{path.name}: {r} is not a spot instance"
        (name, count), = r.accelerators.items()
        assert name in CANONICAL_GPU_NAMES and count == 8, r.accelerators
    if path.name == "cluster.yaml":
        assert task.num_nodes >= 2  # head and workers
    else:
        assert task.num_nodes == 1  # one node by default (the S3 checkpoints do not depend on it)


def test_the_managed_job_recovers_with_settings_skypilot_acts_on(sky):
    from sky.utils import registry

    task = sky.Task.from_yaml(str(SKYPILOT / "managed-job.yaml"))
    for r in task.resources:
        recovery = r.job_recovery
        # SkyPilot's client lets unknown keys and strategies through (plugins may add them): check here
        assert set(recovery) <= {"strategy", "max_restarts_on_errors", "recover_on_exit_codes"}, recovery
        assert recovery["strategy"].lower() in registry.JOBS_RECOVERY_STRATEGY_REGISTRY.keys()
        assert 0 <= recovery["max_restarts_on_errors"] <= 3
    for name in ("cluster.yaml", "stage.yaml"):
        assert all(r.job_recovery is None for r in sky.Task.from_yaml(str(SKYPILOT / name)).resources)


def test_checkpoints_go_to_s3_in_the_bucket_the_launch_names(sky, tmp_path):
    """Checkpoints are s3:// folders of the bucket given at launch (`--env BUCKET=`), written with the
    AWS secrets like the outputs: no bucket mount."""
    (tmp_path / "job").mkdir()
    (tmp_path / "stage").mkdir()
    calls = head_run(sky, SKYPILOT / "managed-job.yaml", tmp_path / "job",
                     {"MLFLOW_TRACKING_URI": "https://mlflow.example", "BUCKET": "other-bucket"})
    assert pipeline_run(calls)[1]["sft"].ckpt_path.startswith("s3://other-bucket/rlhf/checkpoints/")
    *_, train = head_run(sky, SKYPILOT / "stage.yaml", tmp_path / "stage", {"BUCKET": "other-bucket", "STAGE": "rm"})
    assert check_rlhf_command(train)[1].ckpt_path == "s3://other-bucket/rlhf/checkpoints/rm"
    for name in ("managed-job.yaml", "stage.yaml"):
        assert "file_mounts" not in _raw(SKYPILOT / name)


STUBS = ("ray", "mlflow", "curl", "sleep", "nohup", "uv", "pip", "pgrep", "rlhf")
PRELUDE = r"""
__rec() { local IFS=$'\037'; printf '%s\036' "$*" >> "$RLHF_TEST_CALLS"; }
for __c in STUBS; do eval "$__c() { __rec $__c \"\$@\"; }"; done
python() {
  __rec python "$@"
  if [ "${1:-}" = -m ] && [ "${2:-}" = rlhf_core.infra.require_env ]; then "$RLHF_TEST_PYTHON" "$@"; fi
}
""".replace("STUBS", " ".join(STUBS))


def run_script(script: str, env: dict[str, str], home: Path) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """`script` in bash from the repository root (SkyPilot runs it in the synced workdir), with every
    command that would reach outside (STUBS, `python` but for the secrets check) recording its
    arguments instead; returns the process and the recorded calls, in order."""
    calls = home / "calls"
    calls.write_text("")
    (home / "rlhf-venv" / "bin").mkdir(parents=True, exist_ok=True)
    (home / "rlhf-venv" / "bin" / "activate").write_text("")
    full = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "RLHF_TEST_CALLS": str(calls),
            "RLHF_TEST_PYTHON": sys.executable, **env}
    done = subprocess.run(["bash", "-c", PRELUDE + script], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=60)
    return done, read_calls(home)


def read_calls(home: Path) -> list[list[str]]:
    return [r.split("\x1f") for r in (home / "calls").read_text().split("\x1e") if r]


def node_env(sky, path: Path, rank: int, envs: dict[str, str] | None = None) -> dict[str, str]:
    """What a node's shell has: the task's envs (defaults plus `--env`), its secrets, SkyPilot's vars."""
    task = _task(sky, path, envs=envs, secrets=planted(_raw(path)["secrets"]))
    (_, gpus), = next(iter(task.resources)).accelerators.items()
    ips = [f"10.0.0.{i + 1}" for i in range(task.num_nodes)]
    return {**task.envs, **{k: v.get_secret_value() for k, v in task.secrets.items()},
            "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NODE_IPS": "\n".join(ips),
            "SKYPILOT_NUM_NODES": str(task.num_nodes), "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
            "SKYPILOT_TASK_ID": "sky-managed-2026-11-26-12-00-00-000001_rlhf_1-0"}


def rlhf_calls(records: list[list[str]]) -> list[list[str]]:
    return [r[1:] for r in records if r[0] == "rlhf"]


@pytest.mark.parametrize("path", SKY_TASKS, ids=lambda p: p.name)
def test_setup_installs_the_gpu_profile(sky, path, tmp_path):
    task = sky.Task.from_yaml(str(path))
    done, records = run_script(task.setup, node_env(sky, path, 0), tmp_path)
    assert done.returncode == 0, done.stderr
    assert ["pip", "install", "-q", "-e", ".[gpu]"] in records


@pytest.mark.parametrize("path", SKY_TASKS, ids=lambda p: p.name)
def test_run_checks_the_secrets_before_anything_starts(sky, path, tmp_path):
    task = sky.Task.from_yaml(str(path))
    env = node_env(sky, path, 0)
    declared = list(_raw(path)["secrets"])
    for name in declared:
        del env[name]
    done, records = run_script(task.run, env, tmp_path)
    assert done.returncode == 2
    for name in declared:
        assert f"secret {name} is not set" in done.stderr and f"--secret {name}" in done.stderr
    assert [r[0] for r in records] == ["python"]  # the check, and nothing after it


def test_the_managed_job_needs_an_mlflow_server_off_the_cluster(sky, tmp_path):
    path = SKYPILOT / "managed-job.yaml"
    done, records = run_script(sky.Task.from_yaml(str(path)).run, node_env(sky, path, 0), tmp_path)
    assert done.returncode == 2 and "MLFLOW_TRACKING_URI is not set" in done.stderr
    assert not rlhf_calls(records)


@pytest.mark.parametrize("path", SKY_TASKS, ids=lambda p: p.name)
def test_a_worker_only_joins_the_heads_ray(sky, path, tmp_path):
    task = sky.Task.from_yaml(str(path))
    done, records = run_script(task.run, node_env(sky, path, 1, {"MLFLOW_TRACKING_URI": "https://mlflow.example"}),
                               tmp_path)
    assert done.returncode == 0, done.stderr
    assert records[0][:3] == ["python", "-m", "rlhf_core.infra.require_env"]
    starts = [r for r in records if r[:2] == ["ray", "start"]]
    assert len(starts) == 1 and f"--address={HEAD_IP}:6379" in starts[0] and "--head" not in starts[0]
    assert "--dashboard-agent-listen-port=52366" in starts[0]  # SkyPilot's own Ray agent holds 52365
    assert not rlhf_calls(records)


def head_run(sky, path: Path, tmp_path: Path, envs: dict[str, str] | None = None) -> list[list[str]]:
    """The `rlhf` commands the head runs, each checked by `check_rlhf_command`."""
    task = sky.Task.from_yaml(str(path))
    done, records = run_script(task.run, node_env(sky, path, 0, envs), tmp_path)
    assert done.returncode == 0, done.stderr
    for value in planted(_raw(path)["secrets"]).values():  # the script never shows a secret
        assert value not in done.stdout + done.stderr
    assert records[0][:3] == ["python", "-m", "rlhf_core.infra.require_env"]
    starts = [r for r in records if r[:2] == ["ray", "start"]]
    assert len(starts) == 1 and "--head" in starts[0] and "--dashboard-port=8265" in starts[0]
    assert records.index(starts[0]) > 0  # Ray starts after the check
    calls = rlhf_calls(records)
    assert calls
    for argv in calls:
        check_rlhf_command(argv)
    return calls


def pipeline_run(calls: list[list[str]]):
    (argv,) = [c for c in calls if c[:2] == ["pipeline", "run"]]
    return argv, check_rlhf_command(argv)[1]


def test_the_cluster_head_runs_the_pipeline_on_its_ray_with_outputs_on_the_bucket(sky, tmp_path, monkeypatch):
    calls = head_run(sky, SKYPILOT / "cluster.yaml", tmp_path, {"BUCKET": "team-bucket"})
    argv, params = pipeline_run(calls)
    assert params["settings"].output_root == "s3://team-bucket/rlhf/outputs"
    assert [s.value for s in params["settings"].stages] == ["prep", "sft", "rm", "ppo", "eval"]
    assert params["settings"].rollout_gpus == 1


def test_the_cluster_head_runs_its_own_mlflow_server_only_when_none_is_named(sky, tmp_path):
    path = SKYPILOT / "cluster.yaml"
    task = sky.Task.from_yaml(str(path))
    (tmp_path / "own").mkdir()
    done, records = run_script(task.run, node_env(sky, path, 0), tmp_path / "own")
    assert done.returncode == 0, done.stderr
    assert ["curl", "-sf", f"http://{HEAD_IP}:5000/health"] in records  # waited for before the pipeline starts
    (argv,) = rlhf_calls(records)
    assert records.index(["curl", "-sf", f"http://{HEAD_IP}:5000/health"]) < records.index(["rlhf", *argv])
    # the database is copied to the bucket however the run ends (the EXIT trap); the server is started
    # in the background, so its (stubbed) record may land anywhere in the order, even after the exit
    in_order = [r for r in records if r[0] != "nohup"]
    assert in_order[-1][:4] == ["python", "-", str(tmp_path / "own" / "rlhf-mlflow" / "mlflow.db"),
                                "s3://my-rlhf-bucket/rlhf/mlflow/mlflow.db"]
    deadline = time.monotonic() + 10
    while not (server := [r for r in read_calls(tmp_path / "own") if r[0] == "nohup"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert server and server[0][1:4] == ["mlflow", "server", "--host"]
    (tmp_path / "named").mkdir()
    done, records = run_script(task.run, node_env(sky, path, 0, {"MLFLOW_TRACKING_URI": "https://mlflow.example"}),
                               tmp_path / "named")
    assert done.returncode == 0, done.stderr
    assert not [r for r in records if r[0] in ("curl", "nohup", "mlflow") or r[:2] == ["python", "-"]]


def test_the_managed_job_resumes_stages_from_checkpoints_on_the_bucket(sky, tmp_path):
    calls = head_run(sky, SKYPILOT / "managed-job.yaml", tmp_path, {"MLFLOW_TRACKING_URI": "https://mlflow.example"})
    _, params = pipeline_run(calls)
    assert params["settings"].output_root == "s3://my-rlhf-bucket/rlhf/outputs"
    # one folder per stage, on S3, the same across the job's recoveries (its task id)
    ckpt = "s3://my-rlhf-bucket/rlhf/checkpoints/sky-managed-2026-11-26-12-00-00-000001_rlhf_1-0"
    for stage in ("sft", "rm", "dpo"):
        cfg = params[stage]
        assert (cfg.ckpt_path, cfg.ckpt.save_steps, cfg.ckpt.load_enable) == (f"{ckpt}/{stage}", 200, True)
    ppo = params["ppo"]
    assert (ppo.ckpt.path, ppo.ckpt.save_steps, ppo.ckpt.load_enable) == (f"{ckpt}/ppo", 20, True)


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "kto"])
def test_the_stage_task_trains_one_stage_from_the_built_in_task(sky, tmp_path, stage):
    calls = head_run(sky, SKYPILOT / "stage.yaml", tmp_path, {"STAGE": stage})
    *before, train = calls
    assert train[:2] == ["train", stage]
    _, cfg = check_rlhf_command(train)
    out = "s3://my-rlhf-bucket/rlhf"
    assert cfg.pretrain == (f"{out}/prep/base" if stage == "sft" else f"{out}/sft")
    assert cfg.data.dataset == (f"json@{out}/prep/data/sft" if stage == "sft" else f"json@{out}/prep/data/preference")
    assert (cfg.save_path, cfg.ckpt_path) == (f"{out}/{stage}", f"{out}/checkpoints/{stage}")
    assert cfg.ckpt.load_enable and cfg.ckpt.save_steps == 200
    assert (cfg.train.num_nodes, cfg.train.num_gpus_per_node) == (1, 8)
    assert before == ([["prep", "--out", f"{out}/prep", "--task", "sort", "--demo_error_rate", "0.3"]]
                      if stage == "sft" else [])


def test_the_stage_task_takes_your_model_data_and_flags(sky, tmp_path):
    calls = head_run(sky, SKYPILOT / "stage.yaml", tmp_path, {
        "STAGE": "dpo", "PRETRAIN": "s3://b/models/sft", "DATASET": "org/preference-pairs", "MAX_LEN": "2048",
        "EXTRA_ARGS": "--chosen_key better --rejected_key worse --beta 0.05"})
    (train,) = calls  # no prep: the data is yours
    _, cfg = check_rlhf_command(train)
    assert (cfg.pretrain, cfg.data.dataset, cfg.data.max_len) == ("s3://b/models/sft", "org/preference-pairs", 2048)
    assert (cfg.data.chosen_key, cfg.data.rejected_key, cfg.model.beta) == ("better", "worse", 0.05)


# --- KubeRay manifests ----------------------------------------------------------------------------

def kube_schema(kind: str) -> dict:
    """KubeRay's CRD schema for `kind` as JSON Schema: OpenAPI's `x-kubernetes-*` extensions dropped,
    int-or-string as integer or string, `nullable` as a null type, and objects that list their
    properties closed to others (what `kubectl apply`'s strict field validation refuses)."""
    raw = json.loads(gzip.decompress((SCHEMAS / f"{kind}.v1.schema.json.gz").read_bytes()))
    return _json_schema(raw)


def _json_schema(node: dict) -> dict:
    out = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-") or key == "nullable":
            continue
        if key == "properties":
            value = {name: _json_schema(s) for name, s in value.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(value, dict):
            value = _json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            value = [_json_schema(s) for s in value]
        out[key] = value
    if node.get("x-kubernetes-int-or-string") or node.get("format") == "int-or-string":
        for key in ("type", "anyOf", "format"):
            out.pop(key, None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validators():
    import jsonschema

    return {kind: jsonschema.Draft7Validator(kube_schema(kind)) for kind in ("RayCluster", "RayJob")}


def schema_errors(validators, doc: dict) -> list[str]:
    assert doc["apiVersion"] == "ray.io/v1", doc["apiVersion"]
    errors = validators[doc["kind"]].iter_errors(doc)
    return sorted(f"{'.'.join(str(p) for p in e.absolute_path)}: {e.message}" for e in errors)


def manifests() -> dict[str, list[dict]]:
    return {p.name: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in sorted(KUBERAY.glob("*.yaml"))}


def ray_documents() -> list[tuple[str, dict]]:
    return [(name, d) for name, docs in manifests().items() for d in docs if d["apiVersion"].startswith("ray.io/")]


def test_the_manifests_are_there():
    kinds = {(name, d["kind"]) for name, docs in manifests().items() for d in docs}
    assert {("raycluster.yaml", "RayCluster"), ("rayjob.yaml", "RayJob"), ("config.yaml", "ConfigMap")} <= kinds
    assert not [k for k in kinds if k[1] == "Secret"]  # Secrets are made with kubectl, never kept here


@pytest.mark.parametrize("name,doc", ray_documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_the_manifest_validates_against_kuberays_crd(validators, name, doc):
    assert schema_errors(validators, doc) == []


def cluster_spec(doc: dict) -> dict:
    return doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]


def broken(mutate):
    def make():
        doc = copy.deepcopy(manifests()["raycluster.yaml"][0])
        mutate(doc["spec"])
        return doc
    return make


@pytest.mark.parametrize("make,where", [
    (broken(lambda s: s["workerGroupSpecs"][0].pop("groupName")), "spec.workerGroupSpecs.0: 'groupName'"),
    (broken(lambda s: s["headGroupSpec"]["rayStartParams"].update({"num-gpus": 0})),
     "spec.headGroupSpec.rayStartParams.num-gpus: 0 is not of type 'string'"),
    (broken(lambda s: s["workerGroupSpecs"][0].update({"replica": 2})), "spec.workerGroupSpecs.0: Additional"),
    (broken(lambda s: s["authOptions"].update({"mode": "tokens"})), "spec.authOptions.mode: 'tokens' is not one of"),
    (broken(lambda s: s["workerGroupSpecs"][0].update({"minReplicas": "0"})),
     "spec.workerGroupSpecs.0.minReplicas: '0' is not of type 'integer'"),
], ids=["no groupName", "rayStartParams value not a string", "misspelled field", "unknown auth mode",
        "replicas as a string"])
def test_a_broken_manifest_fails_validation(validators, make, where):
    errors = schema_errors(validators, make())
    assert any(e.startswith(where) for e in errors), errors


def test_int_or_string_fields_take_both(validators):
    doc = copy.deepcopy(manifests()["raycluster.yaml"][0])
    resources = doc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
    resources["limits"]["cpu"] = 64  # a quantity: `64` and `"64"` alike
    assert schema_errors(validators, doc) == []
    resources["limits"]["cpu"] = [64]
    assert schema_errors(validators, doc)


def containers(doc: dict) -> list[dict]:
    spec = cluster_spec(doc)
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    return [c for g in groups for c in g["template"]["spec"]["containers"]]


@pytest.mark.parametrize("name,doc", ray_documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_credentials_come_from_secrets_and_token_auth_is_on(name, doc):
    from rlhf_core.infra.redaction import is_secret_key

    spec = cluster_spec(doc)
    assert spec["authOptions"] == {"mode": "token", "secretName": "rlhf-ray-token"}
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"containerPort": 8265, "name": "dashboard"} in head["ports"]  # rlhf-head-svc serves the Jobs API
    for container in containers(doc):
        env = {e["name"]: e for e in container.get("env", [])}
        secrets = [n for n in env if is_secret_key(n)]
        assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secrets)
        for n in secrets:
            assert "value" not in env[n] and "secretKeyRef" in env[n]["valueFrom"], f"{name}: {n} is inline"
        assert {"configMapRef": {"name": "rlhf-settings"}} in container["envFrom"]
    settings = manifests()["config.yaml"][0]["data"]
    assert not [k for k in settings if is_secret_key(k)] and settings["MLFLOW_TRACKING_URI"]


def test_the_rayjob_runs_the_pipeline_against_its_own_clusters_jobs_api(tmp_path):
    (config_map, job) = manifests()["rayjob.yaml"]
    entrypoint = job["spec"]["entrypoint"]
    # KubeRay pastes the entrypoint unquoted into the submitter's shell line: one plain command only
    assert not set(entrypoint) & set(";&|<>`$()\\\n"), entrypoint
    words = shlex.split(entrypoint)
    assert words[:3] == ["env", "RAY_ADDRESS=http://127.0.0.1:8265", "rlhf"]
    argv = words[3:]
    assert argv[:2] == ["pipeline", "run"]
    # its --config is the ConfigMap mounted on the head: the command is checked with that content
    config_path = Path(argv[argv.index("--config") + 1])
    head = cluster_spec(job)["headGroupSpec"]["template"]["spec"]
    mount = next(m for m in head["containers"][0]["volumeMounts"] if m["name"] == "pipeline")
    volume = next(v for v in head["volumes"] if v["name"] == "pipeline")
    assert config_path.parent == Path(mount["mountPath"])
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    local = tmp_path / config_path.name
    local.write_text(config_map["data"][config_path.name])
    _, params = check_rlhf_command([str(local) if a == str(config_path) else a for a in argv])
    assert params["settings"].output_root.startswith("s3://")
    assert params["settings"].rollout_gpus == 1
