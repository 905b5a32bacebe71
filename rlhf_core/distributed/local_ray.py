"""The local Ray a run starts when RAY_ADDRESS is unset: on 127.0.0.1, token authentication on.

What each step guards (docs/reliability.md: "Security: what a run opens", "Two runs at once on
one machine"):

- Loopback. Ray's services listen on the address the node advertises, and on Linux Ray replaces a
  loopback one with the machine's unless its cluster mode (named for Windows/macOS) is off; so it
  is off while `ray.init` starts the node's processes, which keep it.
- Token authentication (RAY_AUTH_MODE=token) unless the user chose a mode; one who disabled it
  gets a warning. The token is written before Ray starts, owner-only (Ray's own would be 0644),
  and appears whole (written aside, then linked), so a run starting beside it never reads it empty.
- Two clusters on one machine. `ray.init` fixes the dashboard agent's port (the Jobs API) at
  52365, so a second cluster's agent could not bind; Ray's node parameters accept 0 (a free port)
  but `ray.init` has no option for it, so they are patched while it starts
  (`_agent_port_chosen_at_start`; checked against Ray 2.60, the version the project pins). Each
  cluster also gets a temp dir of its own (`/tmp/rlhf-ray-<pid>`) holding its address in
  `ray_current_cluster` (written here; `ray.init` does not): without it the job supervisor hands a
  job's driver whichever Ray it finds on the machine. Temp dirs of ended clusters are removed
  but the newest three (`remove_stale_temp_dirs`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from collections.abc import Iterator, MutableMapping
from pathlib import Path

LOOPBACK = "127.0.0.1"
AUTH_MODE = "RAY_AUTH_MODE"
CLUSTER_MODE = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # off: Ray's node address may be loopback


def default_token_path(home: Path | None = None) -> Path:
    """Where Ray looks for its token when neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is set."""
    return (home or Path.home()) / ".ray" / "auth_token"


def write_token(path: Path) -> None:
    """A new random token (Ray's format: 64 hex digits) readable by its owner only; keeps an existing one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.exists():
        return
    aside = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        os.link(aside, path)  # appears complete or not at all; fails when another process made it first
    except FileExistsError:
        pass
    finally:
        aside.unlink(missing_ok=True)


def prepare_auth(environ: MutableMapping[str, str] = os.environ, home: Path | None = None) -> str | None:
    """Token authentication on (unless the user chose a mode) with a token in place.

    Returns a warning for the user, or None. Mirrors Ray's token lookup: RAY_AUTH_TOKEN, then
    RAY_AUTH_TOKEN_PATH (Ray itself reports a file that is missing there), then ~/.ray/auth_token.
    """
    mode = environ.get(AUTH_MODE)
    if mode is None:
        environ[AUTH_MODE] = "token"
    elif mode.strip().lower() != "token":
        return (f"{AUTH_MODE}={mode}: the local Ray started for this run accepts requests without a token, so "
                "any user or program on this machine can run code as you through it. Unset "
                f"{AUTH_MODE} to keep token authentication on.")
    if environ.get("RAY_AUTH_TOKEN") or environ.get("RAY_AUTH_TOKEN_PATH"):
        return None
    path = default_token_path(home)
    if not path.exists():
        write_token(path)
        return None
    mode_bits = path.stat().st_mode & 0o777
    if mode_bits & 0o077:
        return (f"Ray's auth token {path} can be read by other users of this machine (mode {mode_bits:o}), "
                f"and with it run code as you through this run's Ray: chmod 600 {path}")
    return None


def reread_ray_config() -> None:
    """Ray read RAY_AUTH_MODE when it was imported; re-read it (as Ray does when it turns auth on)."""
    from ray._raylet import Config

    Config.initialize("")


@contextlib.contextmanager
def _agent_port_chosen_at_start() -> Iterator[None]:
    """While `ray.init` starts a node here: its dashboard agent binds a free port instead of 52365."""
    from ray._private import parameter

    fixed = parameter.RayParams

    class RayParams(fixed):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("dashboard_agent_listen_port", 0)  # 0: the agent binds a free port
            super().__init__(*args, **kwargs)

    parameter.RayParams = RayParams
    try:
        yield
    finally:
        parameter.RayParams = fixed


def own_temp_dir() -> str:
    """A Ray temp dir for this process's clusters (short: Ray's socket paths live under it)."""
    from ray._common.utils import get_default_system_temp_dir

    return os.path.join(get_default_system_temp_dir(), f"rlhf-ray-{os.getpid()}")


KEEP_OLD_TEMP_DIRS = 3  # the newest temp dirs of ended clusters stay, with their logs, for a post-mortem


def remove_stale_temp_dirs(parent: str | None = None, keep: int = KEEP_OLD_TEMP_DIRS) -> list[str]:
    """Remove the `rlhf-ray-<pid>` temp dirs (under `parent`, the system temp dir) of clusters that
    ended, but the newest `keep`; returns what it removed. Each run leaves one (~5 MB of session
    logs), so a scheduled pipeline would fill /tmp. Only a folder of this user, so named, holding
    a Ray session (`session_*`), whose process is gone, is removed; anything else is not ours."""
    import shutil

    from rlhf_core.infra.owner import start_time  # None: no such process

    if parent is None:
        from ray._common.utils import get_default_system_temp_dir

        parent = get_default_system_temp_dir()
    if not hasattr(os, "getuid"):  # no owner to compare with: leave every folder alone
        return []
    ended = []
    for entry in Path(parent).glob("rlhf-ray-*"):
        pid = entry.name.removeprefix("rlhf-ray-")
        try:
            info = entry.lstat()
        except OSError:
            continue
        if not pid.isdigit() or not entry.is_dir() or entry.is_symlink() or info.st_uid != os.getuid():
            continue
        if not any(child.name.startswith("session_") for child in entry.iterdir()) or start_time(int(pid)) is not None:
            continue
        ended.append((info.st_mtime, entry))
    removed = []
    for _, entry in sorted(ended, reverse=True)[keep:]:
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(str(entry))
    return removed


def init_local(**kwargs):
    """`ray.init` a new single-node cluster on 127.0.0.1 with token authentication; returns its context."""
    import ray
    from ray._private import ray_constants

    warning = prepare_auth()
    if warning:
        print(f"rlhf: warning: {warning}", file=sys.stderr, flush=True)
    reread_ray_config()
    saved_env, saved_constant = os.environ.get(CLUSTER_MODE), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[CLUSTER_MODE] = "0"  # the node's processes, started by ray.init, inherit it
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported Ray before the variable was set
    temp_dir = kwargs.pop("_temp_dir", None) or own_temp_dir()
    remove_stale_temp_dirs(str(Path(temp_dir).parent))
    from ray._common.utils import reset_ray_address

    reset_ray_address(temp_dir)  # a cluster this process started earlier: ray.init would try to join it
    try:
        with _agent_port_chosen_at_start():
            context = ray.init(_node_ip_address=LOOPBACK, _temp_dir=temp_dir, **kwargs)
        # The job supervisor resolves the address it hands a job's driver from this file in the
        # cluster's temp dir; without it, from whichever Ray it finds running on the machine.
        from ray._private.utils import write_ray_address

        write_ray_address(context.address_info["gcs_address"], temp_dir)
        return context
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_constant
        if saved_env is None:
            os.environ.pop(CLUSTER_MODE, None)
        else:
            os.environ[CLUSTER_MODE] = saved_env
