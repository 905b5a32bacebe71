"""`rlhf eval`: the pure metrics, policies side by side on tiny models, outputs, MLflow, errors."""

import json
import re
import shutil

import pytest
import torch

from rlhf_core.cli import main
from rlhf_core.config import EvalConfig
from rlhf_core.infra.settings import ConfigError
from rlhf_core.models.loading import load_causal_lm, load_reward_model, load_tokenizer
from rlhf_core.stages.evaluation import (
    format_eval_markdown,
    k1_kl,
    mean_pass_at_k,
    pass_at_k,
    read_eval_report,
    response_logprobs,
    sampled_accuracy,
    win_rate,
)

N_PROMPTS = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(prepared, tmp_path_factory):
    """A reward model (random head), a second policy (another seed) and a copy of it that the
    scripted engine below answers for, next to the prepared base."""
    from rlhf_core.models.tiny import build_tiny_llama

    root = tmp_path_factory.mktemp("eval_models")
    tok = load_tokenizer(prepared["base"])
    torch.manual_seed(0)
    rm = load_reward_model(prepared["base"], tok.pad_token_id)
    rm.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    other = build_tiny_llama(tok, seed=1)
    other.save_pretrained(root / "other")
    tok.save_pretrained(root / "other")
    shutil.copytree(root / "other", root / "scripted")
    return {"rm": str(root / "rm"), "other": str(root / "other"), "scripted": str(root / "scripted")}


def run_cli(args, capsys):
    code = main(["eval", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


# --- pure metrics --------------------------------------------------------------------------------


def test_win_rate_counts_ties_as_half():
    assert win_rate([2.0, 2.0, 3.0, 0.0], [1.0, 1.0, 4.0, 0.0]) == pytest.approx((1 + 1 + 0 + 0.5) / 4)
    assert win_rate([1.0, 1.0, 4.0, 0.0], [2.0, 2.0, 3.0, 0.0]) == pytest.approx((0 + 0 + 1 + 0.5) / 4)  # the other way
    with pytest.raises(ValueError):
        win_rate([1.0], [])


def test_k1_kl_is_the_mean_summed_log_ratio():
    assert k1_kl(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0])) == pytest.approx(0.0)
    assert k1_kl(torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -4.0])) == pytest.approx(2.0)


def test_pass_at_k_hand_values():
    # n = k: the plain definition, any of the k samples correct.
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 4, 4) == 1.0
    # n > k: 1 - C(n-c, k) / C(n, k).
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the fraction correct
    assert pass_at_k(10, 1, 5) == pytest.approx(0.5)  # C(9,5)/C(10,5) = 126/252
    assert pass_at_k(6, 5, 2) == 1.0  # fewer than k wrong: every draw of 2 holds a correct one
    assert mean_pass_at_k([[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], 4) == pytest.approx(2 / 3)
    assert mean_pass_at_k([[1, 0, 0, 0], [0, 1, 1, 0]], 2) == pytest.approx((0.5 + (1 - 1 / 6)) / 2)
    for bad in ((4, 5, 2), (4, 1, 5), (4, 1, 0)):
        with pytest.raises(ValueError):
            pass_at_k(*bad)


def test_sampled_accuracy_is_the_mean_over_samples_and_prompts():
    assert sampled_accuracy([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]) == pytest.approx((0.25 + 0.5 + 0) / 3)
    assert sampled_accuracy([[1.0]]) == 1.0
    with pytest.raises(ValueError):
        sampled_accuracy([[1, 0], []])


def test_response_logprobs_are_exact_and_padding_free(prepared):
    model = load_causal_lm(prepared["base"]).eval()
    tok = load_tokenizer(prepared["base"])
    prompts = [[1, 3, 40, 41], [1, 3, 42]]
    responses = [[50, 51, 2], [52]]
    batched = response_logprobs(model, prompts, responses, tok.pad_token_id)
    one_by_one = torch.cat([response_logprobs(model, [p], [r], tok.pad_token_id, batch_size=1)
                            for p, r in zip(prompts, responses, strict=True)])
    assert torch.allclose(batched, one_by_one, atol=1e-5)
    with torch.no_grad():
        ids = torch.tensor([prompts[0] + responses[0]])
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        manual = sum(logp[t - 1, ids[0, t]].item() for t in range(len(prompts[0]), ids.shape[1]))
    assert batched[0].item() == pytest.approx(manual, abs=1e-4)


# --- engines the end-to-end tests watch ------------------------------------------------------------


def _oracle_correct(prompt_index: int, sample: int) -> bool:
    """The scripted policy: right when greedy; sample j of prompt i right when j < i % 3."""
    return sample < prompt_index % 3


@pytest.fixture
def watched_engines(monkeypatch, models):
    """Real transformers engines that record their calls; the model at models["scripted"] answers
    addition prompts by the rule of `_oracle_correct` (the real model still scores the KL)."""
    import rlhf_core.rollout as rollout
    from rlhf_core.rollout import TransformersEngine
    from rlhf_core.rollout.base import Sample

    calls: list[tuple[str, int, float]] = []

    class Watched(TransformersEngine):
        path = ""

        def generate_ids(self, prompt_ids, n=1, temperature=0.0, max_new_tokens=64, seed=0):
            calls.append((self.path, n, temperature))
            if self.path != models["scripted"]:
                return super().generate_ids(prompt_ids, n, temperature, max_new_tokens, seed)
            out = []
            for i, ids in enumerate(prompt_ids):
                a, b = map(int, re.search(r"(\d+)\s*\+\s*(\d+)", self.tokenizer.decode(ids)).groups())
                right, wrong = (self.tokenizer(str(x), add_special_tokens=False)["input_ids"] + [self.eos_ids[0]]
                                for x in (a + b, a + b + 1))
                group = [right if temperature == 0 or _oracle_correct(i, j) else wrong for j in range(n)]
                out.append([Sample(tuple(r), (0.0,) * len(r), True) for r in group])
            return out

    def make_engine(path, backend="auto", add_special_tokens=False):
        engine = Watched.from_pretrained(path, add_special_tokens=add_special_tokens)
        engine.path = path
        return engine

    monkeypatch.setattr(rollout, "make_engine", make_engine)
    return calls


# --- `rlhf eval` end to end ----------------------------------------------------------------------


def test_eval_of_a_model_against_itself(prepared, models, tmp_path, capsys, watched_engines):
    out = tmp_path / "eval"
    code, stdout, err = run_cli(["--pretrain", prepared["base"], "--ref_pretrain", prepared["base"],
                                 "--reward_pretrain", models["rm"], "--dataset", f"json@{prepared['prompts']}",
                                 "--task", "addition", "--max_samples", str(N_PROMPTS), "--n_samples_per_prompt", "2",
                                 "--save_path", str(out), "--mlflow_run_name", "eval-self"], capsys)
    assert code == 0, err
    # One engine for a model given twice; the samples at temperature 1 serve accuracy, pass@k and KL.
    assert watched_engines == [(prepared["base"], 1, 0.0), (prepared["base"], 2, 1.0)]
    manifest = json.loads(stdout)
    assert manifest == json.loads((out / "stage.json").read_text())
    assert manifest["stage"] == "eval" and manifest["config_hash"].startswith("sha256:")
    assert manifest["inputs"]["datasets"][0]["split"] == "test"  # json@DIR: the held-out split
    assert manifest["inputs"]["policies"] == [{"name": "policy", "uri": prepared["base"]}]
    report = read_eval_report(str(out))
    m = report["metrics"]
    assert set(m) == {f"eval/{who}/{metric}" for who in ("policy", "reference")
                      for metric in ("greedy_accuracy", "sampled_accuracy", "pass_at_2", "reward", "response_len")
                      } | {"eval/policy/win_rate", "eval/policy/kl"}
    assert m["eval/policy/win_rate"] == 0.5 and m["eval/policy/kl"] == 0.0
    assert m["eval/policy/greedy_accuracy"] == 0.0 and m["eval/reference/sampled_accuracy"] == 0.0  # random model
    assert m["eval/policy/reward"] == m["eval/reference/reward"]
    assert 1 <= m["eval/policy/response_len"] <= 5  # addition: at most 4 answer tokens + EOS
    assert manifest["metrics"] == m and report["num_prompts"] == N_PROMPTS and report["num_kl_samples"] == 16
    from transformers import AutoModelForCausalLM

    tiny = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(prepared["base"]).parameters())
    assert report["policies"] == [{"name": "policy", "uri": prepared["base"], "parameters": tiny}]
    assert report["reference_parameters"] == tiny and report["n_samples_per_prompt"] == 2
    assert len(report["samples"]) == 5
    assert set(report["samples"][0]["responses"]) == {"policy", "reference"}
    assert {"text", "score", "correct", "sampled_correct"} == set(report["samples"][0]["responses"]["policy"])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary output left behind"

    import mlflow

    from rlhf_core.infra.settings import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    run = mlflow.get_run(manifest["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["rlhf.stage"] == "eval"
    assert run.data.metrics["eval/policy/win_rate"] == 0.5 and run.data.metrics["eval/policy/kl"] == 0.0
    assert run.data.metrics["eval/reference/pass_at_2"] == 0.0
    assert run.data.tags["rlhf.output_uri"] == str(out.resolve())

    markdown = format_eval_markdown(report)
    assert "| greedy accuracy (verifier) | 0.0% | 0.0% |" in markdown and "| 50.0% | — |" in markdown


def test_policies_side_by_side(prepared, models, tmp_path, capsys, watched_engines, monkeypatch):
    """Two different policies against one reference: the names are the report's, the numbers differ,
    and the scripted policy's accuracies are the ones its rule gives (sampled at T=0.5, so the KL
    samples at temperature 1 are drawn apart). Each win rate is the policy's scores against the
    reference's, in that order."""
    from rlhf_core.stages import evaluation

    compared = []
    monkeypatch.setattr(evaluation, "win_rate", lambda p, r: compared.append((p, r)) or win_rate(p, r))
    out = tmp_path / "eval"
    k = 4
    code, stdout, err = run_cli(["--pretrain", f"{models['other']},{models['scripted']}", "--policy_names",
                                 "rival,oracle", "--ref_pretrain", prepared["base"], "--reward_pretrain", models["rm"],
                                 "--dataset", prepared["prompts_test"], "--task", "addition", "--max_samples",
                                 str(N_PROMPTS), "--n_samples_per_prompt", str(k), "--temperature", "0.5",
                                 "--save_path", str(out), "--use_mlflow", "false"], capsys)
    assert code == 0, err
    # Policies first, the reference last; one engine each, KL samples at temperature 1 apart from T=0.5.
    assert [c[0] for c in watched_engines] == [models["other"]] * 3 + [models["scripted"]] * 3 + [prepared["base"]] * 2
    assert {c[1:] for c in watched_engines} == {(1, 0.0), (k, 0.5), (k, 1.0)}
    assert (prepared["base"], k, 1.0) not in watched_engines  # the reference samples at T=0.5 only
    m = json.loads(stdout)["metrics"]
    per_model = {"greedy_accuracy", "sampled_accuracy", "pass_at_4", "reward", "response_len"}
    assert set(m) == ({f"eval/{who}/{x}" for who in ("rival", "oracle", "reference") for x in per_model}
                      | {f"eval/{who}/{x}" for who in ("rival", "oracle") for x in ("win_rate", "kl")})
    # The rule of the scripted policy, by hand: prompt i has i % 3 of its 4 samples right.
    counts = [i % 3 for i in range(N_PROMPTS)]
    assert m["eval/oracle/greedy_accuracy"] == 1.0
    assert m["eval/oracle/sampled_accuracy"] == pytest.approx(sum(c / k for c in counts) / N_PROMPTS)
    assert m["eval/oracle/pass_at_4"] == pytest.approx(sum(c > 0 for c in counts) / N_PROMPTS)
    assert m["eval/rival/greedy_accuracy"] == 0.0 and m["eval/rival/pass_at_4"] == 0.0
    for metric in ("reward", "kl", "response_len"):
        assert m[f"eval/oracle/{metric}"] != m[f"eval/rival/{metric}"]
    assert m["eval/rival/kl"] > 0.1  # two random models disagree (the scripted one does not sample its own
    # distribution, so its k1 estimate may have any sign)
    assert len(compared) == 2
    for name, (policy, reference) in zip(("rival", "oracle"), compared, strict=True):
        assert sum(policy) / len(policy) == pytest.approx(m[f"eval/{name}/reward"])
        assert sum(reference) / len(reference) == pytest.approx(m["eval/reference/reward"])
        assert m[f"eval/{name}/reward"] != m["eval/reference/reward"]  # so the two orders differ
        assert m[f"eval/{name}/win_rate"] == win_rate(policy, reference)
    report = read_eval_report(str(out))
    assert [(p["name"], p["uri"]) for p in report["policies"]] == [("rival", models["other"]),
                                                                   ("oracle", models["scripted"])]
    oracle_rows = [row["responses"]["oracle"] for row in report["samples"]]
    assert [r["sampled_correct"] for r in oracle_rows] == counts[:5] and all(r["correct"] for r in oracle_rows)

    markdown = format_eval_markdown(report)
    assert "| metric | `rival` | `oracle` | `reference` |" in markdown
    assert f"| pass@4 (T=0.5) | 0.0% | {m['eval/oracle/pass_at_4']:.1%} | 0.0% |" in markdown
    assert f"| KL(policy ‖ reference), nats (k1, T=1) | {m['eval/rival/kl']:.4f} | " in markdown
    assert re.search(r"\| win rate vs reference .*\| — \|$", markdown, re.M)


def test_eval_without_reference_reports_the_policies_only(prepared, models, tmp_path, capsys):
    code, stdout, err = run_cli(["--pretrain", f"{prepared['base']},{models['other']}", "--dataset",
                                 prepared["prompts_test"], "--max_new_tokens", "4", "--max_samples", "4",
                                 "--save_path", str(tmp_path / "e"), "--use_mlflow", "false",
                                 "--rollout_backend", "transformers"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "e" / "eval.json").read_text())
    # No task, no reward model, no reference: nothing to sample; default names policy1, policy2.
    assert set(report["metrics"]) == {"eval/policy1/response_len", "eval/policy2/response_len"}
    assert "| response length (tokens, greedy) |" in format_eval_markdown(report)


@pytest.mark.parametrize("names,message", [
    ("a", "--policy_names: 1 names (a) for 2 --pretrain models"),
    ("a,a", "--policy_names: a given more than once"),
    ("a,reference", "--policy_names: 'reference' is reserved"),
    ("a,b/c", "--policy_names: 'b/c' is not a valid name"),
])
def test_bad_policy_names_exit_2(prepared, models, tmp_path, capsys, names, message):
    code, _, err = run_cli(["--pretrain", f"{prepared['base']},{models['other']}", "--policy_names", names,
                            "--dataset", prepared["prompts_test"], "--task", "addition", "--save_path",
                            str(tmp_path / "out"), "--use_mlflow", "false"], capsys)
    assert code == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_n_kl_samples_is_the_older_spelling_of_n_samples_per_prompt():
    assert EvalConfig(task="addition", n_kl_samples=3).n_samples_per_prompt == 3
    assert EvalConfig(task="addition", n_kl_samples=3, n_samples_per_prompt=3).n_samples_per_prompt == 3
    with pytest.raises(ValueError, match="older spelling"):
        EvalConfig(task="addition", n_kl_samples=3, n_samples_per_prompt=2)
    cfg = EvalConfig(task="addition", policy_names="a,b")  # a pipeline fills pretrain in later
    with pytest.raises(ConfigError, match="2 names"):
        cfg.model_copy(update={"pretrain": "x"}).policies()


def test_bad_prompts_file_exits_2_naming_file_row_and_key(prepared, tmp_path, capsys):
    bad = tmp_path / "prompts.jsonl"
    bad.write_text(json.dumps({"prompt": "add 1+2=", "answer": "3"}) + "\n" + json.dumps({"answer": "4"}) + "\n")
    code, _, err = run_cli(["--pretrain", prepared["base"], "--dataset", str(bad), "--task", "addition",
                            "--save_path", str(tmp_path / "out"), "--use_mlflow", "false"], capsys)
    assert code == 2
    assert str(bad) in err and "row 2" in err and "'prompt'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args,message", [
    (["--max_samples", "2"], "--max_new_tokens is required without --task"),
    (["--task", "addition", "--rollout_backend", "vllm"], "--rollout_backend vllm: vLLM is not installed"),
    (["--task", "nope"], "--task: unknown synthetic task 'nope'"),
    (["--task", "addition", "--n_samples_per_prompt", "0"], "--n_samples_per_prompt"),
])
def test_config_errors_exit_2(prepared, tmp_path, capsys, args, message, monkeypatch):
    import rlhf_core.rollout as rollout

    # vLLM's CPU build is installed here (and must never start in this process: it initialises
    # torch.distributed for the whole process): the error is the one a machine without it gives
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    code, _, err = run_cli(["--pretrain", prepared["base"], "--dataset", prepared["prompts_test"], "--save_path",
                            str(tmp_path / "out"), "--use_mlflow", "false", *args], capsys)
    assert code == 2 and message in err


def test_missing_inputs_are_named(capsys):
    code, _, err = run_cli(["--task", "addition"], capsys)
    assert code == 2 and "--pretrain: required" in err and "--save_path: required" in err


def test_a_report_of_an_earlier_release_asks_for_a_rerun(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps({"policy": "p", "metrics": {"eval/policy_exact_match": 1.0}}))
    with pytest.raises(ValueError, match="rerun the evaluation"):
        read_eval_report(str(tmp_path))


def test_markdown_escapes_cells():
    report = {"policies": [{"name": "p", "uri": "u"}], "reference": None, "dataset": "d", "task": None,
              "num_prompts": 1, "metrics": {"eval/p/reward": 0.5, "eval/p/response_len": 3.0},
              "samples": [{"prompt": "a|b\nc", "answer": None, "responses": {"p": {"text": "x", "score": 0.5}}}]}
    md = format_eval_markdown(report)
    assert "| reward-model score (greedy) | 0.5000 |" in md and "a\\|b\\nc" in md and "x (0.500)" in md


def test_each_model_is_asked_as_its_own_chat_template_asks(prepared, tmp_path, capsys):
    """A conditional SFT model's chat template appends the score it asks for: the evaluation
    renders each model's prompts with its own template. The same weights asked otherwise are
    another distribution (KL > 0; asked alike, KL is exactly 0), and the report says how it was asked."""
    from rlhf_core.stages.batch_inference import conditioned_chat_template

    conditioned = tmp_path / "conditioned"
    shutil.copytree(prepared["base"], conditioned)
    template = conditioned / "chat_template.jinja"
    template.write_text(conditioned_chat_template(template.read_text(), " <rm_score>: 1.50 "))
    out = tmp_path / "eval"
    code, _, err = run_cli(["--pretrain", f"{prepared['base']},{conditioned}", "--policy_names", "plain,csft",
                            "--ref_pretrain", prepared["base"], "--dataset", f"json@{prepared['prompts']}",
                            "--task", "addition", "--max_samples", "4", "--n_samples_per_prompt", "2",
                            "--save_path", str(out), "--use_mlflow", "false"], capsys)
    assert code == 0, err
    report = read_eval_report(str(out))
    assert report["metrics"]["eval/plain/kl"] == 0.0 and report["metrics"]["eval/csft/kl"] != 0.0
    plain, csft = report["policies"]
    assert "asked_as" not in plain and csft["asked_as"].endswith("<|assistant|> <rm_score>: 1.50 ")
    assert "asked as its chat template asks" in format_eval_markdown(report)
