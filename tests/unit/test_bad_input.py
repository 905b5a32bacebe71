"""Bad input, as a new user gives it: one row per case, each run through the `rlhf` CLI in-process.

Every row must end with exit status 2, one `error:` line that names the file, row and key or
the flag (the row's fragments), no traceback, and nothing that looks finished: no `stage.json`
anywhere and no output folder. Rows stop before any training starts (validation comes first),
except the reward rows that need a reward to be asked for: those stop at the first rollout's
reward call, still before anything is saved. Each fragment is text only the validation writes,
so removing a check fails its row.
"""

from __future__ import annotations

import json
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from rlhf_core.cli import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROW = {"prompt": "add 1+1=", "response": "2"}
PAIR = {"prompt": "add 1+1=", "chosen": "2", "rejected": "3"}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


class Ctx:
    """What a row builds its command from: a fresh tmp folder, the prepared task, the reward server."""

    def __init__(self, tmp: Path, prepared: dict, server: str):
        self.tmp, self.prepared, self.server = tmp, prepared, server
        self.base = prepared["base"]
        self.out = str(tmp / "out")

    def file(self, name: str, rows=None, text: str | bytes | None = None) -> str:
        path = self.tmp / name
        if isinstance(text, bytes):
            path.write_bytes(text)
        elif text is not None:
            path.write_text(text)
        else:
            write_jsonl(path, rows if rows is not None else [ROW] * 8)
        return str(path)

    def sft(self, *flags: str, dataset: str | None = None) -> list[str]:
        return ["train", "sft", "--pretrain", self.base, "--dataset", dataset or self.file("good.jsonl"),
                "--save_path", self.out, "--train_batch_size", "2", "--micro_train_batch_size", "1",
                "--max_len", "64", "--use_mlflow", "false", *flags]

    def stage(self, stage: str, dataset: str, *flags: str) -> list[str]:
        return ["train", stage, "--pretrain", self.base, "--dataset", dataset, "--save_path", self.out,
                "--train_batch_size", "2", "--micro_train_batch_size", "1", "--max_len", "64",
                "--use_mlflow", "false", *flags]

    def ppo(self, *flags: str, prompts: str | None = None, pretrain: str | None = None,
            estimator: str = "reinforce", rollout_batch: int = 2) -> list[str]:
        return ["train", "ppo", "--pretrain", pretrain or self.base, "--prompt_data",
                prompts or f"json@{self.prepared['prompts']}", "--advantage_estimator", estimator,
                "--rollout_batch_size", str(rollout_batch), "--train_batch_size", "2",
                "--micro_train_batch_size", "2", "--generate_max_len", "2", "--init_kl_coef", "0",
                "--param_dtype", "fp32", "--max_steps", "1", "--max_samples", "4", "--use_mlflow", "false",
                "--save_path", self.out, *flags]

    def reward_file(self, body: str) -> str:
        return self.file("reward.py", text=body)

    def config(self, text: str) -> str:
        return self.file("config.yaml", text=text)

    def model_copy(self, *names: str) -> str:
        folder = self.tmp / "model"
        folder.mkdir()
        for name in names:
            shutil.copy(Path(self.base) / name, folder / name)
        return str(folder)


REWARD = "def reward_func(queries, prompts, labels, **kwargs):\n    return {}\n"

# id -> (ctx -> (argv, fragments the one error line must hold))
CASES = {
    # --- data rows -------------------------------------------------------------------------------
    "row-missing-key": lambda c: (c.sft(dataset=c.file("d.jsonl", [{"question": "q", "response": "r"}])),
                                  ["d.jsonl", "row 1", "missing key 'prompt'"]),
    "row-null": lambda c: (c.sft(dataset=c.file("d.jsonl", [ROW, {"prompt": "a", "response": None}])),
                           ["d.jsonl", "row 2", "missing value for key 'response'"]),
    "row-wrong-type": lambda c: (c.sft(dataset=c.file("d.jsonl", [ROW, {"prompt": 3, "response": "b"}])),
                                 ["d.jsonl", "row 2", "key 'prompt' must be a string, got int"]),
    "row-empty-text": lambda c: (c.sft(dataset=c.file("d.jsonl", [ROW, {"prompt": "a", "response": "  "}])),
                                 ["d.jsonl", "row 2", "key 'response' is empty"]),
    "row-not-utf8": lambda c: (c.sft(dataset=c.file("d.jsonl", text=b'{"prompt": "a", "response": "b"}\n'
                                                    b'{"prompt": "\xff\xfe", "response": "b"}\n')),
                               ["d.jsonl", "line 2", "not valid UTF-8"]),
    "row-truncated-json": lambda c: (c.sft(dataset=c.file("d.jsonl", text='{"prompt": "a", "response": "b"}\n'
                                                          '{"prompt": "a", "resp\n')),
                                     ["d.jsonl", "line 2", "not valid JSON"]),
    "row-not-an-object": lambda c: (c.sft(dataset=c.file("d.jsonl", [ROW, '["a", "b"]'])),
                                    ["d.jsonl", "line 2", "expected a JSON object"]),
    "row-a-dict-for-text": lambda c: (c.sft(dataset=c.file("d.jsonl", [ROW, {"prompt": {"text": "a"}, "response": "b"}])),
                                      ["d.jsonl", "row 2", "key 'prompt' must be a string, got dict"]),
    "row-over-long": lambda c: (c.sft("--max_len", "12", dataset=c.file("d.jsonl", [ROW, {"prompt": "add 1+1=",
                                                                                         "response": "9" * 40}])),
                                ["d.jsonl", "row 2", "longer than --max_len 12"]),
    "row-chat-messages-malformed": lambda c: (c.sft("--apply_chat_template", dataset=c.file(
        "d.jsonl", [{"prompt": [{"role": "user"}], "response": "2"}])),
        ["d.jsonl", "row 1", "key 'prompt' must be a non-empty list of {role, content} messages"]),
    "dpo-row-missing-rejected": lambda c: (c.stage("dpo", c.file("p.jsonl", [PAIR, {"prompt": "a", "chosen": "b"}])),
                                           ["p.jsonl", "row 2", "missing value for key 'rejected'"]),
    "rm-margin-wrong-type": lambda c: (c.stage("rm", c.file("p.jsonl", [{**PAIR, "margin": "big"}]), "--margin_key",
                                               "margin"), ["p.jsonl", "row 1", "key 'margin' must be int/float, got str"]),
    "kto-label-wrong-type": lambda c: (c.stage("kto", c.file("k.jsonl", [{**ROW, "label": True},
                                                                          {**ROW, "label": "yes"}])),
                                       ["k.jsonl", "row 2", "key 'label' must be bool, got str"]),
    "ppo-prompts-without-answers": lambda c: (c.ppo("--task", "addition",
                                                    prompts=c.file("q.jsonl", [{"prompt": "add 1+1="}] * 4)),
                                              ["q.jsonl", "row 1", "missing key 'answer'"]),
    "eval-prompts-missing-key": lambda c: (["eval", "--pretrain", c.base, "--dataset", c.file("q.jsonl", [{"q": "1"}]),
                                            "--task", "addition", "--save_path", c.out, "--use_mlflow", "false"],
                                           ["q.jsonl", "row 1", "missing key 'prompt'"]),
    # --- files -----------------------------------------------------------------------------------
    "file-empty": lambda c: (c.sft(dataset=c.file("d.jsonl", text="")), ["d.jsonl", "no rows", "empty"]),
    "file-blank-lines-only": lambda c: (c.sft(dataset=c.file("d.jsonl", text="\n  \n\n")),
                                        ["d.jsonl", "no rows", "blank lines"]),
    "file-missing": lambda c: (c.sft(dataset=str(c.tmp / "nope.jsonl")), ["nope.jsonl", "no such file"]),
    "file-unknown-extension": lambda c: (c.sft(dataset=c.file("d.csv", text="prompt,response\na,b\n")),
                                         ["d.csv", "unsupported file type '.csv'"]),
    "file-corrupt-parquet": lambda c: (c.sft(dataset=c.file("d.parquet", text="PAR1 not really")),
                                       ["d.parquet: not a parquet file (ArrowInvalid"]),
    "file-parquet-no-rows": lambda c: (c.sft(dataset=_empty_parquet(c.tmp / "d.parquet")),
                                       ["d.parquet", "no rows (a table of 0 rows)"]),
    "file-json-document-broken": lambda c: (c.sft(dataset=c.file("d.json", text='[{"prompt": "a", "response": "b"},\n'
                                                                 ' {"prompt": "a",\n')),
                                            ["d.json", "line 3", "not valid JSON"]),
    "folder-json-at-empty": lambda c: (c.sft(dataset=f"json@{_folder(c.tmp / 'data')}"),
                                       ["json@", "neither train.jsonl nor test.jsonl"]),
    "folder-json-at-a-file": lambda c: (c.sft(dataset=f"json@{c.file('d.jsonl')}"), ["d.jsonl", "is not a directory"]),
    "folder-without-data-files": lambda c: (c.sft(dataset=_folder(c.tmp / "data")),
                                            ["data", "directory without train/test"]),
    # --- dataset specs and splits ----------------------------------------------------------------
    "split-unknown": lambda c: (c.sft("--dataset_split", "bogus"), ["good.jsonl", "no 'bogus' split",
                                                                    "--dataset_split bogus"]),
    "eval-split-unknown": lambda c: (c.sft("--eval_dataset", f"json@{c.prepared['sft']}", "--eval_split", "bogus"),
                                     ["no 'bogus' split", "--eval_split bogus"]),
    "ppo-prompt-split-unknown": lambda c: (c.ppo("--task", "addition", "--prompt_split", "bogus"),
                                           ["no 'bogus' split", "splits there: test, train"]),
    "dataset-spec-empty": lambda c: (c.sft(dataset=" , "), ["--dataset", "names no dataset"]),
    # --- mixing probabilities --------------------------------------------------------------------
    "probs-count": lambda c: (c.sft("--dataset_probs", "1", dataset=f"{c.file('a.jsonl')},{c.file('b.jsonl')}"),
                              ["dataset_probs has 1 values for 2 datasets"]),
    "probs-not-numbers": lambda c: (c.sft("--dataset_probs", "half,half", dataset=f"{c.file('a.jsonl')},{c.file('b.jsonl')}"),
                                    ["dataset_probs must be numbers"]),
    "probs-negative": lambda c: (c.sft("--dataset_probs=-1,2", dataset=f"{c.file('a.jsonl')},{c.file('b.jsonl')}"),
                                 ["dataset_probs must be finite, non-negative"]),
    "probs-nan": lambda c: (c.sft("--dataset_probs", "nan,1", dataset=f"{c.file('a.jsonl')},{c.file('b.jsonl')}"),
                            ["dataset_probs must be finite", "'nan,1'"]),
    # --- flags -----------------------------------------------------------------------------------
    "flag-out-of-range": lambda c: (c.sft("--zero_stage", "4"), ["--zero_stage", "less than or equal to 3"]),
    "flag-batch-sizes-inconsistent": lambda c: (c.sft("--train_batch_size", "3", "--micro_train_batch_size", "2"),
                                                ["--train_batch_size) (3) must be a multiple of --train.micro_batch_size"]),
    "flag-unknown": lambda c: (c.sft("--no_such_flag", "1"), ["unrecognized arguments: --no_such_flag"]),
    "flag-not-a-number": lambda c: (c.sft("--learning_rate", "fast"), ["--learning_rate", "invalid float value"]),
    "flag-max-len-too-small": lambda c: (c.sft("--max_len", "1"), ["--max_len", "greater than 1"]),
    "flag-input-template-without-slot": lambda c: (c.sft("--input_template", "Q: {question} A:"),
                                                   ["input_template must contain '{}'"]),
    "flag-input-template-extra-field": lambda c: (c.sft("--input_template", "Q: {} {name}"),
                                                  ["input_template", "cannot format a prompt", "KeyError"]),
    "flag-chat-template-malformed": lambda c: (c.sft("--apply_chat_template", "--tokenizer_chat_template",
                                                     "{% for m in messages %}{{ m.content }}"),
                                               ["--tokenizer_chat_template", "cannot be rendered", "endfor"]),
    "flag-bf16-contradicts-dtype": lambda c: (c.sft("--bf16", "--param_dtype", "fp32"),
                                              ["--bf16 already set --ds.param_dtype to 'bf16'; give one of its spellings"]),
    "flag-pretrain-missing": lambda c: (c.sft("--pretrain", str(c.tmp / "no_model")),
                                       ["--pretrain", "no_model", "no such model directory"]),
    "flag-pretrain-a-file": lambda c: (c.sft("--pretrain", c.file("weights.bin", text="x")),
                                       ["--pretrain", "weights.bin", "not a directory"]),
    "flag-pretrain-empty-folder": lambda c: (c.sft("--pretrain", _folder(c.tmp / "m")),
                                            ["--pretrain", "no config.json there"]),
    "flag-pretrain-not-a-model": lambda c: (c.sft("--pretrain", _folder(c.tmp / "m", {"config.json": "{}"})),
                                           ["--pretrain", "config.json does not describe a model"]),
    "flag-pretrain-without-tokenizer": lambda c: (c.sft("--pretrain", c.model_copy("config.json", "model.safetensors")),
                                                 ["--pretrain", "no tokenizer there"]),
    "flag-ref-pretrain-missing": lambda c: (c.stage("dpo", c.file("p.jsonl", [PAIR] * 4), "--ref_pretrain",
                                                    str(c.tmp / "no_ref")), ["--ref_pretrain", "no such model directory"]),
    "ppo-actor-missing": lambda c: (c.ppo("--task", "addition", pretrain=str(c.tmp / "no_actor")),
                                    ["--actor.model_name_or_path", "no such model directory"]),
    "ppo-group-estimator-one-sample": lambda c: (c.ppo("--task", "addition", estimator="group_norm"),
                                                 ["--algo.advantage.estimator group_norm needs "
                                                  "--rollout.n_samples_per_prompt > 1"]),
    "ppo-two-reward-sources": lambda c: (c.ppo("--task", "addition", "--remote_rm_url", "http://127.0.0.1:1/x"),
                                         ["give one reward source"]),
    "eval-pretrain-missing": lambda c: (["eval", "--pretrain", str(c.tmp / "no_policy"), "--dataset",
                                         c.prepared["prompts_test"], "--task", "addition", "--save_path", c.out],
                                        ["--pretrain", "no such model directory"]),
    "pairs-verifier-without-task": lambda c: (["pairs", "--pretrain", c.base, "--dataset", c.prepared["prompts_test"],
                                               "--max_new_tokens", "4", "--save_path", c.out],
                                              ["--reward verifier needs --task"]),
    # --- config files ----------------------------------------------------------------------------
    "yaml-malformed": lambda c: (c.sft("--config", c.config("learning_rate: 1e-4\nmax_len: [64\n")),
                                 ["config.yaml", "not valid YAML at line"]),
    "yaml-unknown-key": lambda c: (c.sft("--config", c.config("lerning_rate: 1e-4\n")),
                                   ["--lerning_rate: unknown field"]),
    "yaml-not-a-mapping": lambda c: (c.sft("--config", c.config("- learning_rate\n")),
                                     ["config.yaml", "expected a mapping"]),
    "yaml-missing": lambda c: (c.sft("--config", str(c.tmp / "none.yaml")), ["--config", "file not found"]),
    "yaml-wrong-type": lambda c: (c.sft("--config", c.config("learning_rate: fast\n")),
                                  ["--learning_rate", "'fast'"]),
    "ppo-yaml-unknown-key": lambda c: (c.ppo("--task", "addition", "--config", c.config("actor: {adam: {lrr: 1}}\n")),
                                       ["--actor.adam.lrr: unknown field"]),
    # --- pipeline parameters (flows/params.py's models, through `rlhf pipeline run --config`) ------
    "pipeline-prep-n-train-zero": lambda c: (["pipeline", "run", "--config", c.config("prep: {n_train: 0}\n")],
                                             ["prep.n_train", "greater than 0"]),
    "pipeline-unknown-stage": lambda c: (["pipeline", "run", "--config", c.config("settings: {stages: [sft, rl]}\n")],
                                         ["settings.stages"]),
    "pipeline-unknown-section": lambda c: (["pipeline", "run", "--config", c.config("sfft: {}\n")],
                                           ["unknown section", "sfft"]),
    "pipeline-stage-unknown-key": lambda c: (["pipeline", "run", "--config", c.config("dpo: {betta: 0.2}\n")],
                                             ["section dpo", "--betta: unknown field"]),
    # --- rlhf prep -------------------------------------------------------------------------------
    "prep-n-train-zero": lambda c: (["prep", "--out", c.out, "--n_train", "0"], ["--n_train", "got 0"]),
    "prep-n-test-negative": lambda c: (["prep", "--out", c.out, "--n_test", "-5"], ["--n_test", "got -5"]),
    "prep-unknown-task": lambda c: (["prep", "--out", c.out, "--task", "divide"], ["--task", "'divide'"]),
    "prep-demo-error-rate": lambda c: (["prep", "--out", c.out, "--demo_error_rate", "1.5"],
                                       ["--demo_error_rate", "[0, 1)"]),
    # --- reward files (--reward.remote_url x.py): checked before any model loads, or at the first call
    "reward-file-missing": lambda c: (c.ppo("--remote_rm_url", str(c.tmp / "none.py")), ["none.py", "no such file"]),
    "reward-file-no-reward-func": lambda c: (c.ppo("--remote_rm_url", c.reward_file("def reward(q, p, l):\n    pass\n")),
                                             ["reward.py", "defines no reward_func"]),
    "reward-file-syntax-error": lambda c: (c.ppo("--remote_rm_url", c.reward_file("def reward_func(q, p, l:\n")),
                                           ["reward.py", "importing it raised SyntaxError"]),
    "reward-file-raises": lambda c: (c.ppo("--remote_rm_url", c.reward_file(REWARD.replace(
        "return {}", "raise RuntimeError('judge down')"))), ["reward.py", "reward_func raised RuntimeError: judge down"]),
    "reward-file-wrong-length": lambda c: (c.ppo("--remote_rm_url", c.reward_file(REWARD.replace("{}", "[1.0]"))),
                                           ["reward.py", "rewards has shape (1,), expected (2,)"]),
    "reward-file-nan": lambda c: (c.ppo("--remote_rm_url", c.reward_file(REWARD.replace(
        "{}", "[float('nan')] * len(queries)"))), ["reward.py", "rewards[0] is nan"]),
    "reward-file-wrong-type": lambda c: (c.ppo("--remote_rm_url", c.reward_file(REWARD.replace("{}", "'good'"))),
                                         ["reward.py", "rewards must be a tensor or a list of 2 numbers, got str"]),
    # --- reward server answers -------------------------------------------------------------------
    "reward-server-malformed-json": lambda c: (c.ppo("--remote_rm_url", f"{c.server}/malformed"),
                                               ["/malformed", "the answer is not valid JSON"]),
    "reward-server-wrong-length": lambda c: (c.ppo("--remote_rm_url", f"{c.server}/short"),
                                             ["/short", "rewards has shape (1,), expected (2,)"]),
    "reward-server-http-400": lambda c: (c.ppo("--remote_rm_url", f"{c.server}/e400"),
                                         ["/e400", "HTTP 400", "labels missing"]),
    "reward-server-http-401": lambda c: (c.ppo("--remote_rm_url", f"{c.server}/e401"),
                                         ["/e401", "HTTP 401", "RLHF_RM_TOKEN"]),
    # --- too little data -------------------------------------------------------------------------
    "sft-fewer-examples-than-a-batch": lambda c: (c.sft("--train_batch_size", "16", dataset=c.file("d.jsonl", [ROW] * 4)),
                                                  ["--dataset", "fewer than one global batch"]),
    "ppo-fewer-prompts-than-a-rollout-batch": lambda c: (c.ppo("--task", "addition", rollout_batch=8),
                                                         ["usable prompts, fewer than one rollout batch"]),
}

PARAMS = [pytest.param(case, CASES[case], id=case) for case in CASES]


def _folder(path: Path, files: dict[str, str] | None = None) -> str:
    path.mkdir()
    for name, text in (files or {}).items():
        (path / name).write_text(text)
    return str(path)


def _empty_parquet(path: Path) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "response": pa.array([], pa.string())}), path)
    return str(path)


class _RewardServer(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        n = len(json.loads(self.rfile.read(int(self.headers["Content-Length"])))["query"])
        status, body = {"/malformed": (200, b'{"rewards": [1.0, '),
                        "/short": (200, json.dumps({"rewards": [1.0] * (n - 1)}).encode()),
                        "/e400": (400, b'{"error": "labels missing"}'),
                        "/e401": (401, b'{"error": "unauthorized"}')}[self.path]
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def reward_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RewardServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize("case,build", PARAMS)
def test_bad_input_exits_2_with_one_line_naming_it(case, build, tmp_path, prepared, reward_server, capsys, monkeypatch):
    monkeypatch.delenv("RLHF_RM_TOKEN", raising=False)
    monkeypatch.delenv("RLHF_RM_TOKEN_FILE", raising=False)
    argv, fragments = build(Ctx(tmp_path, prepared, reward_server))
    try:
        code, err = run_cli(argv, capsys)
    except Exception as e:  # a known gap raises (a traceback for the user): a failed row, not an error
        pytest.fail(f"{case}: raised {type(e).__name__}: {e}")
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if "error:" in line]
    assert code == 2, err[-3000:]
    assert len(errors) == 1, err[-3000:]
    assert all(f in errors[0] for f in fragments), (fragments, errors[0])
    assert not list(tmp_path.rglob("stage.json")), "something looks finished"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_enough_distinct_cases():
    assert len(CASES) >= 30


def test_an_eval_dataset_file_is_its_own_held_out_split(tmp_path, prepared):
    """`--eval_dataset held_out.jsonl` (one file: a 'train' split only) is evaluated on, as `rlhf eval`
    reads it, instead of silently giving no evaluation; a folder without the split is an error."""
    from rlhf_core.config import DataConfig
    from rlhf_core.data.examples import load_sft
    from rlhf_core.data.loading import DataError
    from rlhf_core.models.loading import load_tokenizer

    tok = load_tokenizer(prepared["base"])
    train = write_jsonl(tmp_path / "train.jsonl", [ROW] * 5)
    held_out = write_jsonl(tmp_path / "held_out.jsonl", [{"prompt": "add 2+2=", "response": "4"}] * 3)
    examples, described = load_sft(DataConfig(dataset=str(train)), tok, "test", 0, eval_dataset=str(held_out))
    assert len(examples) == 3 and described[0]["path"] == str(held_out)
    assert load_sft(DataConfig(dataset=str(train)), tok, "test", 0) == (None, [])  # no held-out data: no eval
    with pytest.raises(DataError, match="no 'test' split"):
        load_sft(DataConfig(dataset=str(train)), tok, "test", 0,
                 eval_dataset=f"json@{_folder(tmp_path / 'd', {'train.jsonl': ''})}")


def test_unreachable_reward_server_is_a_retryable_failure(tmp_path, prepared, capsys, monkeypatch):
    """The counterpart: a server that never answers is an infrastructure failure, exit 1 (retried by a
    pipeline), not bad input."""
    from rlhf_core.rewards.remote import RemoteReward

    monkeypatch.setattr(RemoteReward, "__init__", _fast_retries(RemoteReward.__init__))
    code, err = run_cli(Ctx(tmp_path, prepared, "").ppo("--remote_rm_url", "http://127.0.0.1:9/get_reward"), capsys)
    assert code == 1 and "Traceback" not in err
    assert "failed 2 times" in err.splitlines()[-1]
    assert not list(tmp_path.rglob("stage.json"))


def _fast_retries(init):
    def patched(self, url, timeout=180.0, retries=4, backoff=1.0, max_backoff=30.0, chunk_size=None):
        init(self, url, timeout=2.0, retries=1, backoff=0.0, max_backoff=0.0, chunk_size=chunk_size)

    return patched
