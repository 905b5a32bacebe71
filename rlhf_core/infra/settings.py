"""Where a run keeps its state and how settings from the environment are read.

The state directory (`RLHF_HOME`, default `./.rlhf`) holds the embedded MLflow store, compiled
ops and pipeline outputs; `MLFLOW_TRACKING_URI` and `RLHF_ARTIFACT_ROOT` point elsewhere. A bad
value is a `ConfigError` that names the setting: the CLI turns it into exit code 2.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


class ConfigError(ValueError):
    """A configuration problem with a message that names the field or flag."""


EXIT_CONFIG = 2  # the exit status of every command refused for bad configuration or data (not retried)


def env_number(name: str, default: float, *, allow_zero: bool = False, integer: bool = False) -> float:
    """A numeric setting read from the environment (`default` when unset or blank); a ConfigError
    naming the variable when it is not a finite number > 0 (>= 0 with `allow_zero`)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = math.nan
    if not (value >= 0 if allow_zero else value > 0) or math.isinf(value):
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{name}={raw!r}: must be {kind} {'>= 0' if allow_zero else '> 0'} (default {default:g})")
    return value


def state_dir() -> Path:
    """The project's state directory (MLflow store, compiled ops, pipeline outputs)."""
    return Path(os.environ.get("RLHF_HOME", Path.cwd() / ".rlhf")).resolve()


def tracking_uri() -> str:
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    home = state_dir()
    home.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{home / 'mlflow.db'}"


def artifact_root() -> str:
    return os.environ.get("RLHF_ARTIFACT_ROOT") or (state_dir() / "mlartifacts").as_uri()
