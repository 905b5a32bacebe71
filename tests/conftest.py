"""Shared fixtures: everything is built locally (no hub), once per session where possible."""

from __future__ import annotations

import os
import sys

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


GPU_DRY_RUN = pytest.StashKey()
GPU_DRY_RUN_TEST = "test_the_gpu_profile_resolves_with_vllm"


def pytest_collection_finish(session):
    """The GPU profile's pip resolve starts once the test that reads it is collected (tests/pip_dry_run.py)."""
    if any(item.name == GPU_DRY_RUN_TEST for item in session.items):
        from tests.pip_dry_run import PipDryRun

        session.config.stash[GPU_DRY_RUN] = PipDryRun("gpu")


def pytest_unconfigure(config):
    dry_run = config.stash.get(GPU_DRY_RUN, None)
    if dry_run is not None:
        dry_run.stop()  # a session cut short leaves no pip behind


@pytest.fixture
def gpu_profile_dry_run(request):
    """The GPU profile's dry run (started when collection ended, or now)."""
    from tests.pip_dry_run import PipDryRun

    return request.config.stash.get(GPU_DRY_RUN, None) or PipDryRun("gpu")


@pytest.fixture(autouse=True)
def _no_vllm_in_the_test_process():
    """vLLM runs in processes of its own in the tests (Ray actors, `rlhf` subprocesses): started in
    this one it would initialise torch.distributed for the whole process, bind its threads and drop
    torch to one thread, and every later in-process DeepSpeed test would fail."""
    yield
    assert "vllm" not in sys.modules, "this test imported vLLM into the test process"


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
    from rlhf_core.stages.prep import prepare

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


@pytest.fixture(scope="session")
def rl_setting(tmp_path_factory):
    """Where RL has room: sort with 30% wrong SFT demonstrations. An SFT model of it answers held-out
    prompts right greedily (~98%) but only ~65-70% of the time sampled at temperature 1; a reward
    model trained on the (always correct) preference pairs ranks ~98% of held-out pairs.
    fp32, one in-process rank each: the same on every CPU kind. Shared by every RL test."""
    from rlhf_core.cli import main
    from rlhf_core.stages.prep import prepare

    root = tmp_path_factory.mktemp("rl_setting")
    paths = prepare(root / "prep", task="sort", seed=0, model_size="tiny", n_train=4000, n_test=200,
                    demo_error_rate=0.3)
    common = ["--apply_chat_template", "--max_len", "64", "--packing_samples", "--param_dtype", "fp32",
              "--lr_warmup_ratio", "0.05", "--seed", "0", "--use_mlflow", "false", "--learning_rate", "1e-3",
              "--max_epochs", "50"]
    assert main(["train", "sft", "--pretrain", paths["base"], "--dataset", f"json@{paths['sft']}",
                 "--save_path", str(root / "sft"), "--train_batch_size", "32", "--micro_train_batch_size", "32",
                 "--max_steps", "1000", *common]) == 0
    assert main(["train", "rm", "--pretrain", str(root / "sft"), "--dataset", f"json@{paths['preference']}",
                 "--save_path", str(root / "rm"), "--train_batch_size", "64", "--micro_train_batch_size", "32",
                 "--max_steps", "300", *common]) == 0
    return {"sft": str(root / "sft"), "rm": str(root / "rm"), "prompts": paths["prompts"], "root": str(root)}
