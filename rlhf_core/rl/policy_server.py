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
  not applied (said once), nor are `seed`, penalties or `logit_bias` (said once). `max_tokens`
  caps a completion; the session's whole sequence stays within `--data.max_len`. `stop` ends a
  completion at the token that completes a stop string, which (unlike OpenAI) stays in the text
  returned.
- Tool calling: a chat request's `tools` go to the chat template (which must render them), and
  calls the policy writes come back as `tool_calls`, read in the format of `tool_call_parser`
  (`rl/tool_calls.py`: hermes, llama3_json, mistral, pythonic, qwen3_coder, deepseek_v3,
  deepseek_v31, kimi_k2, granite, glm45, minimax_m2, seed_oss, step3, xlam, phi4_mini_json; auto:
  the one the chat template teaches, hermes where it shows none; the text values of qwen3_coder,
  glm45, minimax_m2, seed_oss and step3 typed by the
  request's tool schemas)
  (`finish_reason` "tool_calls"); `tool_choice` may be auto or none (sampling is not constrained,
  so a required or named call cannot be enforced). When such an assistant message comes back in a
  later request, it is rendered as the completion's text as sampled, so the session still extends.
- `chat_template_kwargs` (vLLM's extension: variables of the chat template, e.g. Qwen3's
  `enable_thinking`) reach the template; K2 Horizon's `tool_call_format` also chooses how its calls
  are read. Keys the endpoint sets itself (`tools`, `add_generation_prompt`, `tokenize`, ...) are
  refused, as is a value the format cannot read, before anything is sampled.
- `n` > 1 samples that many completions of a request without a session (a session is one chain
  of calls); `stream` answers with server-sent events (the whole completion in one chunk, since
  completions are generated whole; `stream_options.include_usage` adds the usage chunk).
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
from rlhf_core.rl.tool_calls import PARSERS, RESPONSE_TEMPLATE, check_template_kwargs, detect, read_calls
from rlhf_core.rl.tool_formats.response_template import (
    check_response_template,
    read_response_template,
    response_template_of,
)
from rlhf_core.rollout.base import Sample

log = logging.getLogger(__name__)

BATCH_WINDOW_S = 0.005
MAX_BODY_BYTES = 16 * 2**20
MAX_N = 64  # completions one request may ask for
# OpenAI request fields sampling here does not follow (said once when a request sets one)
# apply_chat_template's own arguments, which the endpoint sets: a request's chat_template_kwargs may not
SET_BY_THE_ENDPOINT = frozenset({"chat_template", "tokenize", "conversation", "messages", "tools", "documents",
                                 "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                                 "return_assistant_tokens_mask", "padding", "truncation", "max_length",
                                 "tokenizer_kwargs"})
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

    def submit(self, ids: list[list[int]], max_tokens: list[int]) -> list[Sample]:
        """One sample per sequence, each within its budget (they join the next engine call together)."""
        futures = [Future() for _ in ids]
        for one, budget, future in zip(ids, max_tokens, futures, strict=True):
            self._queue.put((one, budget, future))
        return [future.result() for future in futures]

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


def _serves_tool_calls(template: dict | None) -> bool:
    """Whether a tokenizer's response_template is one the `hf` reader can serve tool calls from."""
    if template is None:
        return False
    try:
        check_response_template(template)
    except ValueError:
        return False
    return True


class PolicyServer:
    """The endpoint; `generate` is set by the rollout that uses it (`MicroBatcher.generate`)."""

    def __init__(self, tokenizer, model_name: str, max_length: int, token: str, host: str = "127.0.0.1",
                 port: int = 0, tool_call_parser: str = "auto"):
        if not token:
            raise ValueError("the policy server needs a token")
        if tool_call_parser not in ("auto", RESPONSE_TEMPLATE, *PARSERS):
            raise ValueError(f"tool_call_parser {tool_call_parser!r}: one of auto, {', '.join(PARSERS)}, "
                             f"{RESPONSE_TEMPLATE}")
        self.response_template = response_template_of(tokenizer)
        self.tool_call_format, self.tool_call_why = tool_call_parser, ""
        if tool_call_parser == RESPONSE_TEMPLATE:  # as vLLM's `hf`: refused at start without a usable one
            if self.response_template is None:
                raise ValueError("tool_call_parser hf reads the tokenizer's response_template; this tokenizer "
                                 "has none (tokenizer_config.json: response_template)")
            check_response_template(self.response_template)
        if tool_call_parser == "auto":
            detected = detect(getattr(tokenizer, "chat_template", None))
            if detected is None and _serves_tool_calls(self.response_template):
                detected, self.tool_call_why = RESPONSE_TEMPLATE, ", the tokenizer's response_template"
            self.tool_call_format = detected or "hermes"
            self.tool_call_why = self.tool_call_why or (", which the chat template teaches" if detected
                                                        else "; the chat template shows none of the known ones")
        self.tokenizer, self.model_name, self.max_length = tokenizer, model_name, max_length
        self.batcher = MicroBatcher()
        self.sessions: dict[str, Session] = {}
        self.tool_texts: dict[str, str] = {}  # id of a tool call the endpoint returned -> its completion's text
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
            self.tool_texts.clear()

    def _prompt_ids(self, session: Session | None, session_id: str | None, text: str) -> list[int]:
        """The token ids of `text`: the session's own tokens, then the new text's."""
        encode = self.tokenizer
        if session is None or not session.calls:
            return list(encode(text, add_special_tokens=False)["input_ids"])
        if not text.startswith(session.text):
            raise RequestError(f"session {session_id}: the request does not extend the session's conversation "
                               "(its earlier messages and completions must come back unchanged)")
        return session.ids + list(encode(text[len(session.text):], add_special_tokens=False)["input_ids"])

    def render_chat(self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None = None) -> str:
        """The chat template's prompt text (`template_kwargs`: the request's chat-template variables);
        an assistant message with tool calls this endpoint returned is rendered as its completion's
        text as sampled (the session then extends)."""
        rendered = []
        for m in messages:
            calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
            ids = [c.get("id") for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
            with self._lock:
                sampled = next((self.tool_texts[i] for i in ids if i in self.tool_texts), None)
            rendered.append(m if sampled is None else {"role": "assistant", "content": sampled})
        kwargs = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
        return self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **kwargs)

    def sampled_text(self, call: Call) -> str:
        """A completion's text with its special tokens (DeepSeek's, Kimi's, Mistral's and Granite
        3.0's call markers are special tokens, which the returned text skips), but without the
        end-of-turn token it ended with (the chat template writes its own after the message)."""
        ids = call.completion_ids
        if call.finished and ids and not self.tokenizer.decode(ids[-1:], skip_special_tokens=True):
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def prompt_text(self, call: Call) -> str:
        """The prompt a completion continues, as the engine saw it (special tokens written)."""
        return self.tokenizer.decode(call.prompt_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def issue_tool_calls(self, calls: list[tuple[str, str]], text: str) -> list[dict]:
        """OpenAI `tool_calls` for parsed calls, remembered with the completion's text."""
        out = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": name, "arguments": arguments}} for name, arguments in calls]
        with self._lock:
            self.tool_texts.update({c["id"]: text for c in out})
        return out

    def complete(self, session_id: str | None, text: str, max_tokens: int | None,
                 stop: list[str] | None = None, n: int = 1) -> list[tuple[Call, str]]:
        """`n` completions of `text` (one within a session), each with its text to return."""
        if session_id and n != 1:
            raise RequestError(f"session {session_id}: a session is one chain of calls; n={n} would branch it "
                               "(sample n completions without a session_id, or in n sessions)")
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
            calls = [Call(ids, list(s.token_ids), list(s.logprobs), s.finished)
                     for s in self.batcher.submit([ids] * n, [budget] * n)]
            if stop:
                calls = [self._cut_at_stop(call, stop) for call in calls]
            if session is not None:
                (call,) = calls
                with self._lock:
                    session.calls.append(call)
                    session.ids = ids + call.completion_ids
                    session.text = text + self.tokenizer.decode(call.completion_ids, skip_special_tokens=False)
        finally:
            if session is not None:
                session.busy = False
        return [(call, self.tokenizer.decode(call.completion_ids, skip_special_tokens=True)) for call in calls]

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


@dataclass
class Request:
    """What one completions request asks, checked."""

    text: str
    session_id: str | None
    max_tokens: int | None
    stop: list[str] | None
    n: int
    stream: bool
    include_usage: bool
    tool_choice: str | None  # None: no tools; "auto": calls are parsed; "none": tools shown, calls not parsed
    logprobs: bool
    tools: list[dict] | None = None
    template_kwargs: dict | None = None  # the request's chat_template_kwargs


def _choice_fields(server: PolicyServer, request: Request, call: Call, text: str, chat: bool) -> tuple[dict, str]:
    """(the choice's message or text fields, its finish_reason)."""
    finish = "stop" if call.finished else "length"
    if not chat:
        return {"text": text}, finish
    message: dict = {"role": "assistant", "content": text}
    if request.tool_choice == "auto":
        sampled = server.sampled_text(call)  # the markers of several formats are special tokens
        content, calls = (read_response_template(sampled, server.response_template, server.prompt_text(call),
                                                 request.tools) if server.tool_call_format == RESPONSE_TEMPLATE
                          else read_calls(server.tool_call_format, sampled, request.tools, request.template_kwargs))
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": server.issue_tool_calls(calls, sampled)}
            finish = "tool_calls"
    return message, finish


def _answers(server: PolicyServer, request: Request, results: list[tuple[Call, str]], chat: bool) -> dict:
    kind = "chat.completion" if chat else "text_completion"
    choices = []
    for index, (call, text) in enumerate(results):
        fields, finish = _choice_fields(server, request, call, text, chat)
        choice = {"index": index, "finish_reason": finish,
                  "logprobs": _openai_logprobs(server.tokenizer, call) if request.logprobs else None}
        choice.update({"message": fields} if chat else fields)
        choices.append(choice)
    prompt = len(results[0][0].prompt_ids)
    completion = sum(len(call.completion_ids) for call, _ in results)
    return {"id": f"rlhf-{uuid.uuid4().hex[:24]}", "object": kind, "created": int(time.time()),
            "model": server.model_name, "choices": choices,
            "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}


def stream_events(answer: dict, chat: bool, include_usage: bool) -> list[dict]:
    """An answer as OpenAI's stream of chunks (pure): each choice whole in one chunk, then its
    finish_reason, then (asked for) the usage with no choices."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": answer["id"], "object": kind, "created": answer["created"], "model": answer["model"]}
    events = []
    for choice in answer["choices"]:
        if chat:
            delta = {k: v for k, v in choice["message"].items() if k != "tool_calls"}
            if choice["message"].get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(choice["message"]["tool_calls"])]
            first = {"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None}
            last = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
        else:
            first = {"index": choice["index"], "text": choice["text"], "logprobs": choice["logprobs"],
                     "finish_reason": None}
            last = {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
        events += [{**head, "choices": [first]}, {**head, "choices": [last]}]
    if include_usage:
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return events


def _handler(server: PolicyServer, token: bytes):
    def template_kwargs(body: dict, chat: bool) -> dict | None:
        kwargs = body.get("chat_template_kwargs")
        if kwargs is None:
            return None
        if not chat:
            raise RequestError("chat_template_kwargs go with /v1/chat/completions (the chat template reads them)")
        if not isinstance(kwargs, dict):
            raise RequestError("chat_template_kwargs must be an object of the chat template's variables")
        if taken := sorted(SET_BY_THE_ENDPOINT & kwargs.keys()):
            raise RequestError(f"chat_template_kwargs {', '.join(taken)}: set by the endpoint itself (the request's "
                               "tools, a generation prompt, text), not by a request")
        try:
            check_template_kwargs(server.tool_call_format, kwargs)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return kwargs

    def chat_text(body: dict, kwargs: dict | None) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {role, content}")
        template = getattr(server.tokenizer, "chat_template", None)
        if template is None:
            raise RequestError("the policy's tokenizer has no chat template: use /v1/completions")
        tools = body.get("tools") or None
        if tools is not None:
            if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
                raise RequestError("tools must be a list of tool objects")
            if "tools" not in template:
                raise RequestError("tools: the policy's chat template does not render tools, so the policy would "
                                   "never see them; describe the tools in the messages instead")
        return server.render_chat(messages, tools, kwargs)

    def completion_text(body: dict) -> str:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            raise RequestError("prompt must be a string (one prompt per request)")
        if body.get("tools"):
            raise RequestError("tools go with /v1/chat/completions (the chat template renders them)")
        return prompt

    def parse(body: dict, chat: bool) -> Request:
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        n = body.get("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise RequestError(f"n must be an integer from 1 to {MAX_N}")
        for knob in ("temperature", "top_p", "top_k"):
            if knob in body:
                say_once(f"rlhf: the policy endpoint samples with the RL stage's --{knob}; a request's "
                         f"{knob} is not applied (the trainer's log-probs must match the engine's)")
        for knob in NOT_SERVED:
            if body.get(knob) not in (None, [], {}, 0):
                say_once(f"rlhf: the policy endpoint does not apply a request's {knob!r} (sampling follows "
                         "the RL stage's settings)")
        tool_choice = body.get("tool_choice")
        if tool_choice not in (None, "auto", "none"):
            raise RequestError(f"tool_choice {json.dumps(tool_choice)}: sampling is not constrained here, so a "
                               "required or named call cannot be enforced; use auto or none")
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else stop
        if stop is not None and not (isinstance(stop, list) and all(isinstance(x, str) and x for x in stop)):
            raise RequestError("stop must be a non-empty string or a list of them")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            raise RequestError("max_tokens must be a positive integer")
        options = body.get("stream_options") or {}
        kwargs = template_kwargs(body, chat)
        text = chat_text(body, kwargs) if chat else completion_text(body)
        return Request(text, body.get("session_id"), max_tokens, stop, n, bool(body.get("stream")),
                       bool(isinstance(options, dict) and options.get("include_usage")),
                       (tool_choice or "auto") if chat and body.get("tools") else None, bool(body.get("logprobs")),
                       body.get("tools") or None, kwargs)

    routes = {"/v1/chat/completions": True, "/v1/completions": False}  # path -> chat

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

        def _events(self, events: list[dict]) -> None:
            """Server-sent events, then `[DONE]`; the connection closes after them."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()
            for event in events:
                self.wfile.write(b"data: " + json.dumps(event, allow_nan=False).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()

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
            chat = routes[path]
            try:
                request = parse(json.loads(self.rfile.read(length)), chat)
                results = server.complete(request.session_id, request.text, request.max_tokens, request.stop,
                                          request.n)
                answer = _answers(server, request, results, chat)
            except (ValueError, RequestError) as e:  # JSON errors are ValueErrors too
                return self.reply(getattr(e, "status", 400), {"error": {"message": str(e),
                                                                       "type": "invalid_request_error"}})
            except Exception as e:
                log.exception("policy endpoint failed")
                return self.reply(500, {"error": {"message": f"{type(e).__name__}: {e}"}})
            if request.stream:
                return self._events(stream_events(answer, chat, request.include_usage))
            self.reply(200, answer)

    Handler.token = token
    return Handler
