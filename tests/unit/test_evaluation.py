"""`rlhf eval`: metrics on a tiny model (against itself and another model), outputs, MLflow, errors."""

import json

import pytest
import torch

from rlhf_core.cli import main
from rlhf_core.evaluation import (
    format_eval_markdown,
    k1_kl,
    read_eval_report,
    response_logprobs,
    win_rate,
)
from rlhf_core.models.loading import load_causal_lm, load_reward_model, load_tokenizer

N_PROMPTS = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models(prepared, tmp_path_factory):
    """A reward model (random head) and a second policy (another seed) next to the prepared base."""
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
    return {"rm": str(root / "rm"), "other": str(root / "other")}


def run_cli(args, capsys):
    code = main(["eval", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_win_rate_counts_ties_as_half():
    assert win_rate([1.0, 2.0, 3.0, 0.0], [1.0, 1.0, 4.0, 0.0]) == pytest.approx((0.5 + 1 + 0 + 0.5) / 4)
    with pytest.raises(ValueError):
        win_rate([1.0], [])


def test_k1_kl_is_the_mean_summed_log_ratio():
    assert k1_kl(torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -2.0])) == pytest.approx(0.0)
    assert k1_kl(torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -4.0])) == pytest.approx(2.0)


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


def test_eval_of_a_model_against_itself(prepared, models, tmp_path, capsys):
    out = tmp_path / "eval"
    code, stdout, err = run_cli(["--pretrain", prepared["base"], "--ref_pretrain", prepared["base"],
                                 "--reward_pretrain", models["rm"], "--dataset", f"json@{prepared['prompts']}",
                                 "--task", "addition", "--max_samples", str(N_PROMPTS), "--n_kl_samples", "2",
                                 "--save_path", str(out), "--mlflow_run_name", "eval-self"], capsys)
    assert code == 0, err
    manifest = json.loads(stdout)
    assert manifest == json.loads((out / "stage.json").read_text())
    assert manifest["stage"] == "eval" and manifest["config_hash"].startswith("sha256:")
    assert manifest["inputs"]["datasets"][0]["split"] == "test"  # json@DIR: the held-out split
    report = read_eval_report(str(out))
    m = report["metrics"]
    assert m["eval/win_rate"] == 0.5 and m["eval/kl"] == 0.0
    assert m["eval/policy_exact_match"] == 0.0 and m["eval/reference_exact_match"] == 0.0  # a random model
    assert m["eval/policy_reward"] == m["eval/reference_reward"]
    assert 1 <= m["eval/policy_response_len"] <= 5  # addition: at most 4 answer tokens + EOS
    assert manifest["metrics"] == m and report["num_prompts"] == N_PROMPTS and report["num_kl_samples"] == 16
    assert len(report["samples"]) == 5 and {"prompt", "answer", "policy_response", "policy_score",
                                             "reference_response", "policy_correct"} <= set(report["samples"][0])
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temporary output left behind"

    import mlflow

    from rlhf_core.tracking import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    run = mlflow.get_run(manifest["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["rlhf.stage"] == "eval"
    assert run.data.metrics["eval/win_rate"] == 0.5 and run.data.metrics["eval/kl"] == 0.0
    assert run.data.tags["rlhf.output_uri"] == str(out.resolve())

    markdown = format_eval_markdown(report)
    assert "| exact match | 0.0% | 0.0% |" in markdown and "50.0%" in markdown


def test_eval_against_another_model_without_mlflow(prepared, models, tmp_path, capsys):
    code, stdout, err = run_cli(["--pretrain", prepared["base"], "--ref_pretrain", models["other"],
                                 "--reward_pretrain", models["rm"], "--dataset", prepared["prompts_test"],
                                 "--max_new_tokens", "4", "--max_samples", str(N_PROMPTS), "--n_kl_samples", "4",
                                 "--save_path", str(tmp_path / "eval"), "--use_mlflow", "false"], capsys)
    assert code == 0, err
    m = json.loads(stdout)["metrics"]
    assert m["eval/kl"] > 0.1  # two random models disagree; k1 over 32 samples is clearly positive
    assert 0.0 <= m["eval/win_rate"] <= 1.0 and "eval/policy_exact_match" not in m  # exact match needs a task
    assert json.loads(stdout)["mlflow_run_id"] is None


def test_eval_without_reference_reports_the_policy_only(prepared, tmp_path, capsys):
    code, stdout, err = run_cli(["--pretrain", prepared["base"], "--dataset", prepared["prompts_test"],
                                 "--task", "addition", "--max_samples", "4", "--save_path", str(tmp_path / "e"),
                                 "--use_mlflow", "false", "--rollout_backend", "transformers"], capsys)
    assert code == 0, err
    report = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert set(report["metrics"]) == {"eval/policy_exact_match", "eval/policy_response_len"}
    assert "| response length (tokens) |" in format_eval_markdown(report)


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
    (["--task", "addition", "--rollout_backend", "vllm"], "--rollout_backend"),
    (["--task", "nope"], "--task: unknown synthetic task 'nope'"),
])
def test_config_errors_exit_2(prepared, tmp_path, capsys, args, message):
    if "vllm" in args and torch.cuda.is_available():
        pytest.skip("vllm may be usable here")
    code, _, err = run_cli(["--pretrain", prepared["base"], "--dataset", prepared["prompts_test"], "--save_path",
                            str(tmp_path / "out"), "--use_mlflow", "false", *args], capsys)
    assert code == 2 and message in err


def test_missing_inputs_are_named(capsys):
    code, _, err = run_cli(["--task", "addition"], capsys)
    assert code == 2 and "--pretrain: required" in err and "--save_path: required" in err


def test_markdown_escapes_cells():
    report = {"policy": "p", "reference": None, "dataset": "d", "task": None, "num_prompts": 1,
              "metrics": {"eval/policy_reward": 0.5, "eval/policy_response_len": 3.0},
              "samples": [{"prompt": "a|b\nc", "answer": None, "policy_response": "x", "policy_score": 0.5}]}
    md = format_eval_markdown(report)
    assert "| reward-model score | 0.5000 | — |" in md and "a\\|b\\nc" in md and "x (0.500)" in md
