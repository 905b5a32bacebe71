"""The slow shared settings of the learning tests, built by a process of their own beside the tests
(`python -m tests.settings ROOT NAME...`: each NAME in turn, into ROOT/NAME, which then holds its
`setting.json`).

Each setting trains for minutes on the CPU. conftest starts one niced process for all the
settings the collected tests need as soon as collection ends, in the order the tests need them, so
they train on the cores the tests before them leave idle (the integration tests mostly wait on
Ray, Prefect and their subprocesses); a setting's fixture then waits for its `setting.json` only.

- `rl_setting` (tests/rl_setting.py): where RL has room, for every RL test.
- `kd_setting` (tests/kd_setting.py): a teacher for distillation, from the RL setting's base.
- `prm_setting` (tests/prm_setting.py): the column-addition task's SFT policy and process reward model.
- `agent_setting` (tests/agent_setting.py): the tool task's SFT policy.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from tests.background import BackgroundProcess

REPO = Path(__file__).resolve().parents[1]
# name -> the settings its build reads, in the order the tests need them
BUILDERS = {"rl_setting": (), "kd_setting": ("rl_setting",), "prm_setting": (), "agent_setting": ()}


def with_needs(names) -> list[str]:
    """The settings to build for `names`, with those they read, in BUILDERS' order."""
    wanted = set(names)
    for name in reversed(BUILDERS):
        if name in wanted:
            wanted.update(BUILDERS[name])
    return [name for name in BUILDERS if name in wanted]


class PendingSettings(BackgroundProcess):
    """The builds, started in the background; `stop` also removes what they wrote."""

    def __init__(self, root: Path, names: list[str]):
        self.root, self.names = root, names
        root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, RLHF_HOME=str(root / ".rlhf"), RLHF_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false")
        env.pop("RAY_ADDRESS", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        # (started at full priority, the RL setting slowed the first pipeline beside it from 160 to 407 s)
        super().__init__([sys.executable, "-m", "tests.settings", str(root), *names], root / "build.log", cwd=REPO,
                         env=env)

        (root / PID).write_text(str(self.proc.pid))

    def result(self, name: str, timeout_s: float = 1800) -> dict:
        return wait_for(self.root, self.names, name, timeout_s)

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.root, ignore_errors=True)


class SharedSettings:
    """The same builds started by another pytest-xdist worker of this run, in the folder they share
    (conftest): this worker only waits on their files; the run's controller stops and removes them."""

    def __init__(self, root: Path, names: list[str]):
        self.root, self.names = root, names

    def result(self, name: str, timeout_s: float = 1800) -> dict:
        return wait_for(self.root, self.names, name, timeout_s)

    def stop(self) -> None:
        pass


PID = "builder.pid"


def builder_running(root: Path) -> bool:
    """Whether the build process of `root` is still at work (a zombie has ended); not yet started
    counts as running, for a worker that asks before the one that claimed the folder started it."""
    try:
        pid = int((root / PID).read_text())
    except (FileNotFoundError, ValueError):
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def stop_builder(root: Path) -> None:
    """Kills the build process of `root` if it still runs, and removes the folder."""
    try:
        os.kill(int((root / PID).read_text()), 9)
    except (FileNotFoundError, ValueError, ProcessLookupError):
        pass
    shutil.rmtree(root, ignore_errors=True)


def wait_for(root: Path, names: list[str], name: str, timeout_s: float) -> dict:
    """The setting's paths once it is built; a failed build fails with its log."""
    assert name in names, f"{name} is not among the settings this build makes: {names}"
    done, deadline = root / name / "setting.json", time.monotonic() + timeout_s
    while not done.exists() and builder_running(root):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not built within {timeout_s:.0f} s; see {root / 'build.log'}")
        time.sleep(1.0)
    if not done.exists():  # the build ended without it: fails with the log's end
        log = root / "build.log"
        raise AssertionError(f"the settings' build ended without {done}:\n"
                             f"{log.read_text()[-4000:] if log.exists() else '(no log)'}")
    return json.loads(done.read_text())


def build_all(root: Path, names: list[str]) -> None:
    built: dict[str, dict] = {}
    for name in names:
        folder = root / name
        needs = {need: built[need] for need in BUILDERS[name]}  # KeyError: a need not built before it
        setting = built[name] = importlib.import_module(f"tests.{name}").build(folder / "work", **needs)
        tmp = folder / "setting.json.tmp"
        tmp.write_text(json.dumps(setting))
        tmp.rename(folder / "setting.json")  # whole or absent: a fixture reads it as soon as it exists


if __name__ == "__main__":
    build_all(Path(sys.argv[1]), sys.argv[2:])
