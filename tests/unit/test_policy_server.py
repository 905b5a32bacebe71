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
from rlhf_core.rollout.base import Sample


class CharTokenizer:
    chat_template = "x"  # present: the endpoint renders messages with apply_chat_template below

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
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
        return [Sample(a[:m], (-0.5, -0.25, -0.125, -0.0625)[:m], m >= len(a))
                for a, m in zip(answers, budgets, strict=True)]

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
    assert post(server, "/completions", {"prompt": "abc", "n": 2})[0] == 400
    with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/health") as r:
        assert json.loads(r.read()) == {"status": "ok"}
    request = urllib.request.Request(f"{server.base_url}/models", headers={"Authorization": "Bearer secret"})
    with urllib.request.urlopen(request) as r:
        assert json.loads(r.read())["data"][0]["id"] == "policy"
    assert server.host == "127.0.0.1"


def test_concurrent_requests_share_an_engine_call(server):
    results = []
    threads = [threading.Thread(target=lambda k=k: results.append(post(server, "/completions",
                                                                        {"prompt": "x" * k, "max_tokens": k})[0]))
               for k in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 8
    assert len(server.calls) < 8 and sum(n for n, _ in server.calls) == 8
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


def test_stop_strings_end_a_completion_and_tool_calling_fields_are_refused(server):
    code, answer = post(server, "/completions", {"prompt": "abc", "stop": ["k"], "session_id": "t"})
    assert code == 200 and answer["choices"][0]["text"] == "ok" and answer["choices"][0]["finish_reason"] == "stop"
    assert server.take("t").calls[0].completion_ids == [ord("o"), ord("k")]  # the tokens as sampled, up to the stop
    code, answer = post(server, "/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                      "tools": [{"type": "function"}]})
    assert code == 400 and "tool calling" in answer["error"]["message"]


def test_a_session_whose_calls_do_not_chain_is_not_a_sample():
    from rlhf_core.rl.policy_server import Call, Session

    session = Session([Call([1, 2], [3], [-1.0], True), Call([1, 9, 3, 4], [5], [-1.0], True)])
    with pytest.raises(ValueError, match="call 1 of the session does not continue"):
        trace_sample(session, 0)
