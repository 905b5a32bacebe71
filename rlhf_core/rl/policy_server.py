"""The policy behind an OpenAI-compatible HTTP endpoint, so an agent framework can drive rollouts.

`PolicyServer` serves `POST /v1/chat/completions` and `POST /v1/completions` (and `GET /v1/models`,
`GET /health`) from the RL stage's rollout engines, bound to 127.0.0.1 with a bearer token like
`rlhf serve-rm`. Every completion is recorded, token for token with the engine's log-probs, under
the request's `session_id` (a field of the body; OpenAI clients send it through `extra_body`), and
a session's calls become one training sample (`trace_sample`): the first call's prompt, then each
completion (trained) and what the conversation added between two calls (not trained).

- A session's next request must extend its conversation: its prompt text (chat template applied)
  starts with the text of everything the session has so far, and only the new text is tokenized
  and appended, so the sampled tokens are kept exactly as sampled even where re-tokenizing their
  text would merge them differently. A request that rewrites the conversation is refused (400).
- Sampling follows the RL stage (`--temperature`, `--top_k`, `--top_p`): a request's own
  `temperature`/`top_p` would make the engine's log-probs disagree with the trainer's, so they are
  not applied (said once), nor are `seed`, penalties or `logit_bias` (said once); OpenAI tool
  calling (`tools`) is refused: calls go in the text. `max_tokens` caps a completion; the
  session's whole sequence stays within `--data.max_len`. `stop` ends a completion at the token
  that completes a stop string, which (unlike OpenAI) stays in the text returned.
- A session answers one call at a time (a concurrent one gets 409), so its calls form one chain.
- Concurrent requests are batched into one engine call (`MicroBatcher`: those that arrive within a
  few milliseconds of each other), so many sessions at once cost about what one batched rollout
  does.
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import queue
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer

import torch

from rlhf_core.infra.json_http import BearerJsonHandler
from rlhf_core.infra.not_applied import say_once
from rlhf_core.rl.experience import RolloutSample
from rlhf_core.rollout.base import Sample

log = logging.getLogger(__name__)

BATCH_WINDOW_S = 0.005
MAX_BODY_BYTES = 16 * 2**20
# OpenAI request fields sampling here does not follow (said once when a request sets one)
NOT_SERVED = ("seed", "presence_penalty", "frequency_penalty", "logit_bias", "top_logprobs", "response_format",
              "min_tokens", "repetition_penalty")


@dataclass
class Call:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finished: bool  # ended with EOS ("stop"), not at its token limit ("length")


@dataclass
class Session:
    calls: list[Call] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # prompt and completion of the last call
    text: str = ""  # their text, special tokens included
    busy: bool = False  # a call is being answered: a second one at once is refused (409)


class MicroBatcher:
    """`submit(ids, max_tokens)` -> a `Sample`; requests arriving within `window_s` share one
    `generate(sequences, budgets)` call, each request with its own budget."""

    def __init__(self, window_s: float = BATCH_WINDOW_S):
        self.window_s = window_s
        self.generate: Callable[[list[list[int]], list[int]], list[Sample]] | None = None
        self.engine_lock = threading.Lock()  # held while the engines generate for the endpoint
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="policy-server-batcher", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.stop_serving()
        self._queue.put(None)  # ends the worker
        self._thread.join()

    def stop_serving(self) -> None:
        """No more engine calls: waits for one in progress, fails the requests still queued."""
        with self.engine_lock:
            self.generate = None
        while True:
            try:
                _, _, future = self._queue.get_nowait()
            except queue.Empty:
                return
            future.set_exception(RuntimeError("the policy is not serving now (between rollouts)"))

    def submit(self, ids: list[int], max_tokens: int) -> Sample:
        future: Future = Future()
        self._queue.put((ids, max_tokens, future))
        return future.result()

    def _work(self) -> None:
        while (first := self._queue.get()) is not None:
            batch = [first]
            deadline = time.monotonic() + self.window_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    item = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:  # closing: answer what came, then stop
                    self._queue.put(None)
                    break
                batch.append(item)
            try:
                with self.engine_lock:
                    if self.generate is None:
                        raise RuntimeError("the policy is not serving now (between rollouts)")
                    out = self.generate([ids for ids, _, _ in batch], [m for _, m, _ in batch])
                for (_, _, future), sample in zip(batch, out, strict=True):
                    future.set_result(sample)
            except Exception as e:  # every waiting request gets the error
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(e)


class _Server(ThreadingHTTPServer):
    request_queue_size = 4096  # every episode of a batch connects at once (the default backlog is 5)


class RequestError(ValueError):
    """A request the endpoint refuses (400, or `status`), with the reason."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class PolicyServer:
    """The endpoint; `generate` is set by the rollout that uses it (`MicroBatcher.generate`)."""

    def __init__(self, tokenizer, model_name: str, max_length: int, token: str, host: str = "127.0.0.1",
                 port: int = 0):
        if not token:
            raise ValueError("the policy server needs a token")
        self.tokenizer, self.model_name, self.max_length = tokenizer, model_name, max_length
        self.batcher = MicroBatcher()
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.httpd = _Server((host, port), _handler(self, token.encode()))
        self.httpd.daemon_threads = True
        self.host, self.port = host, self.httpd.server_address[1]
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="policy-server", daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self._thread.join()
        self.httpd.server_close()
        self.batcher.close()

    # -- sessions ------------------------------------------------------------------------------
    def take(self, session_id: str) -> Session | None:
        with self._lock:
            return self.sessions.pop(session_id, None)

    def forget_sessions(self) -> None:
        """After a batch: what calls of abandoned episodes left behind."""
        with self._lock:
            self.sessions.clear()

    def _prompt_ids(self, session: Session | None, session_id: str | None, text: str) -> list[int]:
        """The token ids of `text`: the session's own tokens, then the new text's."""
        encode = self.tokenizer
        if session is None or not session.calls:
            return list(encode(text, add_special_tokens=False)["input_ids"])
        if not text.startswith(session.text):
            raise RequestError(f"session {session_id}: the request does not extend the session's conversation "
                               "(its earlier messages and completions must come back unchanged)")
        return session.ids + list(encode(text[len(session.text):], add_special_tokens=False)["input_ids"])

    def complete(self, session_id: str | None, text: str, max_tokens: int | None,
                 stop: list[str] | None = None) -> tuple[Call, str]:
        session = None
        if session_id:
            with self._lock:
                session = self.sessions.setdefault(session_id, Session())
                if session.busy:
                    raise RequestError(f"session {session_id}: a call of this session is being answered; its calls "
                                       "go one after another", status=409)
                session.busy = True
        try:
            ids = self._prompt_ids(session, session_id, text)
            room = self.max_length - len(ids)
            if room <= 0:
                raise RequestError(f"the prompt ({len(ids)} tokens) leaves no room under --data.max_len "
                                   f"{self.max_length}")
            budget = room if max_tokens is None else min(room, max_tokens)
            sample = self.batcher.submit(ids, budget)
            call = Call(ids, list(sample.token_ids), list(sample.logprobs), sample.finished)
            if stop:
                call = self._cut_at_stop(call, stop)
            if session is not None:
                with self._lock:
                    session.calls.append(call)
                    session.ids = ids + call.completion_ids
                    session.text = text + self.tokenizer.decode(call.completion_ids, skip_special_tokens=False)
        finally:
            if session is not None:
                session.busy = False
        return call, self.tokenizer.decode(call.completion_ids, skip_special_tokens=True)

    def _cut_at_stop(self, call: Call, stop: list[str]) -> Call:
        """The completion up to and including the token that completes the first stop string. Unlike
        OpenAI's, the text returned keeps the stop string: the session continues from the tokens as
        sampled, so the conversation sent back must carry them."""
        def has_stop(k: int) -> bool:  # monotone in k: a prefix that holds a stop string, so do the longer ones
            text = self.tokenizer.decode(call.completion_ids[:k], skip_special_tokens=True)
            return any(s in text for s in stop)

        if not has_stop(len(call.completion_ids)):
            return call
        k = bisect.bisect_left(range(len(call.completion_ids) + 1), True, key=has_stop)  # log-many decodes
        return Call(call.prompt_ids, call.completion_ids[:k], call.logprobs[:k], True)


def trace_sample(session: Session, prompt_index: int) -> RolloutSample:
    """A session's calls as one training sample: each completion trained, what came between not.
    ValueError if a call does not extend the ones before it."""
    first = session.calls[0]
    prompt = first.prompt_ids
    response, mask, logprobs = [], [], []
    for k, call in enumerate(session.calls):
        if call.prompt_ids[: len(prompt) + len(response)] != prompt + response:
            raise ValueError(f"call {k} of the session does not continue the calls before it")
        between = call.prompt_ids[len(prompt) + len(response):]
        response += between + call.completion_ids
        mask += [0] * len(between) + [1] * len(call.completion_ids)
        logprobs += call.logprobs
    return RolloutSample(list(prompt), response, prompt_index, torch.tensor(logprobs, dtype=torch.float32),
                         session.calls[-1].finished, action_mask=mask)


def _openai_logprobs(tokenizer, call: Call) -> dict:
    # JSON has no -inf: a token the engine's filtered distribution gave probability 0 shows -9999
    return {"content": [{"token": tokenizer.decode([t]), "token_id": t, "logprob": lp if math.isfinite(lp) else -9999.0,
                         "bytes": None, "top_logprobs": []}
                        for t, lp in zip(call.completion_ids, call.logprobs, strict=True)]}


def _handler(server: PolicyServer, token: bytes):
    def chat_text(body: dict) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content}")
        if getattr(server.tokenizer, "chat_template", None) is None:
            raise RequestError("the policy's tokenizer has no chat template: use /v1/completions")
        return server.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def completion_text(body: dict) -> str:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string (one prompt per request)")
        return prompt

    routes = {"/v1/chat/completions": ("chat.completion", chat_text),
              "/v1/completions": ("text_completion", completion_text)}

    class Handler(BearerJsonHandler):
        server_version = "rlhf-policy"
        max_body_bytes = MAX_BODY_BYTES

        def do_GET(self):
            path = urllib.parse.urlsplit(self.path).path
            if path == "/health":
                return self.reply(200, {"status": "ok"})
            if path == "/v1/models":
                if not self.authorized():
                    return self._unauthorized()
                return self.reply(200, {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                                                    "owned_by": "rlhf"}]})
            self.reply(404, {"error": {"message": f"not found: {path}"}})

        def _unauthorized(self):
            return self.reply(401, {"error": {"message": "missing or wrong bearer token (Authorization: Bearer "
                                              "<token>)"}}, close=True,
                              extra={"WWW-Authenticate": 'Bearer realm="rlhf-policy"'})

        def do_POST(self):
            length = self.read_length()
            if length is None:
                return None
            path = urllib.parse.urlsplit(self.path).path
            if path not in routes:
                self.drain(length)
                return self.reply(404, {"error": {"message": f"not found: {path}"}}, close=True)
            if not self.authorized():
                self.drain(length)
                return self._unauthorized()
            kind, text_of = routes[path]
            try:
                body = json.loads(self.rfile.read(length))
                if not isinstance(body, dict):
                    raise RequestError("the body must be a JSON object")
                if body.get("n", 1) != 1 or body.get("stream"):
                    raise RequestError("one completion per request, not streamed (n=1, stream=false)")
                for knob in ("temperature", "top_p", "top_k"):
                    if knob in body:
                        say_once(f"rlhf: the policy endpoint samples with the RL stage's --{knob}; a request's "
                                 f"{knob} is not applied (the trainer's log-probs must match the engine's)")
                for knob in NOT_SERVED:
                    if body.get(knob) not in (None, [], {}, 0):
                        say_once(f"rlhf: the policy endpoint does not apply a request's {knob!r} (sampling follows "
                                 "the RL stage's settings)")
                if body.get("tools") or body.get("tool_choice") not in (None, "none"):
                    raise RequestError("OpenAI tool calling (tools, tool_choice) is not served: write calls in the "
                                       "text and parse them in the agent")
                stop = body.get("stop")
                stop = [stop] if isinstance(stop, str) else stop
                if stop is not None and not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):
                    raise RequestError("stop must be a non-empty string or a list of them")
                max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
                if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
                    raise RequestError("max_tokens must be a positive integer")
                call, text = server.complete(body.get("session_id"), text_of(body), max_tokens, stop)
            except (ValueError, RequestError) as e:  # JSON errors are ValueErrors too
                return self.reply(getattr(e, "status", 400), {"error": {"message": str(e),
                                                                       "type": "invalid_request_error"}})
            except Exception as e:
                log.exception("policy endpoint failed")
                return self.reply(500, {"error": {"message": f"{type(e).__name__}: {e}"}})
            finish = "stop" if call.finished else "length"
            choice = {"index": 0, "finish_reason": finish,
                      "logprobs": _openai_logprobs(server.tokenizer, call) if body.get("logprobs") else None}
            if kind == "chat.completion":
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            self.reply(200, {"id": f"rlhf-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
                             "model": server.model_name, "choices": [choice],
                             "usage": {"prompt_tokens": len(call.prompt_ids),
                                       "completion_tokens": len(call.completion_ids),
                                       "total_tokens": len(call.prompt_ids) + len(call.completion_ids)}})

    Handler.token = token
    return Handler
