"""Shared fixtures: everything is built locally (no hub), once per session where possible."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("RLHF_NO_PROGRESS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _state_dir(tmp_path_factory):
    """MLflow store, compiled DeepSpeed ops and caches under a per-session state directory."""
    home = tmp_path_factory.mktemp("rlhf_home")
    os.environ["RLHF_HOME"] = str(home)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/rlhf-torch-extensions"))
    _drop_stale_build_locks(os.environ["TORCH_EXTENSIONS_DIR"])
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield home


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: more torch threads only contend (10-40x slower)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def prepared(tmp_path_factory):
    """The built-in addition task with a tiny model (small n so tests stay fast)."""
    from rlhf_core.prep import prepare

    out = tmp_path_factory.mktemp("prep")
    paths = prepare(out, task="addition", seed=0, model_size="tiny", n_train=1024, n_test=128)
    return {k: str(v) for k, v in paths.items()} | {"root": str(out)}


def _drop_stale_build_locks(extensions_dir: str, older_than_s: float = 900) -> None:
    """A compile of a DeepSpeed op that was killed leaves its `lock` file behind, and every later
    build of that op waits on it forever (a test then hangs until its timeout). A build takes
    1-2 minutes; a lock untouched for 15 is a leftover: remove it and the half-built folder."""
    import shutil
    import time
    from pathlib import Path

    for lock in Path(extensions_dir).glob("*/lock"):
        if time.time() - lock.stat().st_mtime > older_than_s:
            shutil.rmtree(lock.parent, ignore_errors=True)
