"""`rlhf pairs`: best/worst pairing, and an end-to-end run whose output the DPO trainer loads."""

import json

import pytest
import torch

from orchestration.reports import stage_metrics_lines
from rlhf_core.cli import main
from rlhf_core.config import DataConfig, DPOConfig, build_config
from rlhf_core.data.examples import load_pairs
from rlhf_core.models.loading import load_reward_model, load_tokenizer
from rlhf_core.stages.pairs import PAIR_FRACTION, build_pairs

N_PROMPTS = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_best_and_worst_are_paired_and_ties_skipped():
    rows, skipped = build_pairs(
        ["p1", "p2", "p3", [{"role": "user", "content": "p4"}]],
        [["a", "b", "c"], ["x", "y"], ["m", "n", "o"], ["u", "v"]],
        [[0.2, 0.9, -0.5], [1.0, 1.0], [0.0, 3.0, 3.0], [-1.0, 2.0]],
    )
    assert skipped == 1
    assert rows == [
        {"prompt": "p1", "chosen": "b", "rejected": "c", "chosen_score": 0.9, "rejected_score": -0.5},
        {"prompt": "p3", "chosen": "n", "rejected": "m", "chosen_score": 3.0, "rejected_score": 0.0},  # first max
        {"prompt": [{"role": "user", "content": "p4"}], "chosen": "v", "rejected": "u", "chosen_score": 2.0,
         "rejected_score": -1.0},
    ]


def test_blank_responses_are_never_paired():
    rows, skipped = build_pairs(["p", "q"], [["", "good", " "], ["", "only"]], [[-5.0, 1.0, 0.0], [0.0, 1.0]])
    assert rows == [] and skipped == 2


def test_the_pipeline_report_shows_the_pair_fraction_pairs_logs():
    assert stage_metrics_lines("pairs", {PAIR_FRACTION: 0.375, "pairs/num_pairs": 3}) == ["prompts with a pair: 0.375"]


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="prompts"):
        build_pairs(["p"], [], [])
    with pytest.raises(ValueError, match="scores"):
        build_pairs(["p"], [["a", "b"]], [[1.0]])


@pytest.fixture(scope="module")
def reward_model(prepared, tmp_path_factory):
    tok = load_tokenizer(prepared["base"])
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("pairs_rm")
    load_reward_model(prepared["base"], tok.pad_token_id).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def test_pairs_from_a_reward_model_train_dpo(prepared, reward_model, tmp_path, capsys):
    out = tmp_path / "pairs"
    code = main(["pairs", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['prompts']}",
                 "--reward", "reward_model", "--reward_pretrain", reward_model, "--n_samples_per_prompt", "3",
                 "--max_new_tokens", "5", "--max_samples", str(N_PROMPTS), "--save_path", str(out), "--seed", "3"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    manifest = json.loads(captured.out)
    assert manifest == json.loads((out / "stage.json").read_text()) and manifest["stage"] == "pairs"
    m = manifest["metrics"]
    rows = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert m["pairs/num_pairs"] == len(rows) >= 1 and m["pairs/pair_fraction"] == len(rows) / N_PROMPTS
    assert m["pairs/num_skipped_prompts"] == N_PROMPTS - len(rows)
    assert stage_metrics_lines("pairs", m) == [f"prompts with a pair: {len(rows) / N_PROMPTS:.4g}"]
    assert all(r["chosen_score"] > r["rejected_score"] and r["chosen"] != r["rejected"] for r in rows)
    prompts = [json.loads(line)["prompt"] for line in open(prepared["prompts_train"])][:N_PROMPTS]
    assert {r["prompt"] for r in rows} <= set(prompts)  # raw prompts, as trainers expect them

    tok = load_tokenizer(prepared["base"])
    examples, _ = load_pairs(DataConfig(dataset=f"json@{out}", apply_chat_template=True), tok, "train", 0)
    assert len(examples) == len(rows)

    from rlhf_core.trainers.dpo import load_data

    data = load_data(build_config(DPOConfig, None, {"pretrain": prepared["base"], "dataset": f"json@{out}",
                                                    "save_path": str(tmp_path / "dpo"), "apply_chat_template": True}))
    assert len(data.train) == len(rows) and data.eval is None

    import mlflow

    from rlhf_core.infra.settings import tracking_uri

    mlflow.set_tracking_uri(tracking_uri())
    run = mlflow.get_run(manifest["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["pairs/num_pairs"] == len(rows)


def test_no_pairs_is_a_clear_failure_that_orchestrators_do_not_retry(prepared, tmp_path, capsys):
    # A random model never answers right: every verifier score is 0, so nothing can be preferred.
    code = main(["pairs", "--pretrain", prepared["base"], "--dataset", prepared["prompts_test"], "--task",
                 "addition", "--n_samples_per_prompt", "2", "--max_samples", "3", "--save_path",
                 str(tmp_path / "p"), "--use_mlflow", "false"])
    err = capsys.readouterr().err
    assert code == 2 and "no preference pairs" in err and "--n_samples_per_prompt" in err  # 2: not retried
    assert not (tmp_path / "p").exists()
    # what an iterative-DPO round asks for: an empty set, published whole, for the flow to stop on
    code = main(["pairs", "--pretrain", prepared["base"], "--dataset", prepared["prompts_test"], "--task",
                 "addition", "--n_samples_per_prompt", "2", "--max_samples", "3", "--save_path",
                 str(tmp_path / "p"), "--use_mlflow", "false", "--allow_no_pairs"])
    manifest = json.loads(capsys.readouterr().out)
    assert code == 0 and manifest["metrics"]["pairs/num_pairs"] == 0 and manifest["metrics"]["pairs/mean_reward"] == 0
    assert (tmp_path / "p" / "train.jsonl").read_text() == "" and (tmp_path / "p" / "stage.json").is_file()


def test_iter_takes_a_window_of_the_prompts_and_one_past_them_is_refused(prepared, tmp_path, capsys):
    """`--iter K --rollout_batch_size N` (an iterative-DPO round's window, as in batch_inference): the
    prompts [K x N, (K + 1) x N) and their answers, nothing else; a window past the last prompt
    exits 2 naming the flags, before the model loads."""
    from rlhf_core.config import PairsConfig
    from rlhf_core.rollout.prompts import PromptSet
    from rlhf_core.stages.pairs import windowed

    prompts = PromptSet(list("abcde"), list("ABCDE"), [])
    cfg = PairsConfig(pretrain="m", dataset="d", save_path="o", task="sort", iter=1, rollout_batch_size=2)
    taken = windowed(prompts, cfg)
    assert (taken.prompts, taken.answers) == (["c", "d"], ["C", "D"])
    assert windowed(prompts, cfg.model_copy(update={"iter": 2})).prompts == ["e"]
    assert windowed(prompts, cfg.model_copy(update={"iter": None})) is prompts
    code = main(["pairs", "--pretrain", prepared["base"], "--dataset", prepared["prompts_test"], "--task",
                 "addition", "--iter", "100000", "--rollout_batch_size", "512", "--save_path", str(tmp_path / "p"),
                 "--use_mlflow", "false"])
    err = capsys.readouterr().err
    assert code == 2 and "--iter 100000" in err and "--rollout_batch_size 512" in err and "past them" in err


def test_verifier_needs_a_task(prepared, tmp_path, capsys):
    code = main(["pairs", "--pretrain", prepared["base"], "--dataset", prepared["prompts_test"],
                 "--max_new_tokens", "4", "--save_path", str(tmp_path / "p")])
    assert code == 2 and "--reward verifier needs --task" in capsys.readouterr().err


@pytest.mark.slow
def test_pairs_sampled_on_two_engines_on_ray_come_from_each_engines_share(prepared, reward_model, tmp_path,
                                                                         monkeypatch):
    """`--num_engines 2`: engine e samples the e-th half of the prompts with seed + e x
    ENGINE_SEED_STRIDE (batch_inference's sharding); each pair's texts are that engine's samples."""
    from rlhf_core.data.examples import prompt_token_ids
    from rlhf_core.rl.engines import ENGINE_SEED_STRIDE
    from rlhf_core.rollout import load_prompt_set, make_engine, prompt_formatter

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["pairs", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['prompts']}", "--reward",
                 "reward_model", "--reward_pretrain", reward_model, "--n_samples_per_prompt", "3", "--max_samples",
                 "6", "--max_new_tokens", "6", "--seed", "2", "--num_engines", "2", "--save_path", str(tmp_path / "p"),
                 "--use_mlflow", "false"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "p" / "train.jsonl").read_text().splitlines()]

    engine = make_engine(prepared["base"], "transformers")
    prompts = load_prompt_set(f"json@{prepared['prompts']}", "train", "prompt", "answer", max_samples=6, seed=2,
                              chat=True).prompts
    fmt = prompt_formatter(engine.tokenizer, True)
    ids = [prompt_token_ids(engine.tokenizer, fmt.prompt_text(p), True) for p in prompts]
    groups = (engine.generate_ids(ids[:3], 3, 1.0, 6, seed=2) + engine.generate_ids(ids[3:], 3, 1.0, 6,
                                                                                       seed=2 + ENGINE_SEED_STRIDE))
    samples = {json.dumps(p): {engine.tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in g}
               for p, g in zip(prompts, groups, strict=True)}
    assert rows and all({r["chosen"], r["rejected"]} <= samples[json.dumps(r["prompt"])] for r in rows)
