"""Prefect's settings for the embedded default, in the environment before Prefect is imported.

`rlhf pipeline run` with nothing set runs the flow against Prefect's ephemeral API: a server
subprocess on 127.0.0.1 with a SQLite database. Prefect reads its settings once, at import, so
`flows/__init__.py` applies these before any flow module imports Prefect:

- State under the project's state directory (`$RLHF_HOME/prefect`, made owner-only), not
  `~/.prefect`, unless the user configured Prefect (`PREFECT_HOME`, `PREFECT_API_URL`, a
  profile, `./prefect.toml`): their setup wins.
- A startup budget that fits a busy machine. Prefect gives its ephemeral server 20 s; on 2
  cores its start plus a trivial flow took 9-13 s when quiet and 38 s with the cores busy,
  whether or not its database had to be created and migrated (the server's imports dominate),
  so a first run next to other work failed. A server that dies at start is only reported once
  the budget is spent, hence 3 minutes and not more.
- No phoning home: Prefect's server analytics (on every start, an ERROR line when offline) and
  SDK events, and MLflow's usage telemetry. Ray's usage stats are already off under `ray.init`.

A variable the user set is never changed. If Prefect is already imported, this does nothing:
whoever imported it owns its settings (the test harness, a Prefect worker).

Two runs at once on one machine share these SQLite databases (a scheduled run while a manual one
runs). Measured: two `rlhf pipeline run`s started together on a new state directory both
migrated the new MLflow database, and one failed (`table _alembic_tmp_experiments already
exists`); each run's ephemeral Prefect server migrates its database at start the same way.
`prepare_stores` (before the flow starts) therefore creates or upgrades the MLflow store and
creates a missing Prefect database one process at a time, under a file lock next to each
database; a later process finds them current and migrates nothing. The MLflow database stays in
SQLite's rollback-journal mode: in write-ahead-log mode a Ray job did not find the stage run its
flow had just created (tests/integration/test_pipeline.py, after several flows in one process),
so it is not used. Prefect waits up to 60 s for a lock, MLflow (pysqlite) 5 s, ample for their
small transactions.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

STARTUP_TIMEOUT_SECONDS = 180
USER_PREFECT_SETTINGS = ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_PROFILES_PATH", "PREFECT_PROFILE")


def prefect_is_configured(environ: Mapping[str, str], user_home: Path, cwd: Path) -> bool:
    """Has the user set up Prefect themselves (environment, a saved profile, a prefect.toml here)?"""
    return (any(environ.get(name) for name in USER_PREFECT_SETTINGS)
            or (user_home / ".prefect" / "profiles.toml").exists() or (cwd / "prefect.toml").exists())


def embedded_settings(environ: Mapping[str, str], state: Path, user_home: Path, cwd: Path) -> dict[str, str]:
    """The variables to add to `environ` for the embedded default (none that it already has)."""
    settings = {"MLFLOW_DISABLE_TELEMETRY": "true"}
    if "PREFECT_SERVER_ANALYTICS_ENABLED" not in environ:  # a user who turned analytics on keeps the SDK's too
        settings.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    if not prefect_is_configured(environ, user_home, cwd):
        settings["PREFECT_HOME"] = str(state / "prefect")
    if not environ.get("PREFECT_API_URL"):
        settings["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = str(STARTUP_TIMEOUT_SECONDS)
    return {name: value for name, value in settings.items() if name not in environ}


def configure() -> dict[str, str]:
    """Apply `embedded_settings` to this process (its subprocesses inherit them); returns what was set."""
    if "prefect" in sys.modules:
        return {}
    from rlhf_core.infra.settings import state_dir

    settings = embedded_settings(os.environ, state_dir(), Path.home(), Path.cwd())
    if "PREFECT_HOME" in settings:  # Prefect makes only the last folder, so a fresh RLHF_HOME would fail
        Path(settings["PREFECT_HOME"]).mkdir(mode=0o700, parents=True, exist_ok=True)
    os.environ.update(settings)
    return settings


@contextlib.contextmanager
def _exclusive(database: Path) -> Iterator[None]:
    """An exclusive lock beside `database` (released when the block or the process ends)."""
    database.parent.mkdir(parents=True, exist_ok=True)
    with open(database.with_name(database.name + ".rlhf-lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sqlite_path(url: str) -> Path | None:
    """The file of a `sqlite:///...` (any driver) URL; None for other databases and in-memory ones."""
    scheme, sep, rest = url.partition(":///")
    if not sep or not scheme.startswith("sqlite") or ":memory:" in rest or "mode=memory" in rest:
        return None
    return Path(rest.split("?", 1)[0])


def prepare_stores() -> None:
    """Create or upgrade the embedded MLflow store and create a missing Prefect database, one
    process at a time (see the module's doc). Servers (`MLFLOW_TRACKING_URI` other than SQLite,
    Prefect's API URL) are left alone."""
    from rlhf_core.infra.settings import tracking_uri

    uri = tracking_uri()
    mlflow_db = sqlite_path(uri)
    if mlflow_db is not None:
        from mlflow import MlflowClient

        with _exclusive(mlflow_db):
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)  # creates or migrates the schema
    from prefect.settings import get_current_settings

    settings = get_current_settings()
    url = settings.server.database.connection_url
    prefect_db = None if settings.api.url or url is None else sqlite_path(url.get_secret_value())
    if prefect_db is not None and not prefect_db.exists():
        import asyncio

        from prefect.server.database import provide_database_interface

        with _exclusive(prefect_db):
            if not prefect_db.exists():
                asyncio.run(provide_database_interface().create_db())  # what the server runs at start
