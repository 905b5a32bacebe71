"""What identifies a run's code and configuration: the package version + a source digest, and a config hash.

Cheap and torch-free, so the orchestration layer computes cache keys with the same functions the
trainers write into `stage.json`. The code version digests the source files, not a git commit: a
commit misses uncommitted edits, and a `pip install .` or cluster image has no checkout. It covers
every `.py` of `rlhf_core`, `flows` and `orchestration` (these build jobs' arguments and environment,
which no params hash covers), less `NOT_IN_CODE_VERSION`; a new module counts until excluded with a reason.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path

SOURCE_PACKAGES = ("rlhf_core", "flows", "orchestration")
# Modules that cannot change a stage's output, so editing them must not invalidate every cache:
# `rlhf lineage` (reads runs), the pipeline CLI (its parsed parameters are hashed in the keys
# themselves), the summary/markdown reports and the MLflow bookkeeping of the flow.
NOT_IN_CODE_VERSION = frozenset({"rlhf_core/stages/provenance.py", "flows/cli.py", "orchestration/reports.py", "orchestration/lineage.py"})

# A config field's `json_schema_extra` when it says where things go or how a run is watched, not
# what is trained (input and output paths, checkpoint cadence, tracking): config hashes leave it
# out (inputs enter cache keys by content or upstream key instead), and so does `rlhf lineage`'s
# list of changed settings. One marker on the field, whatever the config or section.
NOT_SEMANTIC = {"semantic": False}


def is_semantic(field) -> bool:
    extra = field.json_schema_extra
    return not (isinstance(extra, dict) and extra.get("semantic") is False)


def semantic_values(cfg) -> dict:
    """`cfg.model_dump(mode="json")` without its `NOT_SEMANTIC` fields, in every section."""
    return _semantic(cfg, cfg.model_dump(mode="json"))


def _semantic(model, values: dict) -> dict:
    out = {}
    for name, field in type(model).model_fields.items():
        if is_semantic(field):
            value = getattr(model, name)
            out[name] = _semantic(value, values[name]) if hasattr(type(value), "model_fields") else values[name]
    return out


def not_semantic_paths(config_cls) -> set[str]:
    """The dotted names (`save_path`, `actor.model_name_or_path`) of a config class's `NOT_SEMANTIC` fields."""
    out = set()
    for name, field in config_cls.model_fields.items():
        if not is_semantic(field):
            out.add(name)
        elif isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
            out |= {f"{name}.{sub}" for sub in not_semantic_paths(field.annotation)}
    return out


def values_hash(values: dict) -> str:
    """sha256 of JSON values, key order ignored: how every config and settings hash is computed."""
    return "sha256:" + hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()


def config_hash(cfg) -> str:
    """sha256 of a config's semantic fields (inputs and outputs are hashed separately, by content)."""
    return values_hash(semantic_values(cfg))


def params_hash(params, exclude: frozenset[str] = frozenset(), **extra) -> str:
    """sha256 of every field of a pydantic model but the `exclude`d ones, plus `extra` values.

    For settings that are not stage configs (prep, evaluation, iterative rounds): unlike
    `config_hash` nothing is dropped by name, so a new field counts at once. `extra` (the task, a
    round's seed) is hashed apart from the fields so no name can shadow one.
    """
    return values_hash({"params": params.model_dump(mode="json", exclude=set(exclude)), "extra": extra})


def stage_manifest(cfg, inputs: dict, metrics: dict, mlflow_run_id: str | None,
                   precision: str | None = None) -> dict:
    """The `stage.json` of a stage run from `cfg` (secrets redacted); callers add `output_uri`.

    `precision`: the `param_dtype` a trainer resolved on its hardware; it replaces `auto` in the
    config hash, so outputs of different precisions never share a hash.
    """
    import time

    from rlhf_core.infra.tracking import redact

    hashed = cfg
    if precision is not None:  # the trainers' (`ds.param_dtype`)
        hashed = cfg.model_copy(update={"ds": cfg.ds.model_copy(update={"param_dtype": type(cfg.param_dtype)(precision)})})
    return {
        "stage": cfg.stage,
        "config_hash": config_hash(hashed),
        **({"precision": precision} if precision is not None else {}),
        "config": redact(cfg.model_dump(mode="json")),
        "inputs": redact(inputs),
        "metrics": {k: v for k, v in metrics.items() if isinstance(v, (int, float))},
        "mlflow_run_id": mlflow_run_id,
        "code_version": code_version(),
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def source_files(root: Path) -> list[str]:
    """Sorted POSIX paths, relative to `root`, of the source files the code version covers."""
    files = []
    for package in SOURCE_PACKAGES:
        for path in (root / package).rglob("*.py"):
            rel = path.relative_to(root).as_posix()
            if "__pycache__" not in path.relative_to(root).parts and rel not in NOT_IN_CODE_VERSION:
                files.append(rel)
    return sorted(files)


def source_digest(root: Path) -> str:
    """sha256 (hex) of the covered source files under `root`: each one's relative path and bytes."""
    digest = hashlib.sha256()
    for rel in source_files(root):
        data = (root / rel).read_bytes()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


@lru_cache(maxsize=1)
def code_version() -> str:
    """`<package version>+src.<12 hex of source_digest>`, computed once per process."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        pkg = version("rlhf-lifecycle")
    except PackageNotFoundError:
        pkg = "0+unknown"
    src = "src." + source_digest(Path(__file__).resolve().parents[2])[:12]
    return f"{pkg}.{src}" if "+" in pkg else f"{pkg}+{src}"
