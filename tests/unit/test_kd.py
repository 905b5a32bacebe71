"""`rlhf train kd`: a teacher is required, and one whose vocabulary differs from the student's is
refused naming the flag (exit 2). That distillation teaches more than SFT on the same rows is
tests/learning/test_kd_learning.py; the loss against a hand computation is test_losses.py."""

from __future__ import annotations

import json

from rlhf_core.cli import main


def kd(prepared, tmp_path, *extra: str) -> list[str]:
    return ["train", "kd", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}", "--save_path",
            str(tmp_path / "out"), "--max_steps", "1", "--train_batch_size", "8", "--micro_train_batch_size", "8",
            "--use_mlflow", "false", *extra]


def test_a_teacher_is_required(prepared, tmp_path, capsys):
    assert main(kd(prepared, tmp_path)) == 2
    assert "--teacher.model_name_or_path (--teacher_model): required" in capsys.readouterr().err


def test_a_teacher_with_another_vocabulary_is_refused_naming_it(prepared, tmp_path, capsys):
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    config = AutoConfig.from_pretrained(prepared["base"])
    config.vocab_size += 16
    other = tmp_path / "other_teacher"
    LlamaForCausalLM(config).save_pretrained(other)
    AutoTokenizer.from_pretrained(prepared["base"]).save_pretrained(other)
    assert main(kd(prepared, tmp_path, "--teacher_model", str(other))) == 2
    err = capsys.readouterr().err
    assert f"--teacher_model {other}: its vocabulary has {config.vocab_size} tokens" in err, err[-2000:]


def test_the_stage_records_its_teacher_and_coefficient(prepared, tmp_path, capsys, one_torch_thread):
    assert main(kd(prepared, tmp_path, "--teacher_model", prepared["base"], "--kd_coef", "0.5")) == 0
    manifest = json.loads((tmp_path / "out" / "stage.json").read_text())
    assert manifest["inputs"]["teacher_model"] == prepared["base"]
    assert manifest["config"]["model"]["kd_coef"] == 0.5 and manifest["config"]["teacher"]["model_name_or_path"]
