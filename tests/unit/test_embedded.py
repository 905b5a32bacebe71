"""The embedded default's settings: Prefect's state, startup budget and telemetry (flows/embedded.py),
and the local Ray's address and token authentication (rlhf_core/distributed/local_ray.py), without starting Ray."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import rlhf_core
from rlhf_core.distributed import local_ray

ROOT = str(Path(rlhf_core.__file__).resolve().parents[1])


def embedded():
    """flows.embedded, imported in a test: importing `flows` applies it, so not before RLHF_HOME is the session's."""
    from flows import embedded

    return embedded


def embedded_settings(*args):
    return embedded().embedded_settings(*args)


@pytest.fixture
def places(tmp_path):
    home, cwd, state = tmp_path / "home", tmp_path / "cwd", tmp_path / "cwd" / ".rlhf"
    home.mkdir()
    cwd.mkdir()
    return home, cwd, state


def test_embedded_default_keeps_prefect_state_here_waits_for_a_cold_start_and_sends_nothing(places):
    home, cwd, state = places
    assert embedded_settings({}, state, home, cwd) == {
        "PREFECT_HOME": str(state / "prefect"),
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": str(embedded().STARTUP_TIMEOUT_SECONDS),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
        "MLFLOW_DISABLE_TELEMETRY": "true",
    }


@pytest.mark.parametrize("setting", ["PREFECT_HOME", "PREFECT_API_URL", "PREFECT_PROFILES_PATH", "PREFECT_PROFILE"])
def test_a_user_who_configured_prefect_keeps_their_prefect_home(places, setting):
    home, cwd, state = places
    added = embedded_settings({setting: "x"}, state, home, cwd)
    assert "PREFECT_HOME" not in added
    assert ("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS" in added) == (setting != "PREFECT_API_URL")


@pytest.mark.parametrize("config_file", ["home/.prefect/profiles.toml", "cwd/prefect.toml"])
def test_a_saved_prefect_profile_or_prefect_toml_keeps_prefect_home(places, config_file):
    home, cwd, state = places
    path = home.parent / config_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('active = "default"\n')
    assert "PREFECT_HOME" not in embedded_settings({}, state, home, cwd)


def test_explicit_settings_are_never_overridden(places):
    home, cwd, state = places
    user = {"PREFECT_SERVER_ANALYTICS_ENABLED": "true", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "5",
            "MLFLOW_DISABLE_TELEMETRY": "false"}
    added = embedded_settings(user, state, home, cwd)
    assert not set(added) & set(user)
    assert "DO_NOT_TRACK" not in added, "a user who turned Prefect's analytics on keeps its SDK events too"
    assert embedded_settings({"DO_NOT_TRACK": "0"}, state, home, cwd).get("DO_NOT_TRACK") is None


def _prefect_settings_after_importing_the_flow(cwd: Path, home: Path, **env) -> dict:
    """What Prefect runs with when a fresh process imports the flow (as `rlhf pipeline run` does)."""
    code = ("import json, flows.pipeline\n"
            "from prefect.settings import get_current_settings\n"
            "s = get_current_settings()\n"
            "print(json.dumps({'home': str(s.home), 'analytics': s.server.analytics_enabled,\n"
            "                  'timeout': s.server.ephemeral.startup_timeout_seconds}))\n")
    clean = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": ROOT, **env}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=clean, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_flow_module_sets_up_prefect_before_importing_it(places):
    home, cwd, state = places
    settings = _prefect_settings_after_importing_the_flow(cwd, home)
    assert settings == {"home": str(state / "prefect"), "analytics": False, "timeout": embedded().STARTUP_TIMEOUT_SECONDS}
    assert (state / "prefect").stat().st_mode & 0o777 == 0o700
    assert not (home / ".prefect").exists()

    theirs = home / "their-prefect"
    settings = _prefect_settings_after_importing_the_flow(cwd, home, PREFECT_HOME=str(theirs),
                                                          PREFECT_SERVER_ANALYTICS_ENABLED="true")
    assert settings["home"] == str(theirs) and settings["analytics"] is True


def test_a_first_run_fills_the_new_prefect_database_with_its_block_schemas_before_any_server_starts(places):
    """Two first runs at once start two ephemeral servers on one new database; each server registers
    Prefect's block schemas at start, and two inserting the same rows log tracebacks. `prepare_stores`
    (under its lock) leaves the server only rows to find: the block types and schemas are there before
    a server could start."""
    home, cwd, state = places
    code = ("import flows, sqlite3\n"
            "from flows.embedded import prepare_stores\n"
            "prepare_stores()\n"
            "from prefect.settings import get_current_settings\n"
            "db = sqlite3.connect(str(get_current_settings().home / 'prefect.db'))\n"
            "print(*(db.execute(f'select count(*) from {t}').fetchone()[0] for t in ('block_type', 'block_schema')))\n")
    clean = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": ROOT}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=clean, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stderr
    types, schemas = map(int, done.stdout.split()[-2:])
    assert types >= 10 and schemas >= types, done.stdout


def test_prefect_ui_hint_names_the_embedded_database_or_the_server(monkeypatch):
    from flows.cli import prefect_ui_hint

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.setenv("PREFECT_HOME", "/state dir/prefect")
    hint = prefect_ui_hint()
    port = re.search(r"PREFECT_SERVER_API_PORT=(\d+) PREFECT_SERVER_UI_V2_ENABLED=true prefect server start  "
                     r"\(then open http://127.0.0.1:(\d+)\)$", hint)
    assert hint.startswith("PREFECT_HOME='/state dir/prefect' ") and port, hint
    assert port.group(1) == port.group(2), "the UI is opened where the server's API port setting puts it"
    with socket.socket() as taken:  # 4200 taken (another Prefect server): the hint names a free port
        taken.bind(("127.0.0.1", int(port.group(1))))
        other = re.search(r"PREFECT_SERVER_API_PORT=(\d+)", prefect_ui_hint()).group(1)
        assert int(other) != int(port.group(1))
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4242/api")
    assert prefect_ui_hint() == "http://127.0.0.1:4242"


# ---------------------------------------------------------------------------------------------
# The local Ray: token authentication and its token


def test_token_auth_is_turned_on_and_a_missing_token_is_made_owner_only(tmp_path):
    environ: dict[str, str] = {}
    assert local_ray.prepare_auth(environ, tmp_path) is None
    assert environ["RAY_AUTH_MODE"] == "token"
    token = tmp_path / ".ray" / "auth_token"
    assert token.stat().st_mode & 0o777 == 0o600 and (tmp_path / ".ray").stat().st_mode & 0o777 == 0o700
    text = token.read_text()
    assert len(text) == 64 and int(text, 16) >= 0

    assert local_ray.prepare_auth(environ, tmp_path) is None
    assert token.read_text() == text, "an existing token is kept"


def test_a_token_other_users_can_read_is_reported_not_changed(tmp_path):
    token = tmp_path / ".ray" / "auth_token"
    token.parent.mkdir()
    token.write_text("f" * 64)
    token.chmod(0o644)
    warning = local_ray.prepare_auth({}, tmp_path)
    assert warning and str(token) in warning and f"chmod 600 {token}" in warning and "644" in warning
    assert token.stat().st_mode & 0o777 == 0o644 and token.read_text() == "f" * 64


def test_a_token_from_the_environment_is_used_as_is(tmp_path):
    for environ in ({"RAY_AUTH_TOKEN": "secret"}, {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "mine")}):
        assert local_ray.prepare_auth(environ, tmp_path) is None
        assert environ["RAY_AUTH_MODE"] == "token"
    assert not (tmp_path / ".ray").exists()


@pytest.mark.parametrize("mode", ["disabled", "DISABLED"])
def test_auth_the_user_disabled_stays_disabled_with_a_warning(tmp_path, mode):
    environ = {"RAY_AUTH_MODE": mode}
    warning = local_ray.prepare_auth(environ, tmp_path)
    assert warning and f"RAY_AUTH_MODE={mode}" in warning and "Unset RAY_AUTH_MODE" in warning
    assert environ == {"RAY_AUTH_MODE": mode} and not (tmp_path / ".ray").exists()
    assert local_ray.prepare_auth({"RAY_AUTH_MODE": "token"}, tmp_path) is None


class Context:
    address_info = {"gcs_address": "127.0.0.1:6379"}


def test_init_local_starts_ray_on_loopback_and_restores_the_cluster_switch(tmp_path, monkeypatch, capsys):
    """Ray resolves a loopback node address to the machine's unless its cluster mode is off; the
    switch is on only while ray.init starts the node's processes (they inherit it)."""
    import ray
    from ray._private import ray_constants

    seen = {}

    def fake_init(**kwargs):
        seen.update(kwargs=kwargs, env=os.environ.get(local_ray.CLUSTER_MODE),
                    constant=ray_constants.ENABLE_RAY_CLUSTER, auth=os.environ.get("RAY_AUTH_MODE"),
                    stale=Path(kwargs["_temp_dir"], "ray_current_cluster").exists())
        return Context()

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(local_ray, "reread_ray_config", lambda: seen.setdefault("config_reread", True))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(local_ray.CLUSTER_MODE, raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    constant = ray_constants.ENABLE_RAY_CLUSTER

    temp_dir = tmp_path / "ray-temp"
    temp_dir.mkdir()
    (temp_dir / "ray_current_cluster").write_text("127.0.0.1:1")  # a cluster started and stopped before
    assert isinstance(local_ray.init_local(num_cpus=1, _temp_dir=str(temp_dir)), Context)
    assert seen["kwargs"] == {"_node_ip_address": "127.0.0.1", "num_cpus": 1, "_temp_dir": str(temp_dir)}
    # The cluster's own address where its job supervisor looks for it (else: any Ray on the machine).
    assert (temp_dir / "ray_current_cluster").read_text() == "127.0.0.1:6379"
    assert seen["env"] == "0" and seen["constant"] is False and seen["config_reread"]
    assert seen["stale"] is False, "ray.init would join the stopped cluster the file names"
    assert local_ray.CLUSTER_MODE not in os.environ and ray_constants.ENABLE_RAY_CLUSTER is constant
    err = capsys.readouterr().err
    assert err.count("rlhf: warning: RAY_AUTH_MODE=disabled") == 1, err

    monkeypatch.delenv("RAY_AUTH_MODE")
    local_ray.init_local(_temp_dir=str(temp_dir))
    assert seen["auth"] == "token" and (tmp_path / ".ray" / "auth_token").exists()
    assert "warning" not in capsys.readouterr().err


def test_init_local_has_the_job_agent_bind_a_free_port_only_while_ray_starts(monkeypatch, tmp_path):
    """Ray fixes its job agent's port at 52365, so a second local Ray on the machine could run no job:
    the node `ray.init` builds gets 0 there (a free port), and Ray's own default is back afterwards."""
    import ray
    from ray._private import parameter

    seen = {}

    def fake_init(**kwargs):
        seen["port"] = parameter.RayParams().dashboard_agent_listen_port
        seen["explicit"] = parameter.RayParams(dashboard_agent_listen_port=1234).dashboard_agent_listen_port
        seen["temp_dir"] = kwargs["_temp_dir"]
        return Context()

    monkeypatch.setattr(ray, "init", fake_init)
    monkeypatch.setattr(local_ray, "reread_ray_config", lambda: None)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(local_ray, "own_temp_dir", lambda: str(tmp_path))
    local_ray.init_local()
    assert seen == {"port": 0, "explicit": 1234, "temp_dir": str(tmp_path)}
    assert parameter.RayParams().dashboard_agent_listen_port == 52365, "Ray's default is restored"
    assert [p.name for p in (tmp_path / ".ray").iterdir()] == ["auth_token"], "no token written aside is left"


@pytest.mark.parametrize("url, path", [
    ("sqlite:////abs/.rlhf/mlflow.db", "/abs/.rlhf/mlflow.db"),
    ("sqlite+aiosqlite:////abs/prefect/prefect.db?timeout=5", "/abs/prefect/prefect.db"),
    ("sqlite+aiosqlite:///file::memory:?cache=shared&uri=true", None),
    ("postgresql+asyncpg://user@host/db", None),
    ("http://127.0.0.1:5000", None),
])
def test_the_sqlite_file_behind_a_store_url(url, path):
    found = embedded().sqlite_path(url)
    assert (str(found) if found else None) == path
