"""Helpers shared by the flow tests (test_flow_*.py): context, stage outcomes, perturbed params, PPO job."""

from __future__ import annotations

from enum import Enum


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
        candidates = [7, 0.5, "x", *(info.examples or [])]
    elif isinstance(value, Enum):  # another named choice (estimators, loss modes, ...)
        candidates = [m for m in type(value) if m != value]
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


def outcome(name: str, tmp_path, metrics=None):
    from orchestration.stages import StageOutcome

    stage = name.split("-")[0]
    return StageOutcome(stage, name, str(tmp_path / name), f"run-{name}", f"key-{name}", False, metrics or {}, {})


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
