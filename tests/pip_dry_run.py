"""`pip install --dry-run` of the project's requirements plus one extra, into an empty environment,
in the background: metadata only, no wheels, no editable build of this package. The GPU profile's
resolve waits on the package registry for a minute or more, so conftest starts it as soon as the
test that reads it is collected, and it runs beside the tests before that one."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.background import BackgroundProcess

REPO = Path(__file__).resolve().parents[1]


class PipDryRun(BackgroundProcess):
    def __init__(self, extra: str):
        try:
            import tomllib
        except ModuleNotFoundError:  # Python 3.10: pip's own copy of the same parser
            from pip._vendor import tomli as tomllib

        project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]  # as checked out
        folder = Path(tempfile.mkdtemp(prefix=f"rlhf-dry-run-{extra}-"))
        (folder / "requirements.txt").write_text("\n".join(project["dependencies"]
                                                           + project["optional-dependencies"][extra]))
        self.report = folder / "report.json"
        super().__init__([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          "--report", str(self.report), "-r", str(folder / "requirements.txt")], folder / "pip.log",
                         cwd=REPO)

    def result(self, timeout_s: float = 600) -> dict[str, str]:
        """Name -> version of everything it would install, this package aside (waits for pip)."""
        self.wait(timeout_s)
        return {item["metadata"]["name"].lower(): item["metadata"]["version"]
                for item in json.loads(self.report.read_text())["install"]}
