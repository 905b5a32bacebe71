"""The policy's OpenAI-compatible endpoint (`rl/policy_server.py`): OpenAI's request and answer
shapes, a bearer token, sessions whose calls become one training sample with exactly the sampled
tokens, concurrent requests batched into one engine call."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from rlhf_core.rl.policy_server import PolicyServer, trace_sample
from rlhf_core.rl.tool_calls import PARSERS
from tests.unit.engine_stubs import within_budget


class CharTokenizer:
    chat_template = "x"  # present: the endpoint renders messages with apply_chat_template below

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == 0x2404))

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}" + ("\u2404" if m["role"] == "assistant" else "")
                       for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


EOT = 0x2404  # the tokenizer's end of an assistant turn, its EOS


@pytest.fixture
def server():
    server = PolicyServer(CharTokenizer(), "policy", max_length=200, token="secret")
    calls = []

    def generate(sequences, budgets):
        calls.append((len(sequences), budgets))
        # answers "ok" + the sequence's length mod 10, then EOS (a token that re-tokenizes as one), within
        # each sequence's own budget as engines do
        answers = [tuple(map(ord, f"ok{len(s) % 10}")) + (EOT,) for s in sequences]
        return [within_budget(a, (-0.5, -0.25, -0.125, -0.0625), m) for a, m in zip(answers, budgets, strict=True)]

    server.batcher.generate = generate
    server.calls = calls
    yield server
    server.close()


def post(server, path, body, token="secret"):
    request = urllib.request.Request(f"{server.base_url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_session_of_chat_calls_becomes_one_sample_with_its_completions_trained(server):
    first = [{"role": "user", "content": "hi"}]
    code, answer = post(server, "/chat/completions", {"model": "policy", "messages": first, "session_id": "s1",
                                                      "logprobs": True})
    assert code == 200 and answer["object"] == "chat.completion"
    reply = answer["choices"][0]["message"]["content"]
    assert reply == "ok9" and answer["choices"][0]["finish_reason"] == "stop"
    assert [c["logprob"] for c in answer["choices"][0]["logprobs"]["content"]] == [-0.5, -0.25, -0.125, -0.0625]
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "and?"}]
    code, answer = post(server, "/chat/completions", {"messages": second, "session_id": "s1"})
    assert code == 200
    session = server.take("s1")
    sample = trace_sample(session, prompt_index=7)
    prompt = "<user>hi<assistant>"
    assert "".join(map(chr, sample.prompt_ids)) == prompt
    between = "<user>and?<assistant>"
    assert "".join(map(chr, sample.response_ids)) == "ok9\u2404" + between + "ok4\u2404"
    assert sample.action_mask == [1] * 4 + [0] * len(between) + [1] * 4
    assert sample.rollout_logprobs.tolist() == [-0.5, -0.25, -0.125, -0.0625] * 2 and sample.finished
    assert sample.prompt_index == 7 and server.take("s1") is None


def test_a_request_that_rewrites_the_conversation_is_refused(server):
    post(server, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "session_id": "s"})
    code, answer = post(server, "/chat/completions", {"session_id": "s", "messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "something else"},
        {"role": "user", "content": "?"}]})
    assert code == 400 and "does not extend the session" in answer["error"]["message"]


def test_completions_models_health_and_the_token(server):
    code, answer = post(server, "/completions", {"prompt": "abc", "max_tokens": 2})
    assert code == 200 and answer["choices"][0]["text"] == "ok" and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    assert post(server, "/completions", {"prompt": "abc"}, token="wrong")[0] == 401
    code, answer = post(server, "/completions", {"prompt": "abc", "n": 2})  # no session: n samples
    assert code == 200 and [c["index"] for c in answer["choices"]] == [0, 1]
    assert server.calls[-1] == (2, [197, 197])  # two samples of the prompt, each with the room left
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11}
    code, answer = post(server, "/completions", {"prompt": "abc", "n": 2, "session_id": "s"})
    assert code == 400 and "would branch it" in answer["error"]["message"]
    assert post(server, "/completions", {"prompt": "abc", "n": 0})[0] == 400
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}
    request = urllib.request.Request(f"{server.base_url}/models", headers={"Authorization": "Bearer secret"})
    with urllib.request.urlopen(request) as r:
        assert json.loads(r.read())["data"][0]["id"] == "policy"
    assert server.host == "127.0.0.1"


def test_concurrent_requests_share_an_engine_call(server):
    """Requests that come while the engines generate wait together and go in the next call (not
    one call each), however slowly this machine starts the threads."""
    gate, first = threading.Event(), []
    generate = server.batcher.generate

    def held(sequences, budgets):  # the first call is held until every request has arrived
        if not first:
            first.append(len(sequences))
            gate.wait(10)
        return generate(sequences, budgets)

    server.batcher.generate = held
    results = []
    threads = [threading.Thread(target=lambda k=k: results.append(post(server, "/completions",
                                                                        {"prompt": "x" * k, "max_tokens": k})[0]))
               for k in range(1, 9)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while not (first and server.batcher._queue.qsize() == 8 - first[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.set()
    for t in threads:
        t.join()
    assert results == [200] * 8
    assert len(server.calls) <= 2 and sum(n for n, _ in server.calls) == 8
    # each request's own budget (its max_tokens) went to the engine, not the batch's largest
    assert sorted(m for _, budgets in server.calls for m in budgets) == list(range(1, 9))


def test_a_session_answers_one_call_at_a_time_and_its_calls_form_one_chain(server):
    gate = threading.Event()
    slow = server.batcher.generate

    def held(sequences, budget):
        gate.wait(10)
        return slow(sequences, budget)

    server.batcher.generate = held
    first = threading.Thread(target=lambda: post(server, "/completions", {"prompt": "abc", "session_id": "s"}))
    first.start()
    time.sleep(0.2)  # the first call is being answered
    code, answer = post(server, "/completions", {"prompt": "abc", "session_id": "s"})
    gate.set()
    first.join()
    assert code == 409 and "one after another" in answer["error"]["message"]
    assert len(server.take("s").calls) == 1


def test_stop_strings_end_a_completion_and_tools_need_a_template_that_renders_them(server):
    code, answer = post(server, "/completions", {"prompt": "abc", "stop": ["k"], "session_id": "t"})
    assert code == 200 and answer["choices"][0]["text"] == "ok" and answer["choices"][0]["finish_reason"] == "stop"
    assert server.take("t").calls[0].completion_ids == [ord("o"), ord("k")]  # the tokens as sampled, up to the stop
    code, answer = post(server, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "tools": [{"type": "function"}]})
    assert code == 400 and "does not render tools" in answer["error"]["message"]


def test_a_session_whose_calls_do_not_chain_is_not_a_sample():
    from rlhf_core.rl.policy_server import Call, Session

    session = Session([Call([1, 2], [3], [-1.0], True), Call([1, 9, 3, 4], [5], [-1.0], True)])
    with pytest.raises(ValueError, match="call 1 of the session does not continue"):
        trace_sample(session, 0)


class ToolTokenizer(CharTokenizer):
    """A chat template that renders tools, and an assistant's tool calls its own way (not as the
    policy wrote them): a session extends only if the endpoint renders its own calls as sampled."""

    chat_template = "... tools ..."

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, tools=None):
        text = f"<tools>{','.join(t['function']['name'] for t in tools)}" if tools else ""
        for m in messages:
            body = m["content"] or ""
            if m.get("tool_calls"):
                body += "".join(f"[{c['function']['name']}]" for c in m["tool_calls"])
            text += f"<{m['role']}>{body}" + ("\u2404" if m["role"] == "assistant" else "")
        return text + ("<assistant>" if add_generation_prompt else "")


CALL = 'sure<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}


@pytest.fixture
def tool_server():
    server = PolicyServer(ToolTokenizer(), "policy", max_length=400, token="secret")

    def generate(sequences, budgets):  # calls the tool first, answers once the tool has spoken
        texts = ["3" if "<tool>" in "".join(map(chr, s)) else CALL for s in sequences]
        return [within_budget(tuple(map(ord, t)) + (EOT,), [-0.5] * (len(t) + 1), m)
                for t, m in zip(texts, budgets, strict=True)]

    server.batcher.generate = generate
    yield server
    server.close()


def test_tool_calls_come_back_as_openai_tool_calls_and_the_session_extends_through_them(tool_server):
    """The policy's Hermes-format call is returned as `tool_calls` (content: the text before it);
    the framework sends the call back in its own form with the tool's answer, and the session's
    sample holds the call exactly as sampled (trained) and the tool's answer (not trained)."""
    first = [{"role": "user", "content": "1+2?"}]
    code, answer = post(tool_server, "/chat/completions", {"messages": first, "tools": [ADD], "session_id": "s"})
    assert code == 200, answer
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "sure"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    second = [*first, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "3"}]
    code, answer = post(tool_server, "/chat/completions", {"messages": second, "tools": [ADD], "session_id": "s"})
    assert code == 200, answer
    assert answer["choices"][0]["message"] == {"role": "assistant", "content": "3"}
    assert answer["choices"][0]["finish_reason"] == "stop"
    sample = trace_sample(tool_server.take("s"), prompt_index=0)
    assert "".join(map(chr, sample.prompt_ids)) == "<tools>add<user>1+2?<assistant>"
    between = "<tool>3<assistant>"
    assert "".join(map(chr, sample.response_ids)) == CALL + "\u2404" + between + "3\u2404"
    assert sample.action_mask == [1] * (len(CALL) + 1) + [0] * len(between) + [1, 1]
    # the same conversation sent back with the call rewritten is not the session's: refused
    post(tool_server, "/chat/completions", {"messages": first, "tools": [ADD], "session_id": "t"})
    forged = [*first, {"role": "assistant", "content": "sure", "tool_calls": [{**call, "id": "call_other"}]},
              {"role": "tool", "tool_call_id": "call_other", "content": "3"}]
    code, answer = post(tool_server, "/chat/completions", {"messages": forged, "tools": [ADD], "session_id": "t"})
    assert code == 400 and "does not extend" in answer["error"]["message"]


class KimiTokenizer(ToolTokenizer):
    """Kimi K2's call markers as special tokens (one id each, dropped from the text returned, as a
    real tokenizer's decode skips them), and its chat template's marker."""

    chat_template = "... tools ... <|tool_calls_section_begin|>"
    SPECIAL = {0xE000 + k: marker for k, marker in enumerate(
        ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
         "<|tool_calls_section_end|>"))}

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if skip_special_tokens and (i in self.SPECIAL or i == EOT) else self.SPECIAL.get(i, chr(i))
                       for i in ids)


def test_calls_whose_markers_are_special_tokens_are_read_and_the_session_extends():
    """vLLM reads such calls with special tokens kept (the text returned skips them, so a parser
    of that text never sees a call), and the call sent back must render as sampled."""
    mark = {marker: [i] for i, marker in KimiTokenizer.SPECIAL.items()}
    sampled = ([*map(ord, "ok")] + mark["<|tool_calls_section_begin|>"] + mark["<|tool_call_begin|>"]
               + [*map(ord, "functions.add:0")] + mark["<|tool_call_argument_begin|>"] + [*map(ord, '{"a": 1}')]
               + mark["<|tool_call_end|>"] + mark["<|tool_calls_section_end|>"] + [EOT])
    server = PolicyServer(KimiTokenizer(), "policy", max_length=400, token="secret")
    server.batcher.generate = lambda sequences, budgets: [
        within_budget(tuple(sampled) if len(sequences[0]) < 60 else (ord("3"), EOT), [-0.5] * len(sampled), m)
        for m in budgets]
    try:
        assert server.tool_call_format == "kimi_k2"
        messages = [{"role": "user", "content": "1+2?"}]
        code, answer = post(server, "/chat/completions", {"messages": messages, "tools": [ADD], "session_id": "k"})
        assert code == 200, answer
        message = answer["choices"][0]["message"]
        assert message["content"] == "ok" and answer["choices"][0]["finish_reason"] == "tool_calls"
        assert [c["function"] for c in message["tool_calls"]] == [{"name": "add", "arguments": '{"a": 1}'}]
        messages += [message, {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "1"}]
        code, answer = post(server, "/chat/completions", {"messages": messages, "tools": [ADD], "session_id": "k"})
        assert code == 200, answer  # the call came back rendered with its markers: the session extends
        sample = trace_sample(server.take("k"), prompt_index=0)
        assert sample.response_ids[: len(sampled)] == sampled and sum(sample.action_mask) == len(sampled) + 2
    finally:
        server.close()


def test_tool_choice_none_leaves_calls_in_the_text_and_a_forced_choice_is_refused(tool_server):
    body = {"messages": [{"role": "user", "content": "1+2?"}], "tools": [ADD]}
    code, answer = post(tool_server, "/chat/completions", {**body, "tool_choice": "none"})
    assert code == 200 and answer["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    code, answer = post(tool_server, "/chat/completions", {**body, "tool_choice": "required"})
    assert code == 400 and "cannot be enforced" in answer["error"]["message"]


def stream(server, path, body):
    request = urllib.request.Request(f"{server.base_url}{path}", data=json.dumps({**body, "stream": True}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": "Bearer secret"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"] == "text/event-stream"
        lines = [line for line in response.read().decode().split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_streamed_answers_are_openai_chunks(server, tool_server):
    events = stream(server, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                                  "stream_options": {"include_usage": True}})
    assert [e["object"] for e in events] == ["chat.completion.chunk"] * 5
    assert [(c["index"], c["delta"], c["finish_reason"]) for e in events[:4] for c in e["choices"]] == [
        (0, {"role": "assistant", "content": "ok9"}, None), (0, {}, "stop"),
        (1, {"role": "assistant", "content": "ok9"}, None), (1, {}, "stop")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 8
    (first, last) = stream(server, "/completions", {"prompt": "abc", "max_tokens": 2})
    assert first["choices"][0]["text"] == "ok" and last["choices"][0]["finish_reason"] == "length"
    first, _ = stream(tool_server, "/chat/completions", {"messages": [{"role": "user", "content": "?"}],
                                                         "tools": [ADD]})
    (call,) = first["choices"][0]["delta"]["tool_calls"]
    assert call["index"] == 0 and call["function"]["name"] == "add"


def test_the_openai_client_library_drives_a_tool_using_session(tool_server):
    """What no one here wrote: OpenAI's own Python client (installed with vLLM's requirements) calls
    with tools, gets the call back parsed, returns the assistant message it got with the tool's
    answer, and streams; the session is one trained sample."""
    from openai import OpenAI

    client = OpenAI(base_url=tool_server.base_url, api_key="secret", max_retries=0)
    messages = [{"role": "user", "content": "1+2?"}]
    first = client.chat.completions.create(model="policy", messages=messages, tools=[ADD],
                                           extra_body={"session_id": "s"})
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "add"
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3"}]
    chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=[ADD], stream=True,
                                                 extra_body={"session_id": "s"}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "3"
    assert chunks[-1].choices[0].finish_reason == "stop"
    sample = trace_sample(tool_server.take("s"), prompt_index=0)
    assert "".join(map(chr, sample.response_ids)).startswith(CALL) and sum(sample.action_mask) == len(CALL) + 3


class MistralTokenizer(ToolTokenizer):
    chat_template = "{{ '[AVAILABLE_TOOLS]' + tools|tojson }} {{ '[TOOL_CALLS]' }}"


class Qwen3CoderTokenizer(ToolTokenizer):
    chat_template = "... tools ... <tool_call>\n<function=...>\n<parameter=...>"


class ResponseTemplateTokenizer(ToolTokenizer):
    """A tokenizer whose config describes its replies (transformers' `response_template`, vLLM's `hf`
    parser): its chat template shows no format's marker, so `auto` reads by the description."""

    response_template = {"defaults": {"role": "assistant"}, "start_anchor": "<assistant>", "fields": {
        "tool_calls": {"open_pattern": r"\s*<call>", "close": "</call>", "repeats": True, "content": "json",
                       "transform": {"type": "function", "function": "{content}"}},
        "content": {"content": "text"}}}


# Qwen3-Coder writes values as text; the tool's schema types them (a string "1" without it)
TYPED_ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}}}}


@pytest.mark.parametrize("parser, tokenizer, text, fmt", [
    ("auto", MistralTokenizer(), 'ok[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}', "mistral"),
    ("auto", Qwen3CoderTokenizer(), "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n"
     "</parameter>\n</function>\n</tool_call>", "qwen3_coder"),
    ("pythonic", ToolTokenizer(), "[add(a=1, b=2)]", "pythonic"),
    ("auto", ResponseTemplateTokenizer(), 'ok<call>{"name": "add", "arguments": {"a": "1", "b": 2}}</call>', "hf"),
    ("auto", ToolTokenizer(), CALL, "hermes")])  # a template that shows no format's marker: hermes
def test_calls_are_read_in_the_format_the_template_teaches_or_the_one_named(parser, tokenizer, text, fmt):
    server = PolicyServer(tokenizer, "policy", max_length=400, token="secret", tool_call_parser=parser)
    server.batcher.generate = lambda sequences, budgets: [
        within_budget(tuple(map(ord, text)) + (EOT,), [-0.5] * (len(text) + 1), m) for m in budgets]
    try:
        assert server.tool_call_format == fmt
        code, answer = post(server, "/chat/completions", {"messages": [{"role": "user", "content": "1+2?"}],
                                                          "tools": [TYPED_ADD]})
        assert code == 200, answer
        (call,) = answer["choices"][0]["message"]["tool_calls"]
        assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
        assert answer["choices"][0]["finish_reason"] == "tool_calls"
        # the same text read as another format is no call: the format chosen is the one that read it
        other = next(p for p in ("hermes", "pythonic") if p != fmt)
        assert PARSERS[other](text) == (text, [])
        if fmt == "hf":  # a value the template writes as text, typed by the schema; content before the call
            assert answer["choices"][0]["message"]["content"] == "ok"
    finally:
        server.close()
    with pytest.raises(ValueError, match="tool_call_parser 'qwen': one of auto, hermes"):
        PolicyServer(tokenizer, "policy", max_length=400, token="secret", tool_call_parser="qwen")


def test_the_hf_format_needs_a_response_template_that_describes_tool_calls():
    """As vLLM refuses `--tool-call-parser hf` at start: without the tokenizer's response_template, or
    with one that has no tool_calls field; `auto` then keeps to the markers (hermes here)."""
    with pytest.raises(ValueError, match="this tokenizer has none"):
        PolicyServer(ToolTokenizer(), "policy", max_length=400, token="secret", tool_call_parser="hf")

    class NoCalls(ResponseTemplateTokenizer):
        response_template = {**ResponseTemplateTokenizer.response_template, "fields": {"content": {"content": "text"}}}

    with pytest.raises(ValueError, match="tool_calls"):
        PolicyServer(NoCalls(), "policy", max_length=400, token="secret", tool_call_parser="hf")
    server = PolicyServer(NoCalls(), "policy", max_length=400, token="secret")
    try:
        assert server.tool_call_format == "hermes"
    finally:
        server.close()


class KwargsTokenizer(ToolTokenizer):
    """A chat template with a variable of its own (Qwen3's `enable_thinking`) and K2 Horizon's marker."""

    chat_template = "... tools ... <ifm|tool_calls> {% if enable_thinking is false %}"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, tools=None, **variables):
        text = super().apply_chat_template(messages, tokenize, add_generation_prompt, tools)
        return text + ("<no-think>" if variables.get("enable_thinking") is False else "") + \
            "".join(f"<{k}={v}>" for k, v in sorted(variables.items()) if k != "enable_thinking")


K2_JSON_CALL = '<ifm|tool_calls><ifm|tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</ifm|tool_call></ifm|tool_calls>'


def test_chat_template_kwargs_reach_the_template_and_choose_how_k2_horizon_calls_are_read():
    """vLLM's `chat_template_kwargs`: the template's own variables (the prompt the policy samples from
    shows them); K2 Horizon's `tool_call_format` is also the syntax its calls are read in (json here;
    the same text is no call in the default xml); a value it cannot read, a key the endpoint sets
    itself, a non-object, or the field on /v1/completions: 400, and nothing is sampled."""
    server = PolicyServer(KwargsTokenizer(), "policy", max_length=600, token="secret")
    sampled = []

    def generate(sequences, budgets):
        sampled.extend("".join(map(chr, s)) for s in sequences)
        return [within_budget(tuple(map(ord, K2_JSON_CALL)) + (EOT,), [-0.5] * (len(K2_JSON_CALL) + 1), m)
                for m in budgets]

    server.batcher.generate = generate
    try:
        assert server.tool_call_format == "k2_horizon"
        messages = [{"role": "user", "content": "1+2?"}]
        code, answer = post(server, "/chat/completions", {
            "messages": messages, "tools": [ADD],
            "chat_template_kwargs": {"enable_thinking": False, "tool_call_format": "json"}})
        assert code == 200, answer
        assert sampled[-1] == "<tools>add<user>1+2?<assistant><no-think><tool_call_format=json>"
        (call,) = answer["choices"][0]["message"]["tool_calls"]
        assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
        code, answer = post(server, "/chat/completions", {"messages": messages, "tools": [ADD]})
        assert code == 200 and sampled[-1] == "<tools>add<user>1+2?<assistant>"
        assert "tool_calls" not in answer["choices"][0]["message"]  # xml, the default: the JSON call is text
        count = len(sampled)
        for body, words in (({"tool_call_format": "yaml"}, "tool_call_format 'yaml'"),
                            ({"tokenize": True, "tools": []}, "tokenize, tools: set by the endpoint"),
                            ([1], "must be an object")):
            code, answer = post(server, "/chat/completions", {"messages": messages, "chat_template_kwargs": body})
            assert code == 400 and words in answer["error"]["message"], answer
        code, answer = post(server, "/completions", {"prompt": "1+2?", "chat_template_kwargs": {"x": 1}})
        assert code == 400 and "/v1/chat/completions" in answer["error"]["message"]
        assert len(sampled) == count
    finally:
        server.close()
