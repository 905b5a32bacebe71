"""`rlhf batch_inference`: OpenRLHF 0.9's flags and file formats; the post-processors' rules; files
written whole. (That rejection sampling from a policy teaches it: tests/learning/test_batch_inference_learning.py.)"""

from __future__ import annotations

import json

import pytest

from rlhf_core.cli import main
from rlhf_core.stages.batch_inference import (
    DEFAULT_REWARD_TEMPLATE,
    best_of,
    condition_suffix,
    conditioned,
    conditioned_chat_template,
    percentile,
    post_process,
    preference_pairs,
    prompt_window,
    z_scores,
)

ROWS = [{"input": "a", "output": "a1", "reward": 0.5}, {"input": "b", "output": "b1", "reward": 2.0},
        {"input": "a", "output": "a2", "reward": 1.5}, {"input": "a", "output": "a3", "reward": 1.5},
        {"input": "b", "output": "b2", "reward": 2.0}]

# The batch_inference lines of OpenRLHF v0.9.0's examples/scripts (train_rejection_sampling_llama.sh:
# generate, then score with rs; train_iterative_dpo_llama.sh: score with iter_dpo;
# train_conditional_llama.sh: score with csft), models and datasets replaced by local stand-ins.
OPENRLHF_V0_9_0 = {
    "rejection sampling: generate": "--eval_task generate_vllm --pretrain {policy} --bf16 --max_new_tokens 2048 "
    "--prompt_max_len 2048 --dataset {prompts} --input_key context_messages --apply_chat_template --temperature 0.9 "
    "--zero_stage 0 --best_of_n 4 --enable_prefix_caching --tp_size 4 --max_num_seqs 64 --iter 0 "
    "--rollout_batch_size 10240 --output_path {out}/generate.jsonl",
    "rejection sampling: score": "--eval_task rm --pretrain {rm} --bf16 --max_len 4096 --dataset {out}/generate.jsonl "
    "--dataset_probs 1.0 --zero_stage 0 --post_processor rs --micro_batch_size 4 --output_path {out}/rm.jsonl",
    "iterative DPO: score": "--eval_task rm --pretrain {rm} --bf16 --max_len 4096 --dataset {out}/generate.jsonl "
    "--dataset_probs 1.0 --zero_stage 0 --post_processor iter_dpo --micro_batch_size 4 --output_path {out}/rm.jsonl",
    "conditional SFT: score": "--eval_task rm --pretrain {rm} --bf16 --max_len 4096 --dataset {prompts} "
    "--input_key chosen --apply_chat_template --max_samples 128000 --zero_stage 0 --post_processor csft "
    "--normalize_reward --micro_batch_size 4 --output_path {out}/rm.jsonl",
}


def test_the_prompt_window_of_each_iteration():
    assert prompt_window(10, None, 4) == range(10)
    assert [prompt_window(10, i, 4) for i in range(4)] == [range(0, 4), range(4, 8), range(8, 10), range(10, 10)]


def test_rejection_sampling_keeps_each_prompt_s_best_the_first_of_equals():
    from rlhf_core.config import BatchInferenceConfig

    assert best_of(ROWS) == [ROWS[2], ROWS[1]]
    floor = BatchInferenceConfig.model_validate({"eval_task": "rm", "post_processor": "rs", "min_reward": 2.0})
    kept, metrics = post_process(ROWS, floor)  # a's best (1.5) is below the floor: a keeps nothing
    assert kept == [ROWS[1]] and metrics["batch_inference/below_min_reward"] == 1


def test_iterative_dpo_pairs_best_with_worst_and_leaves_out_prompts_that_all_tie():
    pairs, ties = preference_pairs(ROWS)
    assert pairs == [{"prompt": "a", "chosen": "a2", "chosen_reward": 1.5, "rejected": "a1", "rejected_reward": 0.5}]
    assert ties == 1  # b: both 2.0


def test_conditional_sft_writes_the_reward_into_the_prompt():
    rows = conditioned(ROWS[:2], None, normalize=False)
    assert DEFAULT_REWARD_TEMPLATE == "{input} <rm_score>: {reward} "
    assert [r["input"] for r in rows] == ["a <rm_score>: 0.50 ", "b <rm_score>: 2.00 "]
    assert [r["output"] for r in rows] == ["a1", "b1"]
    normalized = conditioned(ROWS[:2], "[{reward}] {input}", normalize=True)
    assert [r["input"] for r in normalized] == ["[-0.71] a", "[0.71] b"]  # z-scores with n - 1
    assert z_scores([1.0, 1.0]) == [0.0, 0.0]
    # The reward is put in first: a prompt that itself reads "{reward}" is left as it is.
    assert conditioned([{"input": "x {reward}", "output": "y", "reward": 1.0}], None, False)[0]["input"] == \
        "x {reward} <rm_score>: 1.00 "


def test_csft_reports_percentiles_of_the_scores_it_wrote():
    from rlhf_core.config import BatchInferenceConfig

    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == 2.0 and percentile([3.0, 1.0, 2.0, 4.0], 90) == 4.0
    assert percentile([5.0], 10) == 5.0 and percentile(list(range(100)), 90) == 89
    cfg = BatchInferenceConfig.model_validate({"eval_task": "rm", "post_processor": "csft", "normalize_reward": True})
    rows = [{"input": str(i), "output": "y", "reward": float(i)} for i in range(10)]
    written, metrics = post_process(rows, cfg)
    scores = [float(r["input"].split(": ")[1]) for r in written]  # as the prompts read them
    assert metrics["batch_inference/written_reward_p90"] == percentile(scores, 90) == 1.16
    assert metrics["batch_inference/written_reward_p10"] == -1.49  # nearest rank: the lowest of ten
    assert (metrics["batch_inference/written_reward_min"], metrics["batch_inference/written_reward_max"]) == \
        (-1.49, 1.49)


def test_a_conditioned_chat_template_asks_as_csft_wrote_the_rows(tmp_path):
    """The chat template conditional SFT saves appends the condition after the generation prompt:
    a prompt rendered with it is, character for character, a training row's input at that score."""
    from rlhf_core.config import DataConfig
    from rlhf_core.data.examples import PromptFormatter
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.stages.prep import prepare

    tok = load_tokenizer(prepare(tmp_path, task="sort", n_train=8, n_test=2)["base"])
    chat = PromptFormatter(tok, DataConfig(apply_chat_template=True))
    row = conditioned([{"input": chat.prompt_text("sort: CBA"), "output": "ABC", "reward": 1.0}], None, False)[0]
    suffix = condition_suffix(None, 1.0)
    assert suffix == " <rm_score>: 1.00 "
    tok.chat_template = conditioned_chat_template(tok.chat_template, suffix)
    assert chat.prompt_text("sort: CBA") == row["input"]
    # In training (no generation prompt) the template is as it was.
    assert tok.apply_chat_template([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
                                   tokenize=False) .endswith("y" + tok.eos_token)
    quoted = condition_suffix('{input} "score" \\ {reward}', -0.5)  # quotes and backslashes survive the template
    tok.chat_template = conditioned_chat_template(tok.chat_template, quoted)
    assert chat.prompt_text("x").endswith(suffix + quoted)
    with pytest.raises(ValueError, match="before {input}"):
        condition_suffix("<{reward}> {input}", 1.0)


def test_openrlhf_s_batch_inference_commands_are_accepted(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, line in OPENRLHF_V0_9_0.items():
        argv = line.format(policy="/p", rm="/rm", prompts="/d.jsonl", out=str(tmp_path)).split()
        assert main(["batch_inference", *argv, "--dry_run"]) == 0, name
        resolved = json.loads(capsys.readouterr().out)
        assert resolved["eval_task"] == argv[argv.index("--eval_task") + 1], name
    assert not list(tmp_path.iterdir())  # a dry run writes nothing


@pytest.mark.parametrize("argv, says", [
    (["--eval_task", "rm", "--dataset", "d.jsonl", "--output_path", "o.jsonl"], "--pretrain: required"),
    (["--eval_task", "generate", "--pretrain", "p", "--dataset", "d", "--output_path", "o", "--post_processor", "rs"],
     "post-processes scored rows"),
    (["--eval_task", "rm", "--task", "sort", "--dataset", "d", "--output_path", "o", "--reward_template", "{input}"],
     "must contain {input} and {reward}"),
    (["--eval_task", "generate", "--repetition_penalty", "1.1"], "repetition_penalty"),
    (["--eval_task", "rm", "--task", "sort", "--dataset", "d", "--output_path", "o", "--save_path", "s"],
     "--output_path (a file) or --save_path (a stage folder): give one"),
])
def test_what_cannot_run_exits_2_naming_the_flag(argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["batch_inference", *argv, "--use_mlflow", "false"]) == 2
    assert says in capsys.readouterr().err


def test_an_output_file_over_its_input_in_a_folder_or_under_a_file_is_refused_before_anything_runs(tmp_path, capsys):
    """`--output_path` is checked as `--save_path` is: never the dataset it reads (the rows would be
    lost), nor a folder, nor a path under a file; nothing is loaded or written first."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input": "a", "output": "b", "answer": "b"}\n')
    (tmp_path / "folder").mkdir()
    (tmp_path / "notes.txt").write_text("")
    score = ["batch_inference", "--eval_task", "rm", "--task", "sort", "--dataset", str(rows), "--use_mlflow", "false"]
    for output, says in [(rows, "is, holds or lies inside the input --dataset"), (tmp_path / "folder", "is a folder"),
                         (tmp_path / "notes.txt" / "x.jsonl", f"{tmp_path / 'notes.txt'} is a file, not a folder")]:
        assert main([*score, "--output_path", str(output)]) == 2
        assert f"--output_path {output}: {says}" in capsys.readouterr().err
    assert rows.read_text() == '{"input": "a", "output": "b", "answer": "b"}\n'


def test_generate_then_score_and_post_process_on_the_cli(prepared, tmp_path, capsys):
    """Generation reads prompts with the chat template, takes its `--iter` window, writes
    `best_of_n` rows per prompt; scoring a file of them with a verifier and `rs` keeps one per prompt."""
    out = tmp_path / "gen.jsonl"
    common = ["--use_mlflow", "false", "--seed", "0"]
    assert main(["batch_inference", "--eval_task", "generate", "--pretrain", prepared["base"], "--dataset",
                 f"json@{prepared['prompts']}", "--input_key", "prompt", "--apply_chat_template", "--best_of_n", "3",
                 "--max_new_tokens", "6", "--iter", "1", "--rollout_batch_size", "5", "--enable_csft",
                 "--output_path", str(out), *common]) == 0
    assert json.loads(capsys.readouterr().out) == {"batch_inference/rows": 15}
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    train = [json.loads(line) for line in open(prepared["prompts_train"])]
    assert len(rows) == 5 * 3
    assert [r["answer"] for r in rows[::3]] == [str(t["answer"]) for t in train[5:10]]  # the second window
    assert all(r["input"].endswith("<|assistant|><rm_score>: 5.00 ") for r in rows)  # OpenRLHF appends it as is
    assert train[5]["prompt"] in rows[0]["input"]
    # Rewards from the task's verifier: one row per prompt kept, the best.
    right = {**rows[0], "output": rows[0]["answer"]}
    out.write_text("".join(json.dumps(r) + "\n" for r in [right, *rows]))
    folder = tmp_path / "rs"  # a stage folder this time, as the pipeline writes: train.jsonl + stage.json
    assert main(["batch_inference", "--eval_task", "rm", "--task", "addition", "--dataset", str(out),
                 "--post_processor", "rs", "--save_path", str(folder), *common]) == 0
    best = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    manifest = json.loads((folder / "stage.json").read_text())
    assert manifest["stage"] == "batch_inference" and manifest["metrics"]["batch_inference/kept_rows"] == 5
    assert len(best) == 5 and best[0]["output"] == right["output"] and best[0]["reward"] == 1.0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["batch_inference/rows"] == 16 and metrics["batch_inference/kept_rows"] == 5


def test_the_verifier_scores_preps_sft_rows_for_conditional_sft_right_above_wrong(tmp_path, capsys):
    """The `conditional_sft` stage's scoring job with `reward: verifier`, on prep's SFT rows (30% of
    the demonstrations wrong, each row with its answer): every right row gets the one higher
    z-score, every wrong row the lower, written into its prompt."""
    from rlhf_core.stages.prep import prepare

    paths = prepare(tmp_path / "prep", task="sort", seed=0, model_size="tiny", n_train=200, n_test=10,
                    demo_error_rate=0.3)
    args = ["batch_inference", "--eval_task", "rm", "--task", "sort", "--label_key", "answer", "--dataset",
            f"json@{paths['sft']}", "--input_key", "prompt", "--output_key", "response", "--apply_chat_template",
            "--post_processor", "csft", "--normalize_reward", "--save_path", str(tmp_path / "csft"), "--use_mlflow",
            "false"]
    assert main(args) == 2  # a chat template needs a tokenizer
    assert "--apply_chat_template with --task: give --pretrain" in capsys.readouterr().err
    assert main([*args, "--pretrain", paths["base"]]) == 0
    capsys.readouterr()
    source = [json.loads(line) for line in open(paths["sft_train"])]
    rows = [json.loads(line) for line in (tmp_path / "csft" / "train.jsonl").read_text().splitlines()]
    assert len(rows) == len(source) == 200
    right = {r["reward"] for r, s in zip(rows, source, strict=True) if s["demo_correct"]}
    wrong = {r["reward"] for r, s in zip(rows, source, strict=True) if not s["demo_correct"]}
    assert len(right) == len(wrong) == 1 and right.pop() > 0 > wrong.pop()
    # the prompt as the base's chat template writes it, as a reward model's rows have it
    assert all(r["input"] == f"<|bos|><|user|>{s['prompt']}<|assistant|> <rm_score>: {r['reward']:.2f} "
               for r, s in zip(rows, source, strict=True))


def test_a_reward_model_scores_rows_as_the_reward_source_does_less_its_stored_mean(prepared, tmp_path):
    """`--eval_task rm` with a reward model: the score of input + output, normalised by the mean and
    std the model stores; a head saved under OpenRLHF's `value_head` name is read from there."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf_core.rewards import RewardModelReward

    rm_dir = tmp_path / "rm"
    model = AutoModelForSequenceClassification.from_pretrained(prepared["base"], num_labels=1)
    torch.manual_seed(0)
    torch.nn.init.normal_(model.score.weight)
    model.config.reward_mean, model.config.reward_std = 0.25, 2.0
    model.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(prepared["base"]).save_pretrained(rm_dir)
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"input": "1+2=", "output": "3"}\n{"input": "1+2=", "output": "4"}\n')
    out = tmp_path / "scored.jsonl"
    assert main(["batch_inference", "--eval_task", "rm", "--pretrain", str(rm_dir), "--dataset", str(rows),
                 "--output_path", str(out), "--use_mlflow", "false"]) == 0
    scored = [json.loads(line)["reward"] for line in out.read_text().splitlines()]
    rm = RewardModelReward(str(rm_dir), apply_chat_template=False)
    raw = rm.score_sequences(rm.sequences_from_text(["1+2=", "1+2="], ["3", "4"]))
    assert scored == pytest.approx([(r - 0.25) / 2.0 for r in raw])

    # The same head under OpenRLHF's name: read from `value_head.*` (its config names the prefix).
    weights = load_file(rm_dir / "model.safetensors")
    weights["value_head.weight"] = weights.pop("score.weight")
    save_file(weights, rm_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((rm_dir / "config.json").read_text())
    (rm_dir / "config.json").write_text(json.dumps({**config, "value_head_prefix": "value_head"}))
    assert main(["batch_inference", "--eval_task", "rm", "--pretrain", str(rm_dir), "--dataset", str(rows),
                 "--output_path", str(out), "--use_mlflow", "false"]) == 0
    assert [json.loads(line)["reward"] for line in out.read_text().splitlines()] == pytest.approx(scored)


def test_a_prompt_written_out_already_gets_no_second_bos_in_training(tmp_path):
    """Rows batch inference wrote (`input`: the chat-templated prompt, as OpenRLHF writes it) train
    SFT on exactly the tokens the chat template gives, with `--input_template ""` as OpenRLHF's
    rejection-sampling script passes it (a Llama tokenizer adds BOS to plain text)."""
    from tokenizers.processors import TemplateProcessing

    from rlhf_core.config import DataConfig
    from rlhf_core.data.examples import PromptFormatter
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.stages.prep import prepare

    tok = load_tokenizer(prepare(tmp_path, task="sort", n_train=32, n_test=4, model_family="llama")["base"])
    # BOS before plain text, as Llama 3's own tokenizer adds it
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{tok.bos_token} $A",
                                                              special_tokens=[(tok.bos_token, tok.bos_token_id)])
    assert tok("x")["input_ids"][0] == tok.bos_token_id
    chat = PromptFormatter(tok, DataConfig(apply_chat_template=True))
    written = PromptFormatter(tok, DataConfig(input_template=""))
    assert written.prompt_ids(chat.prompt_text("sort: CBA")) == chat.prompt_ids("sort: CBA")
    assert written.prompt_ids("sort: CBA")[0] == tok.bos_token_id  # a plain prompt still gets its BOS


def test_a_window_past_the_prompts_is_an_error_not_an_empty_file(prepared, tmp_path, capsys):
    out = tmp_path / "gen.jsonl"
    assert main(["batch_inference", "--eval_task", "generate", "--pretrain", prepared["base"], "--dataset",
                 f"json@{prepared['prompts']}", "--input_key", "prompt", "--iter", "9", "--rollout_batch_size", "1024",
                 "--max_new_tokens", "4", "--output_path", str(out), "--use_mlflow", "false"]) == 2
    assert "--iter 9" in capsys.readouterr().err and not out.exists()


def test_a_flag_the_task_does_not_read_is_said_to_be_not_applied(tmp_path, capsys):
    from rlhf_core.config import BatchInferenceConfig
    from rlhf_core.stages.batch_inference import say_what_is_not_read, unread_flags

    generate = BatchInferenceConfig.model_validate({"eval_task": "generate", "normalize_reward": True, "top_p": 0.9})
    assert unread_flags(generate) == ["normalize_reward"]
    score = BatchInferenceConfig.model_validate({"eval_task": "rm", "best_of_n": 4, "iter": 0, "post_processor": "rs",
                                                 "num_engines": 2})
    assert unread_flags(score) == ["best_of_n", "iter", "num_engines"]  # scoring runs in this process
    say_what_is_not_read(score)
    err = capsys.readouterr().err
    assert "not applied here: --best_of_n is not read by --eval_task rm" in err and "--post_processor" not in err
    # a verifier reads --pretrain's tokenizer only for a chat template
    verifier = {"eval_task": "rm", "task": "sort", "pretrain": "m"}
    assert unread_flags(BatchInferenceConfig.model_validate(verifier)) == ["pretrain"]
    assert unread_flags(BatchInferenceConfig.model_validate({**verifier, "apply_chat_template": True})) == []


@pytest.mark.slow
def test_generation_sharded_over_two_engines_on_ray_is_each_shard_generated_by_its_engine(prepared, tmp_path,
                                                                                          monkeypatch):
    """`--num_engines 2`: two engines as Ray actors (a local Ray), engine e generating the e-th half
    of the prompts with seed + e x ENGINE_SEED_STRIDE; the rows are what one in-process engine
    gives for each half with that seed, in prompt order."""
    from rlhf_core.data.examples import prompt_token_ids
    from rlhf_core.rl.engines import ENGINE_SEED_STRIDE
    from rlhf_core.rollout import make_engine, prompt_formatter
    from rlhf_core.rollout.prompts import load_prompt_set

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    out = tmp_path / "gen.jsonl"
    assert main(["batch_inference", "--eval_task", "generate", "--pretrain", prepared["base"], "--dataset",
                 f"json@{prepared['prompts']}", "--input_key", "prompt", "--apply_chat_template", "--best_of_n", "2",
                 "--max_new_tokens", "6", "--max_samples", "10", "--num_engines", "2", "--seed", "3",
                 "--use_mlflow", "false", "--output_path", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]

    engine = make_engine(prepared["base"], "transformers")
    prompts = load_prompt_set(f"json@{prepared['prompts']}", "train", "prompt", "answer", max_samples=10, seed=3,
                              chat=True).prompts
    fmt = prompt_formatter(engine.tokenizer, True)
    ids = [prompt_token_ids(engine.tokenizer, fmt.prompt_text(p, row=i + 1), True) for i, p in enumerate(prompts)]
    groups = (engine.generate_ids(ids[:5], 2, 1.0, 6, seed=3)
              + engine.generate_ids(ids[5:], 2, 1.0, 6, seed=3 + ENGINE_SEED_STRIDE))
    expected = [engine.tokenizer.decode(s.token_ids, skip_special_tokens=True) for g in groups for s in g]
    assert len(rows) == 20 and [r["output"] for r in rows] == expected
