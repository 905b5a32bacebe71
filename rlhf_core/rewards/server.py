"""A reward source behind OpenRLHF's HTTP API, with a bearer token.

`POST /get_reward` `{"query", "prompts", "labels"}` -> `{"rewards", "scores", "extra_logs"}`, with
`Authorization: Bearer <token>` (401 otherwise, constant-time compare); `GET /health` needs no
token. The token is the `token` argument, else RLHF_RM_TOKEN, else a new one written to a 0600 file
(`--token_file`) whose path, never the token, is printed. A bad body is a 400 with the reason, a
failing source a 500. Only request lines are logged, never headers.

`ThreadingHTTPServer`, not FastAPI + uvicorn: uvicorn is not our dependency, scoring is synchronous
torch work behind a lock (one model, one device), and a plain server runs in a test thread.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import sys
import threading
import urllib.parse
from http.server import ThreadingHTTPServer
from pathlib import Path

from rlhf_core.infra.json_http import BearerJsonHandler
from rlhf_core.rewards.base import RewardError, as_reward_output
from rlhf_core.rewards.remote import TOKEN_ENV

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 256 * 2**20
TOKEN_FILE_NAME = "rm_token"


def write_token_file(path: str | Path | None = None) -> tuple[str, Path]:
    """A new token written to `path` (default `<state dir>/rm_token`) readable by the user only."""
    if path is None:
        from rlhf_core.infra.settings import state_dir

        path = state_dir() / TOKEN_FILE_NAME
    path = Path(path).expanduser().resolve()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a killed run with our pid; O_EXCL then never follows a link
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)  # never a moment where the file exists with other permissions
    return token, path


class RewardServer:
    """An HTTP server around a batched reward source; `serve_forever()` or `start()` (a thread)."""

    def __init__(self, source, host: str = "127.0.0.1", port: int = 0, *, token: str,
                 token_path: Path | None = None):
        if not token:
            raise ValueError("the reward server needs a token")
        self.source, self.token_path = source, token_path
        self._lock = threading.Lock()
        server_cls = _IPv6Server if ":" in host else ThreadingHTTPServer
        self.httpd = server_cls((host, port), _handler(self, token.encode()))
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/get_reward"

    def __repr__(self) -> str:
        return f"RewardServer({self.url!r}, source={self.source!r})"

    def score(self, queries: list[str], prompts: list[str], labels: list) -> dict:
        with self._lock:
            out = self.source(queries, prompts, labels)
        out = as_reward_output(out, len(queries), repr(self.source))
        return {"rewards": out.rewards.tolist(), "scores": out.scores.tolist(),
                "extra_logs": {k: v.tolist() for k, v in out.extra_logs.items()}}

    def serve_forever(self) -> None:
        self.httpd.serve_forever(poll_interval=0.2)

    def start(self) -> RewardServer:
        self._thread = threading.Thread(target=self.serve_forever, name="reward-server", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


class _BadRequest(ValueError):
    pass


def _parse_request(body: bytes) -> tuple[list[str], list[str], list]:
    try:
        data = json.loads(body)
    except ValueError as e:
        raise _BadRequest(f"the body is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise _BadRequest('expected a JSON object {"query": [...], "prompts": [...], "labels": [...]}')
    missing = [k for k in ("query", "prompts", "labels") if k not in data]
    if missing:
        raise _BadRequest(f"missing key(s) {', '.join(missing)}: expected query, prompts and labels")
    queries, prompts, labels = data["query"], data["prompts"], data["labels"]
    for name, col in (("query", queries), ("prompts", prompts), ("labels", labels)):
        if not isinstance(col, list):
            raise _BadRequest(f"{name} must be a list, got {type(col).__name__}")
    for name, col in (("query", queries), ("prompts", prompts)):
        bad = next((i for i, v in enumerate(col) if not isinstance(v, str)), None)
        if bad is not None:
            raise _BadRequest(f"{name}[{bad}] must be a string")
    if not len(queries) == len(prompts) == len(labels):
        raise _BadRequest(f"{len(queries)} queries, {len(prompts)} prompts and {len(labels)} labels: "
                          "one of each per sample")
    return queries, prompts, labels


def _handler(server: RewardServer, token: bytes):
    class Handler(BearerJsonHandler):
        server_version = "rlhf-reward"
        max_body_bytes = MAX_BODY_BYTES

        def do_GET(self):
            if urllib.parse.urlsplit(self.path).path == "/health":
                return self.reply(200, {"status": "ok"})
            self.reply(404, {"error": "not found: POST /get_reward"})

        def do_POST(self):
            length = self.read_length()
            if length is None:
                return None
            if urllib.parse.urlsplit(self.path).path != "/get_reward":
                self.drain(length)
                return self.reply(404, {"error": "not found: POST /get_reward"}, close=True)
            if not self.authorized():
                self.drain(length)
                return self.reply(401, {"error": "missing or wrong bearer token: send Authorization: Bearer "
                                        "<token> (clients read it from RLHF_RM_TOKEN)"}, close=True,
                                  extra={"WWW-Authenticate": 'Bearer realm="rlhf-reward"'})
            body = self.rfile.read(length)
            try:
                queries, prompts, labels = _parse_request(body)
            except _BadRequest as e:
                return self.reply(400, {"error": str(e)})
            try:
                result = server.score(queries, prompts, labels)
            except RewardError as e:
                return self.reply(500, {"error": str(e)})
            except Exception as e:
                log.exception("reward source failed")
                return self.reply(500, {"error": f"{type(e).__name__}: {e}"})
            self.reply(200, result)

    Handler.token = token
    return Handler


def serve_reward(source, host: str = "127.0.0.1", port: int = 0, token: str | None = None, *,
                 token_file: str | Path | None = None, background: bool = False, announce=None) -> RewardServer:
    """Serve `source` on host:port (0: a free port). `background=True` returns a started server
    (a daemon thread); otherwise call `serve_forever()` on it. The token: `token`, else
    RLHF_RM_TOKEN, else a new one written to `token_file` (default `<state dir>/rm_token`), 0600,
    whose path is announced (`announce`, default a line on stderr)."""
    announce = announce or (lambda line: print(line, file=sys.stderr, flush=True))
    token_path = None
    token = token or os.environ.get(TOKEN_ENV, "").strip() or None
    if token is None:
        token, token_path = write_token_file(token_file)
        announce(f"reward server token written to {token_path} (mode 0600); clients: "
                 f"export RLHF_RM_TOKEN_FILE={token_path}")
    server = RewardServer(source, host, port, token=token, token_path=token_path)
    if host not in ("127.0.0.1", "localhost", "::1"):
        announce(f"note: {host} is reachable from other machines over plain HTTP: the bearer token travels "
                 "unencrypted (put TLS in front, or keep to 127.0.0.1 and an SSH tunnel)")
    return server.start() if background else server
