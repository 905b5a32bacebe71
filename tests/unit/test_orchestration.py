"""Pure pieces of the orchestration layer: cache keys, job commands and environments, the job
runner's log relay / failure typing / cleanup (against an in-memory Jobs API), flow parameters."""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import pytest

from orchestration.cache import cache_key, dataset_digest
from orchestration.ray_jobs import RayJobRunner, StageConfigError, StageJobError, job_command, job_env
from rlhf_core.infra.settings import ConfigError


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

    code = ("import sys, flows.pipeline, flows.cli, orchestration.stages; from rlhf_core.infra.manifests import code_version; "
            "code_version(); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr


# ---------------------------------------------------------------------------------------------
# Settings hashes of the flow's own stages (prep, eval, pairs): every params field counts unless
# it is excluded by name, with a reason, next to the hash.

def perturbed(model, name: str):
    """`model` with field `name` set to another valid value, whatever the field's type and constraints."""
    import re

    from pydantic import ValidationError

    value, info = getattr(model, name), type(model).model_fields[name]
    if isinstance(value, bool):
        candidates = [not value]
    elif isinstance(value, (int, float)):
        candidates = [value + 1, value * 2, value - 1, value / 2]
    elif value is None:
        candidates = [7, 0.5, "x"]
    elif isinstance(value, str):  # another value a `pattern` allows, else any other string
        patterns = [m.pattern for m in info.metadata if getattr(m, "pattern", None)]
        candidates = [w for p in patterns for w in re.findall(r"\w+", p)] + list(info.examples or []) + \
            [value + "_changed"]
    else:
        raise AssertionError(f"perturbed() cannot change {type(model).__name__}.{name} ({value!r}): teach it")
    for candidate in candidates:
        if candidate == value:
            continue
        try:
            return type(model).model_validate({**model.model_dump(), name: candidate})
        except ValidationError:
            continue
    raise AssertionError(f"no other valid value found for {type(model).__name__}.{name}")


def hardware(native_bf16: bool) -> dict:
    """What `rlhf hardware` answers on a CPU cluster with or without native bf16."""
    from rlhf_core.infra.precision import Hardware, Precision, resolve

    hw = Hardware("cpu", native_bf16)
    return {"device": "cpu", "native_bf16": native_bf16, "precision": {p.value: resolve(p, hw)[0].value for p in Precision}}


def flow_ctx(tmp_path, native_bf16: bool = False):
    from orchestration.stages import PipelineContext

    return PipelineContext("exp", "parent-run", "flow-run", str(tmp_path / "run"), "http://ray",
                           hardware=hardware(native_bf16))


def test_train_key_holds_the_precision_the_cluster_resolves_not_auto(tmp_path):
    from flows.jobs import train_job as _train_job
    from flows.params import PipelineDPOConfig, PipelineSettings, PipelineSFTConfig

    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft")}

    def key(cfg, native_bf16):
        return _train_job(flow_ctx(tmp_path, native_bf16), PipelineSettings(), cfg, upstream.__getitem__).config_hash

    for cfg in (PipelineSFTConfig(), PipelineDPOConfig()):
        assert cfg.param_dtype.value == "auto"
        assert key(cfg, True) != key(cfg, False)  # bf16 on one cluster, fp32 on the other
        fp32 = type(cfg).model_validate({**cfg.model_dump(), "param_dtype": "fp32"})
        assert key(fp32, True) == key(fp32, False) == key(cfg, False)  # what runs is what counts
        bf16 = type(cfg).model_validate({**cfg.model_dump(), "bf16": True})
        assert key(bf16, True) == key(cfg, True) and key(bf16, False) == key(cfg, False)  # a request it falls back from

    ctx = flow_ctx(tmp_path)
    ctx.hardware = None  # fp32 is fp32 on every device: no need to ask the cluster
    _train_job(ctx, PipelineSettings(), PipelineSFTConfig(param_dtype="fp32"), upstream.__getitem__)
    assert ctx.hardware is None


def outcome(name: str, tmp_path, metrics=None):
    from orchestration.stages import StageOutcome

    stage = name.split("-")[0]
    return StageOutcome(stage, name, str(tmp_path / name), f"run-{name}", f"key-{name}", False, metrics or {}, {})


def test_perturbed_changes_exactly_one_field():
    from flows.params import EvalParams, IterativeDPOParams, PrepParams

    for model in (PrepParams(), EvalParams(), IterativeDPOParams(), IterativeDPOParams(seed=3)):
        for name in type(model).model_fields:
            other = perturbed(model, name)
            changed = {k for k in type(model).model_fields if getattr(other, k) != getattr(model, k)}
            assert changed == {name}


def test_prep_key_moves_with_every_prep_field(tmp_path):
    from flows.jobs import prep_job as _prep_job
    from flows.params import PrepParams

    ctx = flow_ctx(tmp_path)
    key = _prep_job(ctx, PrepParams()).config_hash
    assert _prep_job(ctx, PrepParams()).config_hash == key
    assert _prep_job(flow_ctx(tmp_path / "elsewhere"), PrepParams()).config_hash == key  # not the output place
    for name in PrepParams.model_fields:
        assert _prep_job(ctx, perturbed(PrepParams(), name)).config_hash != key, name

    class Later(PrepParams):  # a field added after this test was written counts without anyone listing it
        new_knob: int = 0

    assert _prep_job(ctx, Later()).config_hash != _prep_job(ctx, Later(new_knob=1)).config_hash


def test_eval_key_moves_with_every_eval_field_and_the_task(tmp_path):
    from flows.jobs import EVAL_NOT_IN_KEY, eval_job
    from flows.params import EvalParams, PrepParams

    assert EVAL_NOT_IN_KEY == {"promote_metric"}  # widening this needs a reason next to it

    def key(prep=PrepParams(), params=EvalParams(), ctx=None):  # noqa: B008
        prep_o, dpo, sft, rm = [outcome(n, tmp_path) for n in ("prep", "dpo", "sft", "rm")]
        return eval_job(ctx or flow_ctx(tmp_path), prep, params, prep_o, {"dpo": dpo}, sft, rm, name="eval").config_hash

    base = key()
    assert key() == base and key(ctx=flow_ctx(tmp_path / "elsewhere")) == base
    for name in EvalParams.model_fields:
        moved = key(params=perturbed(EvalParams(), name)) != base
        assert moved == (name not in EVAL_NOT_IN_KEY), name
    assert key(prep=perturbed(PrepParams(), "task")) != base

    class Later(EvalParams):  # a field added after this test was written counts without anyone listing it
        new_knob: int = 0

    assert key(params=Later()) != key(params=Later(new_knob=1))


def pairs_keys(tmp_path, monkeypatch, iterative, prep=None, parent="parent-run") -> list[str]:
    """The config hash of each round's pairs job, from `run_rounds` with every job faked."""
    from flows import iterative as iterative_flow
    from flows.params import EvalParams, PipelineDPOConfig, PipelineSettings, PrepParams
    from orchestration import lineage

    monkeypatch.setattr(lineage, "alias_version", lambda *a: None)  # no champion yet: start from SFT
    monkeypatch.setattr(lineage, "register_once", lambda *a: SimpleNamespace(name="rlhf-policy", version="1"))
    monkeypatch.setattr(lineage, "promote", lambda *a: (False, None))
    monkeypatch.setattr(iterative_flow, "publish_eval_report", lambda *a: {"markdown": ""})
    jobs = []

    def run(job):
        jobs.append(job)
        return outcome(job.name, tmp_path, {"eval/dpo/sampled_accuracy": 1.0})

    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft", "rm")}
    ctx = flow_ctx(tmp_path)
    ctx.parent_run_id = parent
    iterative_flow.run_rounds(ctx, PipelineSettings(), prep or PrepParams(), PipelineDPOConfig(), EvalParams(),
                              iterative, upstream.__getitem__, run, {})
    return [job.config_hash for job in jobs if job.stage == "pairs"]


def test_pairs_key_moves_with_every_iterative_field_the_round_uses(tmp_path, monkeypatch):
    from flows.iterative import PAIRS_NOT_IN_KEY
    from flows.params import IterativeDPOParams, PrepParams

    assert PAIRS_NOT_IN_KEY == {"rounds", "start_from", "seed"}  # widening this needs a reason next to it
    for base_params in (IterativeDPOParams(), IterativeDPOParams(seed=5)):
        (base,) = pairs_keys(tmp_path, monkeypatch, base_params)
        assert pairs_keys(tmp_path, monkeypatch, base_params.model_copy()) == [base]
        for name in IterativeDPOParams.model_fields:
            first_round = pairs_keys(tmp_path, monkeypatch, perturbed(base_params, name))[0]
            # `seed` is excluded as a field but enters as the round's sampling seed, which it changes
            assert (first_round != base) == (name not in {"rounds", "start_from"}), (name, base_params)
        assert pairs_keys(tmp_path, monkeypatch, base_params, prep=perturbed(PrepParams(), "task")) != [base]

    class Later(IterativeDPOParams):  # a field added after this test was written counts without anyone listing it
        new_knob: int = 0

    assert pairs_keys(tmp_path, monkeypatch, Later()) != pairs_keys(tmp_path, monkeypatch, Later(new_knob=1))
    two = pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(rounds=2, seed=5))
    assert two[0] == pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(seed=5))[0] and two[1] != two[0]
    # unpinned, the sampling seed is drawn per pipeline run; pinned, it is the same in every run
    assert pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(), parent="other-run") != \
        pairs_keys(tmp_path, monkeypatch, IterativeDPOParams())
    assert pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(seed=5), parent="other-run") == \
        pairs_keys(tmp_path, monkeypatch, IterativeDPOParams(seed=5))


# ---------------------------------------------------------------------------------------------
# Training stages: a model named in the config rather than made upstream is an input by URI.

def dpo_job(tmp_path, cfg=None, **values):
    """The pipeline's DPO job (cache key, lineage tags) for `cfg` or `PipelineDPOConfig(**values)`."""
    from flows.jobs import train_job as _train_job
    from flows.params import PipelineDPOConfig, PipelineSettings
    from orchestration.stages import _tags, stage_cache_key

    data = tmp_path / "prep" / "data" / "preference"
    data.mkdir(parents=True, exist_ok=True)
    (data / "train.jsonl").write_text('{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft")}
    ctx = flow_ctx(tmp_path)
    job = _train_job(ctx, PipelineSettings(), cfg or PipelineDPOConfig(**values), upstream.__getitem__)
    key = stage_cache_key(job)
    return key, _tags(ctx, job, key), job


def test_an_explicit_reference_model_enters_the_cache_key_and_the_tags(tmp_path):
    import yaml

    base_key, base_tags, base = dpo_job(tmp_path)
    assert "rlhf.input.reference" not in base_tags  # filled from the SFT model, already upstream
    assert yaml.safe_load(base.config_yaml)["ref_pretrain"] == str(tmp_path / "sft")
    key_a, tags_a, job_a = dpo_job(tmp_path, ref_pretrain="org/ref-a")
    key_b, _, _ = dpo_job(tmp_path, ref_pretrain="org/ref-b")
    assert len({base_key, key_a, key_b}) == 3
    assert tags_a["rlhf.input.reference"] == "org/ref-a" and job_a.config_hash == base.config_hash
    assert yaml.safe_load(job_a.config_yaml)["ref_pretrain"] == "org/ref-a"

    # With an explicit pretrain, a reference equal to it, given or derived, adds nothing.
    from flows.params import PipelineDPOConfig
    from rlhf_core.config import with_updates

    own_key, own_tags, _ = dpo_job(tmp_path, pretrain="org/base")
    assert "rlhf.input.reference" not in own_tags and own_tags["rlhf.input.model"] == "org/base"
    revalidated = PipelineDPOConfig.model_validate(PipelineDPOConfig(pretrain="org/base").model_dump())
    assert "ref_pretrain" in revalidated.model_fields_set  # derived, yet now indistinguishable by the field
    for same in (dict(cfg=revalidated), dict(cfg=with_updates(PipelineDPOConfig(pretrain="org/base"), beta=0.1)),
                 dict(pretrain="org/base", ref_pretrain="org/base")):
        assert dpo_job(tmp_path, **same)[0] == own_key, same
    other_key, other_tags, _ = dpo_job(tmp_path, pretrain="org/base", ref_pretrain="org/other")
    assert other_key != own_key and other_tags["rlhf.input.reference"] == "org/other"


def test_given_reference_tells_a_named_reference_from_a_derived_one():
    from flows.jobs import given_reference
    from rlhf_core.config import DPOConfig, KTOConfig, SFTConfig

    for cls in (DPOConfig, KTOConfig):
        assert given_reference(cls()) is None
        assert given_reference(cls(pretrain="a")) is None  # filled from pretrain by the validator
        assert given_reference(cls(ref_pretrain="r")) == "r"
        assert given_reference(cls(pretrain="a", ref_pretrain="r")) == "r"
    assert given_reference(SFTConfig(pretrain="a")) is None


# ---------------------------------------------------------------------------------------------
# The code version: a digest of the source itself, so uncommitted edits and installs without git
# get keys of their own.

def source_copy(tmp_path):
    """A copy of the source packages (with whatever __pycache__ they hold), outside any git checkout."""
    import shutil
    from pathlib import Path

    import rlhf_core
    from rlhf_core.infra.manifests import SOURCE_PACKAGES

    here = Path(rlhf_core.__file__).resolve().parents[1]
    root = tmp_path / "src"
    for package in SOURCE_PACKAGES:
        shutil.copytree(here / package, root / package)
    return root


def test_source_digest_moves_with_source_bytes_and_nothing_else(tmp_path):
    import os
    import shutil

    from rlhf_core.infra.manifests import NOT_IN_CODE_VERSION, source_digest, source_files

    assert NOT_IN_CODE_VERSION == {"rlhf_core/stages/provenance.py", "flows/cli.py", "orchestration/reports.py", "orchestration/lineage.py"}
    root = source_copy(tmp_path)
    base = source_digest(root)
    assert source_digest(root) == base and {"rlhf_core/algos/losses.py", "flows/pipeline.py"} <= set(source_files(root))

    losses = root / "rlhf_core" / "algos" / "losses.py"
    original = losses.read_bytes()
    losses.write_bytes(original.replace(b"KL_CLAMP = 10.0", b"KL_CLAMP = 20.0"))
    assert source_digest(root) != base
    losses.write_bytes(original)
    os.utime(losses, (0, 0))  # bytes, not timestamps
    assert source_digest(root) == base

    (root / "flows" / "ppo.py").write_text("")  # a new module counts at once, even an empty one
    assert source_digest(root) != base
    (root / "flows" / "ppo.py").unlink()
    shutil.move(root / "orchestration" / "cache.py", root / "orchestration" / "keys.py")  # paths count, not only bytes
    assert source_digest(root) != base
    shutil.move(root / "orchestration" / "keys.py", root / "orchestration" / "cache.py")

    (root / "rlhf_core" / "__pycache__").mkdir(exist_ok=True)
    (root / "rlhf_core" / "__pycache__" / "losses.cpython-312.pyc").write_bytes(b"compiled")
    (root / "rlhf_core" / "notes.txt").write_text("not source")
    (root / "orchestration" / "reports.py").write_text("# only renders what the jobs wrote\n")
    assert source_digest(root) == base


def test_code_version_is_the_digest_of_the_running_source_outside_git(tmp_path):
    import subprocess
    from pathlib import Path

    import rlhf_core.infra.manifests
    from rlhf_core.infra.manifests import code_version, source_digest

    here = Path(rlhf_core.infra.manifests.__file__).resolve().parents[2]
    assert code_version().endswith(f"+src.{source_digest(here)[:12]}")

    root = source_copy(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(root)}

    def version_there() -> str:
        code = "import rlhf_core.infra.manifests as v; print(v.__file__); print(v.code_version())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                             env=env).stdout.split()
        assert out[0] == str(root / "rlhf_core" / "infra" / "manifests.py")
        return out[1]

    first = version_there()
    assert first == code_version()  # the same bytes give the same version wherever they live
    path = root / "rlhf_core" / "trainers" / "dpo.py"
    path.write_text(path.read_text() + "\n# an uncommitted edit\n")
    assert version_there() != first


# ---------------------------------------------------------------------------------------------
# The PPO stage: inputs from SFT and the reward model, its cache key, resumable checkpoints.

def ppo_job_for(tmp_path, values=None, settings=None, **kw):
    import yaml

    from flows.jobs import ppo_job
    from flows.params import PipelinePPOConfig, PipelineSettings, PrepParams
    from orchestration.stages import _tags, stage_cache_key

    prompts = tmp_path / "prep" / "data" / "prompts"
    prompts.mkdir(parents=True, exist_ok=True)
    (prompts / "train.jsonl").write_text('{"prompt": "cba", "answer": "abc"}\n')
    (prompts / "test.jsonl").write_text('{"prompt": "ba", "answer": "ab"}\n')
    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft", "rm")}
    ctx = kw.pop("ctx", None) or flow_ctx(tmp_path)
    job = ppo_job(ctx, settings or PipelineSettings(), PrepParams(), PipelinePPOConfig.model_validate(values or {}),
                  upstream.__getitem__, **kw)
    key = stage_cache_key(job)
    return job, key, _tags(ctx, job, key), yaml.safe_load(job.config_yaml)


def test_ppo_takes_actor_and_reference_from_sft_reward_and_critic_from_the_reward_model(tmp_path):
    from rlhf_core.rl_config import PPOConfig

    job, _, tags, cfg = ppo_job_for(tmp_path)
    assert job.args == ["train", "ppo", "--config", "{config}"] and job.stage == "ppo"
    sft, rm, prep = (str(tmp_path / n) for n in ("sft", "rm", "prep"))
    assert cfg["actor"]["model_name_or_path"] == sft and cfg["ref"]["model_name_or_path"] == sft
    assert cfg["reward"]["model_name_or_path"] == rm and cfg["reward"]["normalize_enable"]
    assert cfg["critic"]["model_name_or_path"] == rm  # OpenRLHF's critic init: the reward model
    assert cfg["data"]["prompt_dataset"] == cfg["eval"]["dataset"] == f"json@{prep}/data/prompts"
    assert cfg["eval"]["task"] == "sort" and cfg["rollout"]["max_new_tokens"] == 16  # derived from the task
    assert cfg["ckpt"]["output_dir"] == str(tmp_path / "run" / "ppo")
    for role, name in (("model", "sft"), ("reference", "sft"), ("reward", "rm"), ("critic", "rm"), ("data", "prep")):
        assert tags[f"rlhf.upstream.{role}.run_id"] == f"run-{name}", role
    PPOConfig.model_validate(cfg).check_complete()  # what the job reads is a complete `rlhf train ppo` config

    # The verifier as the reward: no reward model upstream, the critic starts from SFT.
    _, _, tags, cfg = ppo_job_for(tmp_path, {"reward.task": "sort"})
    assert cfg["reward"]["model_name_or_path"] is None and cfg["critic"]["model_name_or_path"] == sft
    assert "rlhf.upstream.reward.run_id" not in tags and tags["rlhf.upstream.critic.run_id"] == "run-sft"
    # A reward file: an input whose bytes are in the key.
    reward_file = tmp_path / "reward.py"
    reward_file.write_text("def reward_func(**kw): pass\n")
    job_a, key_a, tags, cfg = ppo_job_for(tmp_path, {"reward.remote_url": str(reward_file),
                                                     "algo.advantage.estimator": "group_norm"})
    assert tags["rlhf.input.reward"] == str(reward_file) and cfg["critic"]["model_name_or_path"] is None
    reward_file.write_text("def reward_func(**kw): return None\n")
    assert ppo_job_for(tmp_path, {"reward.remote_url": str(reward_file), "algo.advantage.estimator": "group_norm"}
                       )[1] != key_a


def test_ppo_key_moves_with_settings_upstream_and_precision_not_with_places(tmp_path):
    from flows.jobs import PPO_NOT_IN_KEY
    from rlhf_core.rl_config import LEAVES

    assert PPO_NOT_IN_KEY <= set(LEAVES)  # every excluded name is a real field
    job, key, _, _ = ppo_job_for(tmp_path)
    assert ppo_job_for(tmp_path, ctx=flow_ctx(tmp_path / "elsewhere"))[1] == key  # not the output place
    for values in ({"train.max_steps": 81}, {"actor.adam.lr": 1e-4}, {"algo.kl.init_coef": 0.02},
                   {"rollout.n_samples_per_prompt": 2}):
        assert ppo_job_for(tmp_path, values)[1] != key, values
    # `auto` enters as what the ranks train in: bf16 on a native-bf16 cluster, fp32 here
    assert ppo_job_for(tmp_path, ctx=flow_ctx(tmp_path, native_bf16=True))[1] != key
    assert ppo_job_for(tmp_path, {"ds.param_dtype": "fp32"})[1] == key
    for values in ({"logger.logging_steps": 5}, {"ckpt.max_num": 1}):
        assert ppo_job_for(tmp_path, values)[1] == key, values
    named, named_key, tags, _ = ppo_job_for(tmp_path, {"pretrain": "org/actor"})
    assert named_key != key and tags["rlhf.input.model"] == "org/actor" and "rlhf.upstream.model.run_id" not in tags


def test_ppo_gets_a_checkpoint_folder_it_resumes_from_only_under_its_own_key(tmp_path):
    from flows.params import PipelineSettings
    from orchestration.resume import MARKER, CheckpointMismatch, claim

    job, key, _, cfg = ppo_job_for(tmp_path)
    folder = str(tmp_path / "run" / "checkpoints" / "ppo")
    assert job.checkpoint_uri == cfg["ckpt"]["path"] == folder
    assert cfg["ckpt"]["save_steps"] == PipelineSettings().checkpoint_steps and cfg["ckpt"]["load_enable"]
    assert ppo_job_for(tmp_path, settings=PipelineSettings(checkpoint_steps=0))[0].checkpoint_uri is None

    assert claim(folder, key, "ppo") is False  # the first attempt starts from step 0
    (tmp_path / "run" / "checkpoints" / "ppo" / "latest").write_text("global_step20")
    assert claim(folder, key, "ppo") is True  # a retry of the same config resumes
    other = ppo_job_for(tmp_path, {"train.max_steps": 81})[1]
    with pytest.raises(CheckpointMismatch, match=r"(?s)another configuration.*Remove the folder"):
        claim(folder, other, "ppo")
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "latest").write_text("global_step5")
    with pytest.raises(CheckpointMismatch, match=MARKER):
        claim(str(stray), key, "ppo")


def test_supervised_stages_get_a_checkpoint_folder_outside_their_cache_key(tmp_path):
    import yaml

    from flows.jobs import train_job
    from flows.params import PipelineRMConfig, PipelineSettings, PipelineSFTConfig

    upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft")}
    for cfg in (PipelineSFTConfig(), PipelineRMConfig()):
        job = train_job(flow_ctx(tmp_path), PipelineSettings(), cfg, upstream.__getitem__)
        written = yaml.safe_load(job.config_yaml)
        assert job.checkpoint_uri == written["ckpt_path"] == str(tmp_path / "run" / "checkpoints" / cfg.stage)
        assert written["save_steps"] == PipelineSettings().supervised_checkpoint_steps and written["load_checkpoint"]
        off = train_job(flow_ctx(tmp_path), PipelineSettings(supervised_checkpoint_steps=0), cfg, upstream.__getitem__)
        assert off.checkpoint_uri is None and yaml.safe_load(off.config_yaml)["ckpt_path"] is None
        assert off.config_hash == job.config_hash  # where and how often it saves is not what it trains


def test_pipeline_ppo_section_reads_every_spelling_and_keeps_derived_fields_open(tmp_path):
    from flows.cli import flow_parameters
    from flows.params import PipelinePPOConfig

    ppo = flow_parameters({"ppo": {"max_steps": 3, "actor": {"adam": {"lr": 1e-4}}, "rollout.batch_size": 64}})["ppo"]
    assert (ppo.train.max_steps, ppo.actor.adam.lr, ppo.rollout.batch_size) == (3, 1e-4, 64)
    assert ppo.algo.advantage.estimator == "gae" and ppo.critic.freezing_steps == 10  # tuned defaults under it
    # Prefect stores a deployment's parameters as JSON: nothing derived from empty inputs may freeze.
    again = PipelinePPOConfig.model_validate(ppo.model_dump(mode="json"))
    assert again.rollout.max_new_tokens is None and again.critic.model_name_or_path is None
    assert ppo_job_for(tmp_path, again.model_dump(mode="json"))[3]["rollout"]["max_new_tokens"] == 16
    with pytest.raises(ConfigError, match=r"(?s)section ppo.*--actor.adam.lr"):
        flow_parameters({"ppo": {"actor.adam.lr": -1}})


def test_default_pipeline_is_sft_rm_ppo_eval_on_the_rl_setting():
    from flows.params import EvalParams, PipelineSettings, PrepParams

    assert [s.value for s in PipelineSettings().stages] == ["prep", "sft", "rm", "ppo", "eval"]
    assert PrepParams().demo_error_rate == 0.3 and EvalParams().promote_metric == "sampled_accuracy"


def test_old_promote_metrics_are_mapped_or_refused_with_what_to_write():
    from pydantic import ValidationError

    from flows.params import EvalParams

    assert EvalParams(n_kl_samples=2).n_samples_per_prompt == 2  # its older spelling
    with pytest.raises(ValidationError, match="older spelling"):
        EvalParams(n_kl_samples=2, n_samples_per_prompt=4)
    for old, new in (("eval/policy_exact_match", "greedy_accuracy"), ("eval/policy_reward", "reward"),
                     ("eval/win_rate", "win_rate"), ("eval/kl", "kl"), ("pass_at_4", "pass_at_4")):
        assert EvalParams(promote_metric=old).promote_metric == new
    with pytest.raises(ValidationError, match="write the metric name without `eval/<name>/`, e.g. 'sampled_accuracy'"):
        EvalParams(promote_metric="eval/ppo/sampled_accuracy")
    with pytest.raises(ValidationError, match="reference's metrics cannot promote"):
        EvalParams(promote_metric="eval/reference_exact_match")
    with pytest.raises(ValidationError, match="valid: greedy_accuracy, sampled_accuracy"):
        EvalParams(promote_metric="accuracy")


def test_one_eval_job_compares_every_policy_stage(tmp_path):
    """The flow side of `rlhf eval`'s multi-policy contract: `--pretrain A,B --policy_names dpo,ppo`."""
    from flows.jobs import eval_job
    from flows.params import EvalParams, PrepParams

    prep_o, dpo, ppo, sft, rm = (outcome(n, tmp_path) for n in ("prep", "dpo", "ppo", "sft", "rm"))
    job = eval_job(flow_ctx(tmp_path), PrepParams(), EvalParams(), prep_o, {"dpo": dpo, "ppo": ppo}, sft, rm, "eval")
    args = dict(zip(job.args[1::2], job.args[2::2], strict=False))
    assert job.args[0] == "eval"
    assert args["--pretrain"] == f"{dpo.output_uri},{ppo.output_uri}" and args["--policy_names"] == "dpo,ppo"
    assert args["--ref_pretrain"] == sft.output_uri and args["--reward_pretrain"] == rm.output_uri
    assert args["--n_samples_per_prompt"] == "4" and args["--task"] == "sort"
    assert {"policy-dpo", "policy-ppo", "reference", "reward", "data"} == set(job.upstream)
    one = eval_job(flow_ctx(tmp_path), PrepParams(), EvalParams(), prep_o, {"ppo": ppo}, sft, rm, "eval")
    assert one.config_hash != job.config_hash


def test_every_policy_registers_and_champion_moves_to_the_best_of_them_and_the_champion(tmp_path, monkeypatch):
    from flows import pipeline
    from flows.params import EvalParams
    from orchestration import lineage

    versions, aliases, tags = {}, {}, {}

    def register_once(stage, uri, run_id):
        v = versions.setdefault(run_id, SimpleNamespace(name="rlhf-policy" if stage in ("dpo", "ppo") else stage,
                                                        version=str(len(versions) + 1), tags={"rlhf.output_uri": uri}))
        return v

    def alias_version(name, alias):
        number = aliases.get(alias)
        return next((SimpleNamespace(version=v.version, tags={**v.tags, **tags.get(v.version, {})})
                     for v in versions.values() if v.version == number), None)

    monkeypatch.setattr(lineage, "register_once", register_once)
    monkeypatch.setattr(lineage, "alias_version", alias_version)
    monkeypatch.setattr(lineage, "set_alias", lambda name, alias, version: aliases.__setitem__(alias, version))

    def promote(name, version, metric, value):
        tags.setdefault(version, {})[f"rlhf.eval.{metric}"] = str(value)
        champion = alias_version(name, "champion")
        previous = lineage.recorded_value(champion, metric) if champion else None
        if champion is None or previous is None or value > previous:
            aliases["champion"] = version
            return True, previous
        return False, previous

    monkeypatch.setattr(lineage, "promote", promote)

    def outcomes(dpo_value, ppo_value, tag):
        os_ = {n: outcome(n, tmp_path) for n in ("sft", "rm", "dpo", "ppo")}
        for n in ("dpo", "ppo"):
            os_[n].manifest = {"mlflow_run_id": f"{tag}-{n}"}
        os_["eval"] = outcome("eval", tmp_path, {"eval/dpo/sampled_accuracy": dpo_value,
                                                 "eval/ppo/sampled_accuracy": ppo_value})
        return os_

    first = pipeline._register(outcomes(0.70, 0.82, "a"), EvalParams(), ["dpo", "ppo"])
    assert set(first["policies"]) == {"dpo", "ppo"}
    assert first["policy"]["best"] == "ppo" and first["policy"]["champion"]
    assert aliases == {"champion": first["policies"]["ppo"]["version"], "candidate": first["policies"]["ppo"]["version"]}
    # A later run whose best (dpo, 0.80) is below the champion (0.82): candidate moves, champion stays.
    second = pipeline._register(outcomes(0.80, 0.75, "b"), EvalParams(), ["dpo", "ppo"])
    assert second["policy"]["best"] == "dpo" and not second["policy"]["champion"]
    assert aliases["champion"] == first["policies"]["ppo"]["version"]
    assert aliases["candidate"] == second["policies"]["dpo"]["version"]
    assert second["policy"]["previous_champion_value"] == 0.82
    with pytest.raises(ValueError, match="eval/dpo/greedy_accuracy.*not among"):
        pipeline._register(outcomes(0.8, 0.9, "c"), EvalParams(promote_metric="greedy_accuracy"), ["dpo", "ppo"])


def test_a_champion_of_the_old_metric_is_compared_under_its_old_name():
    from orchestration.lineage import recorded_value

    old = SimpleNamespace(tags={"rlhf.eval.eval/policy_exact_match": "0.95"})
    assert recorded_value(old, "greedy_accuracy") == 0.95 and recorded_value(old, "sampled_accuracy") is None


def test_online_rl_continues_from_the_champion_against_sft_and_promotes_only_on_improvement(tmp_path, monkeypatch):
    import yaml

    from flows import online as online_flow
    from flows.params import EvalParams, OnlineRLParams, PipelinePPOConfig, PipelineSettings, PrepParams
    from orchestration import lineage
    from orchestration.stages import StageOutcome

    prompts = tmp_path / "prep" / "data" / "prompts"
    prompts.mkdir(parents=True)
    (prompts / "train.jsonl").write_text('{"prompt": "cba", "answer": "abc"}\n')
    champion = outcome("champion", tmp_path)
    monkeypatch.setattr(lineage, "alias_version", lambda *a: SimpleNamespace(run_id="run-champion"))
    monkeypatch.setattr(lineage, "get_run", lambda run_id: run_id)
    monkeypatch.setattr(StageOutcome, "from_run", classmethod(lambda cls, run, name=None: champion))
    monkeypatch.setattr(lineage, "register_once", lambda *a: SimpleNamespace(name="rlhf-policy", version="7"))
    promoted = []
    monkeypatch.setattr(lineage, "promote", lambda name, version, metric, value: (promoted.append(value) or
                                                                               (value > 0.8, 0.8)))
    monkeypatch.setattr(online_flow, "publish_eval_report", lambda *a: {"markdown": ""})

    def go(value, start_from="champion", parent="parent-run"):
        jobs = []

        def run(job):
            jobs.append(job)
            return outcome(job.name, tmp_path, {"eval/ppo/sampled_accuracy": value})

        upstream = {n: outcome(n, tmp_path) for n in ("prep", "sft", "rm")}
        ctx = flow_ctx(tmp_path)
        ctx.parent_run_id = parent
        result = online_flow.run_online(ctx, PipelineSettings(), PrepParams(), PipelinePPOConfig(), EvalParams(),
                                        OnlineRLParams(start_from=start_from), upstream.__getitem__, run, {})
        return result, jobs

    result, (ppo, evaluation) = go(0.9)
    cfg = yaml.safe_load(ppo.config_yaml)
    assert cfg["actor"]["model_name_or_path"] == champion.output_uri == result["policy_in"]
    assert cfg["ref"]["model_name_or_path"] == str(tmp_path / "sft")  # KL to SFT, however many runs continued
    assert ppo.upstream["model"] is champion and ppo.upstream["reference"].name == "sft"
    assert evaluation.args[evaluation.args.index("--policy_names") + 1] == "ppo" and result["promoted"]
    assert not go(0.7)[0]["promoted"] and promoted == [0.9, 0.7]  # a regression stays a candidate
    other_run = go(0.9, parent="next-scheduled-run")[1][0]
    assert yaml.safe_load(other_run.config_yaml)["train"]["seed"] != cfg["train"]["seed"]  # fresh prompts
    assert other_run.config_hash != ppo.config_hash
    assert go(0.9, start_from="sft")[0]["policy_in"] == str(tmp_path / "sft")


def test_every_deployment_validates_and_the_schedules_are_there():
    from pathlib import Path

    import yaml

    from flows.cli import flow_parameters

    spec = yaml.safe_load((Path(__file__).resolve().parents[2] / "deployments" / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in spec["deployments"]}
    assert {"full-pipeline", "sft", "reward-model", "dpo", "ppo", "eval", "iterative-dpo", "online-rl"} <= \
        set(deployments)
    for name, d in deployments.items():
        params = flow_parameters(d.get("parameters") or {})
        assert d["entrypoint"] == "flows/pipeline.py:rlhf", name
        if name == "full-pipeline":
            assert [s.value for s in params["settings"].stages] == ["prep", "sft", "rm", "ppo", "eval"]
    assert deployments["ppo"]["parameters"]["settings"]["stages"] == ["ppo"]
    assert deployments["online-rl"]["parameters"]["settings"] == {"stages": ["online_rl"], "from_run": "champion"}
    assert deployments["iterative-dpo"]["schedules"][0]["cron"] == "0 3 * * *"
    assert deployments["online-rl"]["schedules"][0]["active"]


def test_lineage_of_a_ppo_run_shows_its_changed_settings_not_its_paths():
    from flows.params import PipelinePPOConfig
    from rlhf_core.infra.tracking import redact_params
    from rlhf_core.stages.provenance import params_off_default

    cfg = PipelinePPOConfig.model_validate({"pretrain": "/m/sft", "reward_pretrain": "/m/rm", "save_path": "/o",
                                            "prompt_data": "json@/d", "ckpt.path": "/c", "max_steps": 7})
    shown = params_off_default("ppo", redact_params(cfg.model_dump(mode="json")))
    assert shown["train.max_steps"] == "7" and shown["algo.advantage.lambd"] == "0.95"  # tuned, off the CLI default
    assert not [k for k in shown if k.endswith(("model_name_or_path", "output_dir", "prompt_dataset", "ckpt.path"))]


def test_the_error_tag_keeps_the_headline_and_the_end_of_a_long_error():
    from orchestration.stages import error_tag

    headline = "Ray job rlhf-sft-1 FAILED (exit code 1): rlhf: error: role 'train' rank 1: the actor died"
    error = RuntimeError(headline + "\n" + "x" * 20000 + "\nlast log line")
    tag = error_tag(error)
    assert len(tag) <= 5000
    assert tag.startswith("RuntimeError: " + headline) and tag.endswith("last log line")
    assert error_tag(ValueError("short")) == "ValueError: short"


def test_the_error_tag_redacts_before_it_cuts(monkeypatch):
    """A credential that the cut would split is still found: redaction runs on the whole text first."""
    from orchestration.stages import error_tag

    secret = "Zq8" + "v" * 40
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    text = "boom\n" + "x" * 6000 + secret + "y" * 4955  # the tail kept (4975 chars) starts inside the secret
    tag = error_tag(RuntimeError(text))
    assert "vvvvvvvvvv" not in tag and "***" in tag
