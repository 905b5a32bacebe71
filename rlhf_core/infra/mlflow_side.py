"""MLflow in a process of its own, beside the `rlhf` command's stage.

On a small machine a stage's start is mostly imports, one after the other: torch, transformers,
DeepSpeed, and MLflow with its SQLAlchemy store, then the run to open, its params and datasets to
send. The MLflow part (about 1 s on a 2-core AMD EPYC, Zen 4 class; benchmarks/README.md, "Start-up") needs nothing
the stage computes, so the `rlhf` command starts this process first thing (`start()`): it imports
MLflow on another core while the stage imports torch, and the stage's `Tracker` sends its calls here
(`SideOps`, the calls of `mlflow_ops.DirectOps` in plain data) instead of importing MLflow itself.

Only the command's own process uses it (`rlhf_core.cli.entry`); a stage run in-process (tests, the
flows) or on Ray ranks keeps MLflow in its process. `RLHF_MLFLOW_IN_PROCESS=1` turns it off.

The Tracker's rules are unchanged: it retries, bounds and classifies as before. A call that could
not reach the store comes back as `StoreFailure` (an OSError, so retried like a connection error),
the store's own refusal as `StoreAnswer` with its error code (never retried), anything else as
`SideError` with the side's traceback. If the process is gone, every call is a `StoreFailure`
that says so (a stage then fails after its store bound, as with a store that went away). The
process ends when the command's end of the socket closes (the command exited or was killed); it
runs in a session of its own, so the signals that stop the command (a Ctrl-C, a job stop) leave it
to record the run's end.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import traceback

OPT_OUT = "RLHF_MLFLOW_IN_PROCESS"


class StoreFailure(OSError):
    """The side process could not reach or hear the store, or is gone: retried like a connection error."""


class StoreAnswer(RuntimeError):
    """The store answered, and said no (`error_code`, e.g. RESOURCE_DOES_NOT_EXIST): never retried."""

    def __init__(self, error_code: str, message: str):
        super().__init__(message)
        self.error_code = error_code


class SideError(RuntimeError):
    """A call failed in the side process for a reason of its own (the message holds its traceback)."""


class Side:
    """The running side process and the command's end of its socket; one call at a time."""

    def __init__(self, proc: subprocess.Popen, conn):
        self.proc, self.conn = proc, conn
        self.lock = threading.Lock()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, handle: int | None, op: str, *args, **kwargs):
        with self.lock:
            try:
                self.conn.send((handle, op, args, kwargs))
                reply = self.conn.recv()
            except (EOFError, OSError):
                code = self.proc.poll()
                raise StoreFailure(f"the MLflow process (pid {self.proc.pid}) is gone"
                                   + (f" (exit code {code})" if code is not None else "")) from None
        kind, *rest = reply
        if kind == "ok":
            return rest[0]
        if kind == "store":
            raise StoreFailure(rest[0])
        if kind == "answer":
            raise StoreAnswer(*rest)
        raise SideError(rest[0])


class SideOps:
    """`mlflow_ops.DirectOps`' calls, run in the side process."""

    def __init__(self, side: Side, handle: int):
        self._side, self._handle = side, handle

    def _call(self, op: str, *args, **kwargs):
        return self._side.call(self._handle, op, *args, **kwargs)

    def open_run(self, experiment, run_name, tags, given, request, owner) -> str:
        return self._call("open_run", experiment, run_name, tags, given, request, owner)

    def log_batch(self, run_id, metrics=(), params=(), tags=()) -> None:
        self._call("log_batch", run_id, metrics=list(metrics), params=list(params), tags=list(tags))

    def run_status(self, run_id) -> str:
        return self._call("run_status", run_id)

    def set_terminated(self, run_id, status) -> None:
        self._call("set_terminated", run_id, status)

    def log_artifact(self, run_id, path) -> None:
        self._call("log_artifact", run_id, os.path.abspath(path))  # the side's working directory may differ

    def log_text(self, run_id, text, name) -> None:
        self._call("log_text", run_id, text, name)

    def log_inputs(self, run_id, inputs) -> None:
        self._call("log_inputs", run_id, inputs)


_side: Side | None = None


def start() -> None:
    """Start the side process, once per process (the `rlhf` command, before its heavy imports)."""
    global _side
    if _side is not None or os.environ.get(OPT_OUT) == "1":
        return
    from multiprocessing.connection import Connection

    ours, theirs = socket.socketpair()
    try:
        proc = subprocess.Popen([sys.executable, "-m", "rlhf_core.infra.mlflow_side", str(theirs.fileno()),
                                 json.dumps(sys.argv)],
                                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=2,
                                # out of the command's process group: a Ctrl-C or a job stop signals the
                                # command, which then marks its run FAILED through this process
                                start_new_session=True)
    except OSError as e:
        ours.close()
        print(f"rlhf: MLflow runs in this process (its own process did not start: {e})", file=sys.stderr)
        return
    finally:
        theirs.close()
    _side = Side(proc, Connection(ours.detach()))


def ops_for(uri: str) -> SideOps | None:
    """The side process's calls on the store at `uri`, with this process's environment (credentials,
    request bounds) and command line (MLflow's source tags); None when no side process runs here."""
    global _side
    if _side is None:
        return None
    if not _side.alive():
        print(f"rlhf: MLflow runs in this process (its own process ended with exit code {_side.proc.returncode})",
              file=sys.stderr)
        _side = None
        return None
    return SideOps(_side, _side.call(None, "connect", dict(os.environ), list(sys.argv), uri))


# -- the side process ------------------------------------------------------------------------

def _reply(error: Exception) -> tuple:
    from rlhf_core.infra.reachability import is_store_failure
    from rlhf_core.infra.redaction import redact_text

    text = redact_text(f"{type(error).__name__}: {error}")
    if is_store_failure(error):
        return ("store", text)
    code = getattr(error, "error_code", None)
    if isinstance(code, str):
        return ("answer", code, f"{text} ({code})")
    return ("error", redact_text(traceback.format_exc()))


def serve(fd: int, argv: list[str]) -> None:
    """Answer the command's calls until it closes its end. First, what its first call would wait
    for: MLflow's imports, the embedded database's store and its first query, the run's source
    tags (git's too)."""
    import signal
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # it ends when the command has made its last call
    conn = Connection(fd)
    sys.argv = argv  # the command's: MLflow names a run's source after it
    from mlflow.tracking.context.registry import resolve_tags

    from rlhf_core.infra.mlflow_ops import DirectOps
    from rlhf_core.infra.reachability import bound_mlflow_requests, is_server
    from rlhf_core.infra.settings import tracking_uri

    try:
        if not is_server(tracking_uri()):
            # SQLAlchemy's store and schema check (cached by MLflow per URI), and its ORM's set-up at
            # the first query (a read: nothing is written before the stage asks)
            DirectOps(tracking_uri()).client.get_experiment_by_name("Default")
        resolve_tags({})  # its context providers' imports and git lookups, cached
    except Exception:  # noqa: BLE001 - the stage's own first call meets the error and reports it
        pass
    from rlhf_core.infra import heap

    heap.own_process()
    heap.settle()  # the libraries' objects: no full collector pass over them during a call
    # (0.14 s for the first on a 2-core AMD EPYC, Zen 4 class)
    ops: dict[int, DirectOps] = {}
    while True:
        try:
            handle, op, args, kwargs = conn.recv()
        except (EOFError, OSError):
            # The command is gone, and every call it made was answered: end without the interpreter's
            # teardown (MLflow's and SQLAlchemy's, a second or more), which would hold the command's
            # stderr open for whoever reads it to its end (a Ray job's log, a pipeline).
            sys.stderr.flush()
            os._exit(0)
        try:
            if op == "connect":
                env, argv, uri = args
                os.environ.clear()
                os.environ.update(env)
                sys.argv = argv
                bound_mlflow_requests()
                ops[len(ops)] = DirectOps(uri)
                reply: tuple = ("ok", len(ops) - 1)
            else:
                reply = ("ok", getattr(ops[handle], op)(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - every failure goes back to the caller, classified
            reply = _reply(e)
        conn.send(reply)


if __name__ == "__main__":
    serve(int(sys.argv[1]), json.loads(sys.argv[2]))
