"""Client of a remote reward server (`--reward.remote_url http://HOST:PORT/get_reward`).

`RemoteReward` posts OpenRLHF's `{"query", "prompts", "labels"}` and checks the answer with
errors naming the URL. The batch goes whole or in `chunk_size` chunks, shared round-robin and in
parallel by several comma-separated URLs. Connection errors, timeouts and 5xx are retried with
backoff; a 4xx is not.

The bearer token is never stored: each request reads `RLHF_RM_TOKEN` (else the file
`RLHF_RM_TOKEN_FILE` names), so no config, repr, log or error holds it. Ray ranks get it without
it entering an entrypoint or runtime_env: the driver passes `token_for_ranks()`'s redacted
`RankToken` as an actor method argument and the rank `.install()`s it in its own process.
"""

from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import torch

from rlhf_core.rewards.base import RewardError, RewardOutput, as_reward_output, check_batch

TOKEN_ENV = "RLHF_RM_TOKEN"
TOKEN_FILE_ENV = "RLHF_RM_TOKEN_FILE"


def read_token() -> str | None:
    """The client's bearer token, read now: RLHF_RM_TOKEN, else the file RLHF_RM_TOKEN_FILE names."""
    token = os.environ.get(TOKEN_ENV)
    if token:
        return token.strip()
    path = os.environ.get(TOKEN_FILE_ENV)
    if path:
        try:
            return open(os.path.expanduser(path)).read().strip() or None
        except OSError as e:
            raise RewardError(f"{TOKEN_FILE_ENV}={path}: cannot read the reward server token ({e.strerror})") from None
    return None


class RankToken:
    """The token on its way from the driver to a rank as an actor method argument (never a
    runtime_env variable or an entrypoint); its repr and str never show it."""

    __slots__ = ("_value",)

    def __init__(self, value: str):
        self._value = value

    def install(self) -> None:
        """Make it this process's RLHF_RM_TOKEN (the rank's own environment, recorded nowhere)."""
        os.environ[TOKEN_ENV] = self._value

    def __repr__(self) -> str:
        return "RankToken(<redacted>)"

    __str__ = __repr__

    def __getstate__(self):
        return self._value

    def __setstate__(self, value):
        self._value = value


def token_for_ranks() -> RankToken | None:
    """On the driver: the token to hand each rank that calls a remote reward (None without one)."""
    token = read_token()
    return RankToken(token) if token else None


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    # A redirect would carry the Authorization header to wherever it points: refuse it.
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        return None


def _display(url: str) -> str:
    """The URL without any user:password@ part."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _opener(url: str):
    handlers = [_NoRedirects()]
    host = urllib.parse.urlsplit(url).hostname or ""
    if host in ("localhost", "::1") or host.startswith("127."):
        handlers.append(urllib.request.ProxyHandler({}))  # loopback never goes through a proxy
    return urllib.request.build_opener(*handlers)


class _Retryable(Exception):
    pass


class RewardUnavailable(RewardError):
    """The server could not be reached or answered 5xx on every attempt: an infrastructure failure
    (a retry of the stage may succeed), unlike a malformed answer or a 4xx."""


class RemoteReward:
    def __init__(self, url: str | list[str], timeout: float = 180.0, retries: int = 4, backoff: float = 1.0,
                 max_backoff: float = 30.0, chunk_size: int | None = None):
        urls = [u.strip() for u in (url.split(",") if isinstance(url, str) else url) if u.strip()]
        if not urls:
            raise ValueError("RemoteReward needs a URL")
        for u in urls:
            if urllib.parse.urlsplit(u).scheme not in ("http", "https"):
                raise ValueError(f"remote reward URL {_display(u)}: expected http:// or https://")
        if retries < 0 or timeout <= 0 or backoff < 0 or (chunk_size is not None and chunk_size < 1):
            raise ValueError("RemoteReward: timeout > 0, retries >= 0, backoff >= 0 and chunk_size >= 1")
        self.urls, self.timeout, self.retries = urls, float(timeout), int(retries)
        self.backoff, self.max_backoff, self.chunk_size = float(backoff), float(max_backoff), chunk_size
        self._openers = {u: _opener(u) for u in urls}

    def __repr__(self) -> str:
        return (f"RemoteReward({[_display(u) for u in self.urls]!r}, timeout={self.timeout}, "
                f"retries={self.retries}, chunk_size={self.chunk_size})")

    def __call__(self, queries: list[str], prompts: list[str], labels: list, **kwargs) -> RewardOutput:
        n = check_batch(queries, prompts, labels, repr(self))
        if n == 0:
            return RewardOutput(torch.zeros(0))
        size = self.chunk_size or -(-n // len(self.urls))  # one chunk per server by default
        chunks = [(i, min(i + size, n)) for i in range(0, n, size)]
        jobs = [(self.urls[k % len(self.urls)], list(queries[a:b]), list(prompts[a:b]), list(labels[a:b]))
                for k, (a, b) in enumerate(chunks)]
        if len(jobs) == 1:
            outs = [self._post(*jobs[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(len(jobs), len(self.urls))) as pool:
                outs = list(pool.map(lambda job: self._post(*job), jobs))
        return _concat(outs, repr(self))

    def _post(self, url: str, queries: list, prompts: list, labels: list) -> RewardOutput:
        where = f"remote reward {_display(url)}"
        try:
            body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}).encode()
        except (TypeError, ValueError) as e:
            raise RewardError(f"{where}: the batch cannot be sent as JSON ({e})") from None
        failure = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(self.backoff * 2 ** (attempt - 1), self.max_backoff))
            try:
                answer = self._request(url, body, where)
            except _Retryable as e:
                failure = str(e)
                continue
            if not isinstance(answer, dict):
                raise RewardError(f"{where}: expected a JSON object with rewards, scores and extra_logs, "
                                  f"got {type(answer).__name__}")
            return as_reward_output(answer, len(queries), where)
        raise RewardUnavailable(f"{where}: failed {self.retries + 1} times; last: {failure}")

    def _request(self, url: str, body: bytes, where: str):
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        token = read_token()
        if token:
            headers["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(url, data=body, headers=headers, method="POST")
        try:
            with self._openers[url].open(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = _error_detail(e)
            if e.code >= 500:
                raise _Retryable(f"HTTP {e.code}: {detail}") from None
            if e.code == 401:
                hint = ("set RLHF_RM_TOKEN (or RLHF_RM_TOKEN_FILE) to the server's token" if not token
                        else "RLHF_RM_TOKEN is not the server's token")
                raise RewardError(f"{where}: HTTP 401 unauthorized: {hint}") from None
            raise RewardError(f"{where}: HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, http.client.HTTPException, ConnectionError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            if isinstance(reason, TimeoutError):
                raise _Retryable(f"no answer within {self.timeout:g} s") from None
            raise _Retryable(f"{type(reason).__name__}: {reason}") from None
        try:
            return json.loads(raw, parse_constant=_reject_constant)
        except ValueError as e:
            raise RewardError(f"{where}: the answer is not valid JSON ({e})") from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a reward")


def _error_detail(e: urllib.error.HTTPError) -> str:
    try:
        text = e.read(2000).decode(errors="replace")
        return str(json.loads(text).get("error", text))
    except Exception:
        return e.reason if isinstance(e.reason, str) else "error"


def _concat(outs: list[RewardOutput], where: str) -> RewardOutput:
    keys = set(outs[0].extra_logs)
    if any(set(o.extra_logs) != keys for o in outs):
        raise RewardError(f"{where}: the chunks' answers log different extra_logs keys")
    return RewardOutput(torch.cat([o.rewards for o in outs]), torch.cat([o.scores for o in outs]),
                        {k: torch.cat([o.extra_logs[k] for o in outs]) for k in sorted(keys)})
