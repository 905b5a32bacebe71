"""A reward function in a Python file (`--reward.remote_url reward.py`, flat `--remote_rm_url`).

The file defines `reward_func(queries, prompts, labels, **kwargs)` (OpenRLHF's signature), called
once per batch with the keyword arguments its signature accepts: all of them (`responses=`...) with
`**kwargs`, the named ones otherwise, none for OpenRLHF <= 0.9's `reward_func(queries, prompts,
labels)`. It is returning `{"rewards", "scores"?, "extra_logs"?}` or the bare rewards (tensors,
lists or numpy arrays; `base.as_reward_output`). A file that cannot be loaded is a `ConfigError`;
a call that raises or answers something unusable is a `RewardError`; both name the file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import sys
from pathlib import Path

from rlhf_core.infra.settings import ConfigError
from rlhf_core.rewards.base import RewardError, RewardOutput, as_reward_output, check_batch


class RewardFile:
    def __init__(self, path: str | Path, func):
        self.path = str(path)
        self.func = func
        self.name = f"reward file {self.path}"
        self.keywords = accepted_keywords(func, self.name)

    def __call__(self, queries: list[str], prompts: list[str], labels: list, **kwargs) -> RewardOutput:
        n = check_batch(queries, prompts, labels, self.name)
        if self.keywords is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.keywords}
        try:
            value = self.func(list(queries), list(prompts), list(labels), **kwargs)
        except Exception as e:
            raise RewardError(f"{self.name}: reward_func raised {type(e).__name__}: {e}") from e
        return as_reward_output(value, n, self.name)

    def __repr__(self) -> str:
        return f"RewardFile({self.path!r})"


def accepted_keywords(func, name: str) -> frozenset[str] | None:
    """The keyword arguments `func` takes besides its three positional ones (None: any, `**kwargs`).
    A function that cannot take `(queries, prompts, labels)` is a `ConfigError`."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin or C function: no signature to read, pass everything
        return None
    try:
        signature.bind_partial(None, None, None)  # required keywords (`responses`) are passed by name
    except TypeError as e:
        raise ConfigError(f"{name}: reward_func{signature} cannot be called as reward_func(queries, prompts, "
                          f"labels): {e}") from None
    params = list(signature.parameters.values())
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return frozenset(p.name for p in params[len(positional[:3]):]
                     if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY))


def load_reward_file(path: str | Path) -> RewardFile:
    """Import `path` and return its `reward_func` as a batched reward source."""
    p = Path(path).expanduser()
    if p.suffix != ".py":
        raise ConfigError(f"reward file {path}: expected a .py file defining reward_func(queries, prompts, labels)")
    if not p.is_file():
        raise ConfigError(f"reward file {path}: no such file")
    p = p.resolve()
    try:
        digest = hashlib.sha256(p.read_bytes()).hexdigest()
    except OSError as e:
        raise ConfigError(f"reward file {path}: cannot be read ({e.strerror})") from None
    key = (str(p), digest)  # the CLI checks the file before the stage loads it: import it once
    if key not in _LOADED:
        _LOADED[key] = _import(path, p)
    return _LOADED[key]


_LOADED: dict[tuple[str, str], RewardFile] = {}


def _import(path, p: Path) -> RewardFile:
    # A module name of its own per file, so two reward files (or a reload) never share a module.
    name = f"rlhf_reward_file_{hashlib.sha256(str(p).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ConfigError(f"reward file {path}: cannot be imported")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling inside the file look their module up
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        sys.modules.pop(name, None)
        raise ConfigError(f"reward file {path}: importing it raised {type(e).__name__}: {e}") from None
    func = getattr(module, "reward_func", None)
    if func is None:
        raise ConfigError(f"reward file {path}: defines no reward_func(queries, prompts, labels, **kwargs)")
    if not callable(func):
        raise ConfigError(f"reward file {path}: reward_func is a {type(func).__name__}, not a function")
    return RewardFile(p, func)


__all__ = ["RewardError", "RewardFile", "load_reward_file"]
