"""A command run beside the tests: niced (`nice -n 19` execs it, so the PID is the command's own),
it takes only the cores the tests leave idle. conftest starts the slow preparations this way when
collection ends (tests/pip_dry_run.py, tests/settings.py) and stops what still runs at the end."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

MARK = "RLHF_TESTS_BACKGROUND"  # in the environment of a background command and all it starts


class BackgroundProcess:
    def __init__(self, argv: list[str], log: Path, env: dict | None = None, **popen):
        self.argv, self.log = argv, log
        popen["env"] = {**(os.environ if env is None else env), MARK: "1"}
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["nice", "-n", "19", *argv], stdout=out, stderr=subprocess.STDOUT, **popen)

    def wait(self, timeout_s: float) -> None:
        """Until it exits; an exit other than 0 fails with the end of its log."""
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        assert code == 0, f"{' '.join(self.argv[:4])} ... failed (exit {code}):\n{self.log.read_text()[-4000:]}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
