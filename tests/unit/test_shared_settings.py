"""The learning settings under pytest-xdist (tests/settings.py, conftest): the worker that claimed the
run's folder builds them; another waits on the same files and fails with the build's log, not a
timeout, when the build ends without the one it needs."""

import json
import subprocess
import sys
import threading
import time

import pytest

from tests.settings import SharedSettings, builder_running, stop_builder


def test_another_worker_gets_the_setting_once_the_builder_writes_it(tmp_path):
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / "builder.pid").write_text(str(builder.pid))
        waiting = SharedSettings(tmp_path, ["rl_setting"])

        def write_later():
            time.sleep(1.5)
            (tmp_path / "rl_setting").mkdir()
            (tmp_path / "rl_setting" / "setting.json").write_text(json.dumps({"policy": "/p"}))

        threading.Thread(target=write_later).start()
        assert waiting.result("rl_setting", timeout_s=20) == {"policy": "/p"}
        waiting.stop()  # a worker that did not build never stops the build
        assert builder.poll() is None
    finally:
        builder.kill()
        builder.wait()


def test_a_build_that_ended_without_the_setting_fails_the_waiter_with_its_log(tmp_path):
    builder = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    (tmp_path / "builder.pid").write_text(str(builder.pid))
    (tmp_path / "build.log").write_text("Traceback ...\nValueError: the RL setting's SFT diverged\n")
    time.sleep(1.0)  # exited: a zombie until its parent (this process, the claiming worker) reaps it
    assert not builder_running(tmp_path)
    started = time.monotonic()
    with pytest.raises(AssertionError, match="SFT diverged"):
        SharedSettings(tmp_path, ["kd_setting"]).result("kd_setting", timeout_s=60)
    assert time.monotonic() - started < 10
    builder.wait()


def test_the_controller_stops_the_build_and_removes_its_folder(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    builder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    (root / "builder.pid").write_text(str(builder.pid))
    assert builder_running(root)
    stop_builder(root)
    assert builder.wait(timeout=10) == -9 and not root.exists()
