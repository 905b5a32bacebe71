"""Prefect's settings for the embedded default, in the environment before Prefect is imported.

`rlhf pipeline run` with nothing set uses Prefect's ephemeral API (a server subprocess on
127.0.0.1, SQLite). Prefect reads settings once, at import, so `flows/__init__.py` applies these first:

- State in `$RLHF_HOME/prefect` (owner-only), unless the user configured Prefect (`PREFECT_HOME`,
  `PREFECT_API_URL`, a profile, `./prefect.toml`).
- A 3-minute startup budget: Prefect's 20 s is too short on a busy machine (benchmarks/README.md),
  and a server that dies at start is reported only once the budget is spent.
- No phoning home: Prefect's analytics and SDK events, MLflow's telemetry off.

A variable the user set is never changed; if Prefect is already imported, nothing is done.

Concurrent runs share these SQLite databases, and two runs migrating a new MLflow database at once
fail (`table _alembic_tmp_experiments already exists`), and two ephemeral Prefect servers registering
their block schemas in a new database at once log `Failed to register block schema` tracebacks. So
`prepare_stores` creates or upgrades them, block schemas included, one process at a time under a file lock. The MLflow database stays in rollback-journal mode:
under WAL a Ray job did not see the stage run its flow had just created
(tests/integration/test_pipeline.py).
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
    """Apply `embedded_settings` to this process (its subprocesses inherit them); returns what was set.
    Only the environment: nothing is written (every `rlhf` command imports this package to build its
    parser, `--dry_run` too); `make_prefect_home` creates the folder before Prefect first needs it."""
    if "prefect" in sys.modules:
        return {}
    from rlhf_core.infra.settings import state_dir

    settings = embedded_settings(os.environ, state_dir(), Path.home(), Path.cwd())
    os.environ.update(settings)
    _CONFIGURED.update(settings)
    return settings


_CONFIGURED: dict[str, str] = {}


def make_prefect_home() -> None:
    """Create the embedded default's Prefect home (owner-only) if `configure` set one: Prefect makes
    only the last folder, so a fresh RLHF_HOME would fail. Called before Prefect starts a server
    (`prepare_stores`) and when the flow module is imported."""
    home = _CONFIGURED.get("PREFECT_HOME")
    if home and os.environ.get("PREFECT_HOME") == home:
        Path(home).mkdir(mode=0o700, parents=True, exist_ok=True)


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
    process at a time (module docstring). Servers are left alone."""
    from rlhf_core.infra.settings import tracking_uri

    make_prefect_home()
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
    if prefect_db is not None:  # the lock even when the file exists: another run may be filling it now
        import asyncio

        from prefect.server.database import provide_database_interface

        with _exclusive(prefect_db):
            if not prefect_db.exists():
                asyncio.run(_create_prefect_database(provide_database_interface()))


async def _create_prefect_database(db) -> None:
    """What an ephemeral server runs at its first start: the schema, then the block types and schemas.
    Two servers starting on one new database at once both insert the same block schemas, and one logs
    `Failed to register block schema` tracebacks; with the rows in place, each server's registration
    only finds and updates them."""
    import prefect.plugins
    from prefect.server.models.block_registration import run_block_auto_registration

    await db.create_db()
    prefect.plugins.load_prefect_collections()  # the collections' blocks too, as the server registers them
    async with await db.session() as session:
        await run_block_auto_registration(session=session)
