"""`pip install --dry-run` of the project's requirements plus one extra, into an empty environment,
in the background: metadata only, no wheels, no editable build of this package. The GPU profile's
resolve waits on the package registry for a minute or more, so conftest starts it as soon as the
test that reads it is collected, and it runs beside the tests before that one.

Under pytest-xdist every worker collects that test, and any of them may run it: the first worker
to claim the run's dry-run folder starts pip there (`PipDryRun`), the others wait on its files
(`SharedDryRun`), and the run's controller stops it at the end (conftest)."""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from tests.background import BackgroundProcess
from tests.settings import PID, builder_running

REPO = Path(__file__).resolve().parents[1]


class PipDryRun(BackgroundProcess):
    def __init__(self, extra: str, root: Path | None = None):
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: pip's own copy of the same parser
            from pip._vendor import tomli as tomllib

        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]  # as checked out
        self.root = root or Path(tempfile.mkdtemp(prefix=f"rlhf-dry-run-{extra}-"))
        (self.root / "requirements.txt").write_text("\n".join(project["dependencies"]
                                                                + project["optional-dependencies"][extra]))
        self.report = self.root / "report.json"
        super().__init__([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          "--report", str(self.report), "-r", str(self.root / "requirements.txt")],
                         self.root / "pip.log", cwd=REPO)
        (self.root / PID).write_text(str(self.proc.pid))  # for the other workers (tests/settings.py's convention)

    def result(self, timeout_s: float = 600) -> dict[str, str]:
        """Name -> version of everything it would install, this package aside (waits for pip)."""
        self.wait(timeout_s)
        return read_report(self.report)


class SharedDryRun:
    """The same dry run started by another pytest-xdist worker in the folder they share."""

    def __init__(self, root: Path):
        self.root = root

    def result(self, timeout_s: float = 600) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while builder_running(self.root):
            if time.monotonic() > deadline:
                raise TimeoutError(f"pip's dry run did not end within {timeout_s:.0f} s; see {self.root / 'pip.log'}")
            time.sleep(1.0)
        report = self.root / "report.json"
        assert report.exists(), f"pip's dry run ended without a report:\n{(self.root / 'pip.log').read_text()[-4000:]}"
        return read_report(report)

    def stop(self) -> None:
        pass


def read_report(report: Path) -> dict[str, str]:
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}
