"""Shared fixtures: everything is built locally (no hub), once per session where possible."""

from __future__ import annotations

import os
import sys

import pytest

os.environ.setdefault("RLHF_NO_PROGRESS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Ray starts its workers (every actor and task) at niceness 15, below "user processes" (its
# worker_niceness). Here the user processes are the other pytest-xdist worker's tests: while those
# kept both cores busy, a Ray actor of this worker got a few percent of one (a vLLM engine's start
# took 123 s beside two busy processes instead of 14 s alone; at niceness 0, 22 s). Every local
# cluster the tests start (each reads this from its environment) runs its workers at 0, sharing the
# cores evenly with the other worker; the settings' builder stays at 19 (tests/background.py).
os.environ.setdefault("RAY_worker_niceness", "0")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # two workers share the cores: a torch or OpenMP pool of more than one thread per process (this
    # one and all it starts) only contends with the other worker's (tiny models: 10-40x slower)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


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
SETTINGS = pytest.StashKey()  # name of a setting -> the PendingSettings building it


def pytest_collection_finish(session):
    """Slow preparations start once a test that reads them is collected, and run beside the tests
    before it: the GPU profile's pip resolve (tests/pip_dry_run.py; it waits on the registry) and
    the learning tests' settings (tests/settings.py: minutes of training each, in one process, while
    the integration tests before the first learning test mostly wait on their processes)."""
    if any(item.name == GPU_DRY_RUN_TEST for item in session.items):
        session.config.stash[GPU_DRY_RUN] = _start_dry_run(session.config)
    from tests.settings import BUILDERS, with_needs

    needed = [name for name in BUILDERS if any(name in getattr(item, "fixturenames", ())
                                               and not item.get_closest_marker("skip") for item in session.items)]
    if needed:
        _start_settings(session.config, with_needs(needed))


def _start_settings(config, names: list[str]):
    """Starts the builds of `names`. Under pytest-xdist every worker collects the same tests and
    asks for the same settings when collection ends: the first to claim the run's shared folder
    builds them there, the others wait on its files (a fixture asking later builds on its own)."""
    import tempfile
    from pathlib import Path

    from tests.settings import PendingSettings, SharedSettings

    shared = _shared_settings_root(config)
    if shared is not None and SETTINGS not in config.stash:
        try:
            shared.mkdir()
            pending = PendingSettings(shared, names)
        except FileExistsError:
            pending = SharedSettings(shared, names)
    else:
        pending = PendingSettings(Path(tempfile.mkdtemp(prefix="rlhf-settings-")), names)
    config.stash.setdefault(SETTINGS, {}).update(dict.fromkeys(names, pending))
    return pending


def _start_dry_run(config):
    """The GPU profile's pip resolve: under pytest-xdist the first worker to claim the run's
    dry-run folder starts it, the others wait on its files (any worker may get its test)."""
    from tests.pip_dry_run import PipDryRun, SharedDryRun

    folder = _shared_dry_run_folder(config)
    if folder is None:
        return PipDryRun("gpu")
    try:
        folder.mkdir()
    except FileExistsError:
        return SharedDryRun(folder)
    return PipDryRun("gpu", folder)


def _shared_dry_run_folder(config):
    shared = _shared_settings_root(config)
    return None if shared is None else shared.with_name(shared.name + "-pip-gpu")


def _shared_settings_root(config):
    """The settings' folder the workers of one pytest-xdist run share (None without xdist)."""
    import tempfile
    from pathlib import Path

    uid = getattr(config, "workerinput", {}).get("testrunuid") or (
        config.getoption("testrunuid", None) if _is_xdist_controller(config) else None)
    return Path(tempfile.gettempdir()) / f"rlhf-settings-{uid}" if uid else None


def _worker_id(config) -> str | None:
    """This pytest-xdist worker's name (gw0, gw1, ...), None without xdist: one of them starts the
    pip resolve when collection ends; a test of it on another starts its own."""
    return getattr(config, "workerinput", {}).get("workerid")


def _is_xdist_controller(config) -> bool:
    return not hasattr(config, "workerinput") and bool(config.getoption("numprocesses", None))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if _is_xdist_controller(config) and config.getoption("testrunuid", None) is None:
        import uuid

        config.option.testrunuid = uuid.uuid4().hex  # the workers get it; so the controller knows it


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: `-p no:xdist` runs without it
def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject's addopts): two workers on two cores or more, none on one. The tests
    mostly wait on their processes (a pipeline test leaves about 45% of 2 cores idle), so two
    workers fill the idle core; more would only contend for the cores and memory of a 2-core CI."""
    return 2 if (os.cpu_count() or 1) >= 2 else 0


def pytest_unconfigure(config):
    shared = _shared_settings_root(config)
    pending = [config.stash.get(GPU_DRY_RUN, None), *set(config.stash.get(SETTINGS, {}).values())]
    dry_run = _shared_dry_run_folder(config)
    for process in pending:
        if process is not None and getattr(process, "root", None) not in (shared, dry_run):
            process.stop()  # a session cut short leaves nothing running (and the settings' folders go)
    if _is_xdist_controller(config):
        from tests.settings import stop_builder

        stop_builder(shared)  # the workers' shared builds and dry run, once the last worker is done
        stop_builder(dry_run)


@pytest.fixture
def gpu_profile_dry_run(request):
    """The GPU profile's dry run (started when collection ended, or now)."""
    stash = request.config.stash
    if GPU_DRY_RUN not in stash:
        stash[GPU_DRY_RUN] = _start_dry_run(request.config)
    return stash[GPU_DRY_RUN]


@pytest.fixture(autouse=True)
def _no_vllm_in_the_test_process():
    """vLLM runs in processes of its own in the tests (Ray actors, `rlhf` subprocesses): started in
    this one it would initialise torch.distributed for the whole process, bind its threads and drop
    torch to one thread, and every later in-process DeepSpeed test would fail."""
    yield
    assert "vllm" not in sys.modules, "this test imported vLLM into the test process"


@pytest.fixture(autouse=True)
def _mlflow_uri_kept_to_its_test():
    """`mlflow.set_tracking_uri` (some unit tests call it) also exports MLFLOW_TRACKING_URI, which
    every later test of the worker, and every process it starts, would inherit: a test passing or
    failing by which tests ran before it. Each test ends with the variable as it found it."""
    before = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if before is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = before


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


def _setting_fixture(name: str):
    """The session fixture of a setting of tests/settings.py (tests/<name>.py says what it holds):
    started when collection ended where a collected test needs it, else when first asked for (and
    stopped at the end all the same)."""

    @pytest.fixture(scope="session", name=name)
    def setting(request) -> dict:
        from tests.settings import with_needs

        stash = request.config.stash.get(SETTINGS, {})
        pending = stash.get(name) or _start_settings(request.config, with_needs([name]))
        return pending.result(name)

    return setting


# Where RL has room (every RL test); a distillation teacher from its base; the column-addition
# task's SFT policy and process reward model; the tool task's SFT policy.
rl_setting, kd_setting, prm_setting, agent_setting = (
    _setting_fixture(name) for name in ("rl_setting", "kd_setting", "prm_setting", "agent_setting"))
