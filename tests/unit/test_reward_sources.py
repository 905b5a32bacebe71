"""The RL stage's batched reward sources: reward files, the HTTP server and its client, the token,
the adapters of the verifier and reward models, several reward models combined, and the factory."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import stat
import textwrap
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from rlhf_core.infra.settings import ConfigError, state_dir
from rlhf_core.rewards import (
    CombinedReward,
    RankToken,
    RemoteReward,
    RewardError,
    RewardFile,
    RewardModelReward,
    RewardModelSource,
    RewardOutput,
    VerifierSource,
    add_serve_rm_arguments,
    build_reward_source,
    load_reward_file,
    serve_reward,
    serve_rm_main,
    token_for_ranks,
)
from rlhf_core.rewards.base import as_reward_output

pytestmark = pytest.mark.usefixtures("one_torch_thread")

QUERIES = ["<q>1+1=2", "<q>2+2=5", "<q>3+3=6", "<q>4+4=8", "<q>5+5=1"]
PROMPTS = ["<q>1+1=", "<q>2+2=", "<q>3+3=", "<q>4+4=", "<q>5+5="]
LABELS = ["2", "4", "6", "8", "10"]
TOKEN = "test-token-Zq8v1x"

DICT_FILE = """
import torch

def reward_func(queries, prompts, labels, **kwargs):
    right = [float(q[len(p):] == a) for q, p, a in zip(queries, prompts, labels)]
    lengths = [float(len(q)) for q in queries]
    return {"rewards": torch.tensor(right) * 2 - 1, "scores": torch.tensor(right),
            "extra_logs": {"length": torch.tensor(lengths)}}
"""


def write(tmp_path, body: str, name: str = "reward.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


@pytest.fixture
def dict_file(tmp_path):
    return write(tmp_path, DICT_FILE)


@pytest.fixture
def no_token_env(monkeypatch):
    monkeypatch.delenv("RLHF_RM_TOKEN", raising=False)
    monkeypatch.delenv("RLHF_RM_TOKEN_FILE", raising=False)


# --- reward files ------------------------------------------------------------------------------

def test_reward_file_dict(dict_file):
    source = load_reward_file(dict_file)
    out = source(QUERIES, PROMPTS, LABELS)
    assert isinstance(out, RewardOutput)
    assert out.rewards.tolist() == [1, -1, 1, 1, -1] and out.rewards.dtype == torch.float32
    assert out.scores.tolist() == [1, 0, 1, 1, 0]
    assert out.extra_logs["length"].tolist() == [float(len(q)) for q in QUERIES]


@pytest.mark.parametrize("value", ["torch.tensor([0.5, 1.0])", "[0.5, 1]", "np.array([0.5, 1.0])",
                                   "{'rewards': [0.5, 1.0]}"])
def test_reward_file_bare_rewards_and_kwargs(tmp_path, value):
    path = write(tmp_path, f"""
        import numpy as np
        import torch
        seen = {{}}
        def reward_func(queries, prompts, labels, **kwargs):
            seen.update(kwargs)
            return {value}
    """)
    source = load_reward_file(path)
    out = source(QUERIES[:2], PROMPTS[:2], LABELS[:2], responses=["2", "5"])
    assert out.rewards.tolist() == [0.5, 1.0] and out.scores.tolist() == [0.5, 1.0] and out.extra_logs == {}
    assert source.func.__globals__["seen"] == {"responses": ["2", "5"]}


@pytest.mark.parametrize("signature, passed", [
    ("queries, prompts, labels", {}),  # OpenRLHF <= 0.9's own examples: no **kwargs
    ("queries, prompts, labels, responses=None", {"responses": ["2", "5"]}),
    ("queries, prompts, labels, *, responses, other=0", {"responses": ["2", "5"]}),
    ("q, p, l, **kw", {"responses": ["2", "5"], "raw_prompts": ["a", "b"]}),
])
def test_a_reward_func_gets_the_keyword_arguments_its_signature_accepts(tmp_path, signature, passed):
    """Both eras' reward files run: the source passes what it has, the function receives what it takes."""
    path = write(tmp_path, f"""
        import torch
        calls = []
        def reward_func({signature}):
            calls.append({{k: v for k, v in locals().items() if k not in ("queries", "prompts", "labels", "q", "p", "l")}})
            return torch.tensor([1.0, 0.0])
    """)
    source = load_reward_file(path)
    out = source(QUERIES[:2], PROMPTS[:2], LABELS[:2], responses=["2", "5"], raw_prompts=["a", "b"])
    assert out.rewards.tolist() == [1.0, 0.0]
    received, = source.func.__globals__["calls"]
    received.update(received.pop("kw", {}))
    received.pop("other", None)
    assert received == passed


@pytest.mark.parametrize("body, error", [
    ("x = 1", "defines no reward_func"),
    ("reward_func = 3", "reward_func is a int"),
    ("import no_such_module_xyz\ndef reward_func(q, p, l): pass", "importing it raised ModuleNotFoundError: No module "
     "named 'no_such_module_xyz'"),
    ("def reward_func(q, p, l:\n", "importing it raised SyntaxError"),
    ("def reward_func(queries, prompts):\n    pass", r"reward_func\(queries, prompts\) cannot be called as "
     r"reward_func\(queries, prompts, labels\): too many positional arguments"),
])
def test_reward_file_load_errors(tmp_path, body, error):
    path = write(tmp_path, body)
    with pytest.raises(ConfigError, match=error) as e:
        load_reward_file(path)
    assert path in str(e.value)


def test_reward_file_missing_or_not_python(tmp_path):
    with pytest.raises(ConfigError, match=f"reward file {tmp_path}/nope.py: no such file"):
        load_reward_file(tmp_path / "nope.py")
    (tmp_path / "r.txt").write_text("")
    with pytest.raises(ConfigError, match="r.txt: expected a .py file"):
        load_reward_file(tmp_path / "r.txt")


@pytest.mark.parametrize("returned, error", [
    ("raise KeyError('no answer for ' + queries[0])", "reward_func raised KeyError: 'no answer for <q>1\\+1=2'"),
    ("return [1.0]", r"rewards has shape \(1,\), expected \(2,\)"),
    ("return torch.zeros(2, 1)", r"rewards has shape \(2, 1\), expected \(2,\)"),
    ("return torch.tensor([1.0, float('nan')])", r"rewards\[1\] is nan"),
    ("return {'rewards': [1.0, 2.0], 'scores': [0.0, float('inf')]}", r"scores\[1\] is inf"),
    ("return 'good'", "rewards must be a tensor or a list of 2 numbers, got str"),
    ("return None", "rewards must be a tensor or a list of 2 numbers, got NoneType"),
    ("return ['a', 'b']", "rewards must be a tensor or a list of 2 numbers, got list"),
    ("return {'scores': [1.0, 1.0]}", "the returned dict has no 'rewards'"),
    ("return {'rewards': [1.0, 1.0], 'extra_logs': {'n': [1.0]}}", r"extra_logs\['n'\] has shape \(1,\), expected \(2,\)"),
    ("return {'rewards': [1.0, 1.0], 'extra_logs': [1.0]}", "extra_logs must be a dict"),
    ("return {'rewards': [1.0, 1.0], 'reward': 1}", r"unknown keys \['reward'\]"),
])
def test_reward_file_call_errors(tmp_path, returned, error):
    path = write(tmp_path, f"import torch\ndef reward_func(queries, prompts, labels, **kwargs):\n    {returned}\n")
    with pytest.raises(RewardError, match=error) as e:
        load_reward_file(path)(QUERIES[:2], PROMPTS[:2], LABELS[:2])
    assert f"reward file {path}" in str(e.value)


def test_mismatched_batch_columns(dict_file):
    with pytest.raises(RewardError, match="2 queries, 1 prompts and 2 labels"):
        load_reward_file(dict_file)(QUERIES[:2], PROMPTS[:1], LABELS[:2])


def test_as_reward_output_accepts_reward_output():
    out = as_reward_output(RewardOutput(torch.tensor([1.0, 2.0], dtype=torch.float64)), 2, "x")
    assert out.rewards.dtype == torch.float32 and out.scores.tolist() == [1.0, 2.0]


# --- server and client -------------------------------------------------------------------------

@pytest.fixture
def server(dict_file):
    with serve_reward(load_reward_file(dict_file), port=0, token=TOKEN, background=True) as s:
        yield s


def post(url, payload, token=None, raw: bytes | None = None):
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(payload).encode(), headers=headers)
    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_round_trip_needs_the_token(server, dict_file, monkeypatch, caplog):
    caplog.set_level("DEBUG")
    batch = {"query": QUERIES, "prompts": PROMPTS, "labels": LABELS}
    assert post(server.url, batch)[0] == 401
    code, body = post(server.url, batch, token="wrong")
    assert code == 401 and "bearer token" in body["error"]
    assert post(server.url, batch, token=TOKEN.upper())[0] == 401

    code, body = post(server.url, batch, token=TOKEN)
    direct = load_reward_file(dict_file)(QUERIES, PROMPTS, LABELS)
    assert code == 200
    assert body == {"rewards": direct.rewards.tolist(), "scores": direct.scores.tolist(),
                    "extra_logs": {"length": direct.extra_logs["length"].tolist()}}

    monkeypatch.setenv("RLHF_RM_TOKEN", TOKEN)
    for client in (RemoteReward(server.url), RemoteReward(server.url, chunk_size=2),
                   RemoteReward(f"{server.url},{server.url}")):
        out = client(QUERIES, PROMPTS, LABELS)
        assert torch.equal(out.rewards, direct.rewards) and torch.equal(out.scores, direct.scores)
        assert torch.equal(out.extra_logs["length"], direct.extra_logs["length"])
    assert len(RemoteReward(server.url)([], [], []).rewards) == 0
    assert "POST /get_reward" in caplog.text and TOKEN not in caplog.text and "Bearer" not in caplog.text


def test_client_401_fails_at_once_without_leaking_the_token(dict_file, monkeypatch):
    calls = []
    source = load_reward_file(dict_file)
    with serve_reward(lambda *a, **k: calls.append(1) or source(*a, **k), port=0, token=TOKEN, background=True) as s:
        client = RemoteReward(s.url, retries=5, backoff=5.0)
        monkeypatch.delenv("RLHF_RM_TOKEN", raising=False)
        monkeypatch.delenv("RLHF_RM_TOKEN_FILE", raising=False)
        start = time.monotonic()
        with pytest.raises(RewardError, match="401 unauthorized: set RLHF_RM_TOKEN") as e:
            client(QUERIES, PROMPTS, LABELS)
        assert time.monotonic() - start < 2 and not calls  # no retry, no backoff
        assert s.url in str(e.value)
        secret = "secret-client-token-123456"
        monkeypatch.setenv("RLHF_RM_TOKEN", secret)
        with pytest.raises(RewardError, match="RLHF_RM_TOKEN is not the server's token") as e:
            client(QUERIES, PROMPTS, LABELS)
        for text in (str(e.value), repr(e.value), repr(client), str(client)):
            assert secret not in text and TOKEN not in text
    with pytest.raises(RewardError, match="failed 1 times") as e:  # nothing listens there any more
        RemoteReward(s.url, retries=0)(QUERIES, PROMPTS, LABELS)
    assert secret not in str(e.value)


def test_bad_requests_are_400_and_source_errors_500(tmp_path, server):
    cases = [(b"{not json", "not valid JSON"), (b"[1, 2]", "expected a JSON object"),
             (json.dumps({"query": QUERIES, "prompts": PROMPTS}).encode(), "missing key(s) labels"),
             (json.dumps({"query": QUERIES, "prompts": PROMPTS[:2], "labels": LABELS}).encode(),
              "5 queries, 2 prompts and 5 labels"),
             (json.dumps({"query": [1], "prompts": ["p"], "labels": [None]}).encode(), "query[0] must be a string")]
    for raw, message in cases:
        code, body = post(server.url, None, token=TOKEN, raw=raw)
        assert code == 400 and message in body["error"], (raw, body)
    assert post(server.url.replace("get_reward", "other"), {}, token=TOKEN)[0] == 404

    failing = load_reward_file(write(tmp_path, "def reward_func(q, p, l, **k):\n    raise RuntimeError('judge down')\n",
                                     "failing.py"))
    with serve_reward(failing, port=0, token=TOKEN, background=True) as s:
        code, body = post(s.url, {"query": QUERIES, "prompts": PROMPTS, "labels": LABELS}, token=TOKEN)
    assert code == 500 and "reward_func raised RuntimeError: judge down" in body["error"]


def test_client_retries_5xx_then_succeeds(dict_file, monkeypatch):
    source, calls = load_reward_file(dict_file), []

    def flaky(queries, prompts, labels, **kwargs):
        calls.append(1)
        if len(calls) <= 2:
            raise RuntimeError("warming up")
        return source(queries, prompts, labels)

    monkeypatch.setenv("RLHF_RM_TOKEN", TOKEN)
    with serve_reward(flaky, port=0, token=TOKEN, background=True) as s:
        out = RemoteReward(s.url, retries=2, backoff=0.01)(QUERIES, PROMPTS, LABELS)
        assert len(calls) == 3 and torch.equal(out.rewards, source(QUERIES, PROMPTS, LABELS).rewards)
        calls.clear()
        with pytest.raises(RewardError, match="failed 2 times; last: HTTP 500: .*warming up"):
            RemoteReward(s.url, retries=1, backoff=0.01)(QUERIES, PROMPTS, LABELS)


def test_client_timeout(dict_file, monkeypatch):
    source = load_reward_file(dict_file)
    release = threading.Event()

    def slow(*args, **kwargs):
        release.wait(5)
        return source(*args, **kwargs)

    monkeypatch.setenv("RLHF_RM_TOKEN", TOKEN)
    with serve_reward(slow, port=0, token=TOKEN, background=True) as s:
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"failed 2 times; last: no answer within 0.2 s"):
            RemoteReward(s.url, timeout=0.2, retries=1, backoff=0.01)(QUERIES, PROMPTS, LABELS)
        assert time.monotonic() - start < 3
        release.set()


@pytest.mark.parametrize("answer, error", [
    ('{"scores": [1, 1]}', "has no 'rewards'"),
    ('{"rewards": [1]}', r"rewards has shape \(1,\), expected \(2,\)"),
    ('{"rewards": [1, NaN]}', "not valid JSON"),
    ('{"rewards": [1, "1"]}', "rewards must be a tensor or a list of 2 numbers"),
    ('{"rewards": [1, 2], "extra_logs": {"a": [1, 2, 3]}}', r"extra_logs\['a'\] has shape \(3,\)"),
    ('[1, 2]', "expected a JSON object"),
    ("<html>", "not valid JSON"),
])
def test_client_checks_every_answer(answer, error, no_token_env):
    class Canned(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            body = answer.encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Canned)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/get_reward"
    try:
        with pytest.raises(RewardError, match=error) as e:
            RemoteReward(url, retries=0)(QUERIES[:2], PROMPTS[:2], LABELS[:2])
        assert f"remote reward {url}" in str(e.value)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_generated_token_file(tmp_path, dict_file, no_token_env, monkeypatch, capsys):
    lines = []
    path = tmp_path / "secrets" / "rm_token"
    with serve_reward(load_reward_file(dict_file), port=0, token_file=path, background=True, announce=lines.append) as s:
        token = path.read_text().strip()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and len(token) >= 32
        assert str(path) in lines[0] and token not in "".join(lines) and s.token_path == path
        assert post(s.url, {"query": QUERIES, "prompts": PROMPTS, "labels": LABELS}, token=token)[0] == 200
        monkeypatch.setenv("RLHF_RM_TOKEN_FILE", str(path))  # the client reads the file at call time
        assert len(RemoteReward(s.url)(QUERIES, PROMPTS, LABELS)) == 5
    with serve_reward(load_reward_file(dict_file), port=0) as s:  # default: under the state dir, on stderr
        default = state_dir() / "rm_token"
        token = default.read_text().strip()
        assert s.token_path == default and stat.S_IMODE(default.stat().st_mode) == 0o600
        err = capsys.readouterr()
        assert str(default) in err.err and token not in err.err + err.out
    monkeypatch.setenv("RLHF_RM_TOKEN", "from-env")
    with serve_reward(load_reward_file(dict_file), port=0, token_file=tmp_path / "unused") as s:
        assert s.token_path is None and not (tmp_path / "unused").exists()


def test_token_for_ranks_is_redacted(monkeypatch):
    from rlhf_core.distributed.cluster import FORWARDED_ENV

    assert "RLHF_RM_TOKEN" not in FORWARDED_ENV  # a runtime_env is recorded by Ray: the token never goes there
    monkeypatch.setenv("RLHF_RM_TOKEN", TOKEN)
    token = token_for_ranks()
    assert TOKEN not in repr(token) and TOKEN not in str(token) and TOKEN not in repr([token])
    monkeypatch.delenv("RLHF_RM_TOKEN")
    moved = pickle.loads(pickle.dumps(token))  # what an actor method argument goes through
    assert isinstance(moved, RankToken)
    moved.install()
    assert os.environ["RLHF_RM_TOKEN"] == TOKEN
    monkeypatch.delenv("RLHF_RM_TOKEN")
    assert token_for_ranks() is None


def test_serve_rm_flags_and_config_errors(tmp_path, dict_file, capsys):
    parser = argparse.ArgumentParser()
    add_serve_rm_arguments(parser)
    args = parser.parse_args(["--remote_rm_url", dict_file])
    assert (args.host, args.port, args.remote_rm_url, args.reward_pretrain) == ("127.0.0.1", 5000, dict_file, None)
    args = parser.parse_args(["--reward.model_name_or_path", "a,b", "--reward.normalize_enable", "--port", "0"])
    assert args.reward_pretrain == "a,b" and args.normalize_reward and args.port == 0
    with pytest.raises(SystemExit):
        parser.parse_args(["--reward_pretrain", "a", "--remote_rm_url", dict_file])
    with pytest.raises(SystemExit):
        parser.parse_args([])
    assert serve_rm_main(parser.parse_args(["--remote_rm_url", str(tmp_path / "nope.py")])) == 2
    assert "nope.py: no such file" in capsys.readouterr().err
    assert serve_rm_main(parser.parse_args(["--remote_rm_url", "http://x/get_reward"])) == 2
    assert serve_rm_main(parser.parse_args(["--remote_rm_url", dict_file, "--normalize_reward"])) == 2
    assert "--normalize_reward applies to reward models" in capsys.readouterr().err


# --- adapters, several reward models, the factory ----------------------------------------------

def test_verifier_source_needs_responses():
    v = VerifierSource("addition")
    out = v(QUERIES[:3], PROMPTS[:3], LABELS[:3], responses=["2", " 5", "6 "])
    assert out.rewards.tolist() == [1.0, 0.0, 1.0] and out.scores.tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(RewardError, match="needs responses="):
        v(QUERIES[:3], PROMPTS[:3], LABELS[:3])
    with pytest.raises(RewardError, match="reference answer"):
        v(QUERIES[:1], PROMPTS[:1], [None], responses=["2"])
    with pytest.raises(RewardError, match="1 responses for 3 queries"):
        v(QUERIES[:3], PROMPTS[:3], LABELS[:3], responses=["2"])


def constant(values, log=None):
    def source(queries, prompts, labels, **kwargs):
        return {"rewards": torch.tensor(values), "scores": torch.tensor(values) / 10,
                "extra_logs": {} if log is None else {log: torch.tensor(values)}}
    return source


def test_combined_reward_sums_like_openrlhf():
    both = CombinedReward([constant([1.0, 2.0], "a"), constant([10.0, 20.0])])
    out = both(QUERIES[:2], PROMPTS[:2], LABELS[:2])
    assert out.rewards.tolist() == [11.0, 22.0] and torch.allclose(out.scores, torch.tensor([1.1, 2.2]))
    assert out.extra_logs["reward_0"].tolist() == [1.0, 2.0] and out.extra_logs["reward_1"].tolist() == [10.0, 20.0]
    assert out.extra_logs["reward_0/a"].tolist() == [1.0, 2.0]
    mean = CombinedReward([constant([1.0, 2.0]), constant([3.0, 4.0])], reduce="mean")
    assert mean(QUERIES[:2], PROMPTS[:2], LABELS[:2]).rewards.tolist() == [2.0, 3.0]
    with pytest.raises(RewardError, match=r"rewards has shape \(1,\)"):
        CombinedReward([constant([1.0])])(QUERIES[:2], PROMPTS[:2], LABELS[:2])


@pytest.fixture(scope="module")
def reward_models(prepared, tmp_path_factory):
    """Two reward models as `rlhf train rm` saves them (different random heads)."""
    from rlhf_core.models.loading import load_reward_model, load_tokenizer

    tok = load_tokenizer(prepared["base"])
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = load_reward_model(prepared["base"], tok.pad_token_id)
        out = tmp_path_factory.mktemp(f"rm{seed}")
        model.save_pretrained(out)
        tok.save_pretrained(out)
        paths.append(str(out))
    return paths


@pytest.mark.parametrize("apply_chat_template", [True, False])
def test_reward_model_source_scores_the_trainers_tokens(reward_models, apply_chat_template, no_token_env):
    rm = RewardModelReward(reward_models[0], apply_chat_template, batch_size=2)
    raw = ["add 12+30=", "add 7+5=", "add 1+1="]
    responses = ["42", "13", "2"]
    labels = ["42", "12", "2"]
    expected = torch.tensor(rm.score(raw, responses))
    texts = [rm.formatter.prompt_text(p) for p in raw]
    eos = rm.tokenizer.eos_token
    queries = [t + r + eos for t, r in zip(texts, responses, strict=True)]  # decoded with special tokens
    source = RewardModelSource(rm)
    for kwargs in ({"raw_prompts": raw, "responses": responses}, {"responses": responses}, {}):
        got = source(queries, texts, labels, **kwargs).rewards
        assert torch.allclose(got, expected, atol=1e-5), kwargs
    # over HTTP: the server only has queries, prompts and labels
    with serve_reward(source, port=0, token=TOKEN, background=True) as s:
        os.environ["RLHF_RM_TOKEN"] = TOKEN
        try:
            got = RemoteReward(s.url)(queries, texts, labels).rewards
        finally:
            del os.environ["RLHF_RM_TOKEN"]
    assert torch.allclose(got, expected, atol=1e-5)
    with pytest.raises(RewardError, match="query 0 does not start with its prompt"):
        source(["x"], ["y"], [None])


def test_build_reward_source(dict_file, reward_models, prepared):
    assert isinstance(build_reward_source(remote_url=dict_file), RewardFile)
    remote = build_reward_source(remote_url="http://127.0.0.1:5000/get_reward,http://127.0.0.1:5001/get_reward")
    assert isinstance(remote, RemoteReward) and len(remote.urls) == 2
    assert isinstance(build_reward_source(task="addition"), VerifierSource)
    one = build_reward_source([reward_models[0]], batch_size=4)
    assert isinstance(one, RewardModelSource)
    both = build_reward_source(",".join(reward_models))
    raw, responses = ["add 1+2=", "add 3+4="], ["3", "7"]
    kwargs = {"raw_prompts": raw, "responses": responses}
    q, p, lab = ["a", "b"], ["a", "b"], [None, None]
    separate = [build_reward_source([m])(q, p, lab, **kwargs).rewards for m in reward_models]
    assert torch.allclose(both(q, p, lab, **kwargs).rewards, separate[0] + separate[1], atol=1e-5)
    mean = build_reward_source(reward_models, reduce="mean")
    assert torch.allclose(mean(q, p, lab, **kwargs).rewards, (separate[0] + separate[1]) / 2, atol=1e-5)

    for bad, message in [({}, "give exactly one reward"),
                         ({"task": "addition", "remote_url": dict_file}, "got --reward.remote_url and --task"),
                         ({"task": "nope"}, "--task: unknown synthetic task"),
                         ({"remote_url": "ftp://x"}, "expected http:// or https://"),
                         ({"remote_url": dict_file, "normalize": True}, "--normalize_reward applies"),
                         ({"model_paths": [prepared["base"]], "normalize": True}, "reward_mean/reward_std")]:
        with pytest.raises(ConfigError, match=message):
            build_reward_source(**bad)


def test_serve_rm_flags_import_without_torch():
    """The CLI builds its parser with `add_serve_rm_arguments`: that must not cost a torch import."""
    import subprocess
    import sys

    code = "import sys, rlhf_core.rewards.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.stdout.strip() == "False"
