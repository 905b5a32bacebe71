"""tests/rl_setting.py: the test processes of one run (pytest-xdist's workers) share one build."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_the_second_process_joins_the_first_one_s_build_and_sees_its_failure(tmp_path, monkeypatch):
    from tests import rl_setting

    started = []

    class Quick(rl_setting.BackgroundProcess):  # the build's bookkeeping around a command that ends at once
        def __init__(self, root):
            self.root = root
            super().__init__([sys.executable, "-c", "print('training'); raise SystemExit(3)"], root / "build.log")
            (root / "build.pid").write_text(str(self.proc.pid))
            started.append(self)

    monkeypatch.setattr(rl_setting, "PendingSetting", Quick)
    first = rl_setting.start_or_join(tmp_path)
    second = rl_setting.start_or_join(tmp_path)
    assert first is started[0] and isinstance(second, rl_setting.JoinedSetting) and len(started) == 1
    first.proc.wait()
    with pytest.raises(AssertionError, match="build failed:\n.*training"):
        second.result(timeout_s=30)

    (tmp_path / "rl_setting" / "setting.json").write_text(json.dumps({"sft": "s"}))
    assert second.result(timeout_s=5) == {"sft": "s"}  # a finished build is read, whatever its process


def test_stop_build_kills_the_running_build(tmp_path):
    from tests.rl_setting import stop_build

    (tmp_path / "rl_setting").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (tmp_path / "rl_setting" / "build.pid").write_text(str(proc.pid))
    stop_build(tmp_path)
    assert proc.wait(timeout=10) == -9
