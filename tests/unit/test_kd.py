"""`rlhf train kd`: a teacher is required; one whose vocabulary differs from the student's is refused
naming the flag (exit 2) and the stage's MLflow run is closed as FAILED; the teacher enters the
update exactly through `--kd_coef`. That distillation teaches more than SFT on the same rows is
tests/learning/test_kd_learning.py; the loss against a hand computation is test_losses.py."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_core.cli import main


def kd(prepared, out, *extra: str, mlflow: bool = False) -> list[str]:
    return ["train", "kd", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}", "--save_path",
            str(out), "--max_steps", "2", "--train_batch_size", "8", "--micro_train_batch_size", "8",
            "--learning_rate", "1e-2", "--param_dtype", "fp32", "--use_mlflow", str(mlflow).lower(), *extra]


@pytest.fixture(scope="module")
def other_teacher(prepared, tmp_path_factory) -> str:
    """A teacher over the same tokenizer with other (random) weights."""
    from transformers import AutoTokenizer

    from rlhf_core.models.tiny import build_tiny_llama

    out = tmp_path_factory.mktemp("other_teacher")
    tokenizer = AutoTokenizer.from_pretrained(prepared["base"])
    build_tiny_llama(tokenizer, seed=11).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def test_a_teacher_is_required(prepared, tmp_path, capsys):
    assert main(kd(prepared, tmp_path / "out")) == 2
    assert "--teacher.model_name_or_path (--teacher_model): required" in capsys.readouterr().err


def test_a_teacher_with_another_vocabulary_is_refused_and_the_run_closed_as_failed(prepared, tmp_path, capsys):
    from mlflow import MlflowClient
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from rlhf_core.infra.settings import tracking_uri

    config = AutoConfig.from_pretrained(prepared["base"])
    config.vocab_size += 16
    other = tmp_path / "other_vocabulary"
    LlamaForCausalLM(config).save_pretrained(other)
    AutoTokenizer.from_pretrained(prepared["base"]).save_pretrained(other)
    name = f"kd-vocabulary-{tmp_path.name}"
    assert main(kd(prepared, tmp_path / "out", "--teacher_model", str(other), "--mlflow_run_name", name,
                   mlflow=True)) == 2
    err = capsys.readouterr().err
    assert f"--teacher_model {other}: its vocabulary has {config.vocab_size} tokens" in err, err[-2000:]
    client = MlflowClient(tracking_uri())
    experiment = client.get_experiment_by_name("rlhf").experiment_id
    runs = client.search_runs([experiment], f"attributes.run_name = '{name}'")
    assert [r.info.status for r in runs] == ["FAILED"]  # a setup failure does not leave a run RUNNING


def test_a_teacher_whose_tokenizer_maps_other_ids_is_refused(prepared, tmp_path, capsys):
    """The same vocabulary size is not the same tokenizer: a teacher over another task's tokenizer
    (its ids mean other text), sized to the student's vocabulary, would distil noise."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from rlhf_core.stages.prep import prepare

    theirs = AutoTokenizer.from_pretrained(prepare(tmp_path / "sort", task="sort", n_train=64, n_test=4)["base"])
    assert theirs.get_vocab() != AutoTokenizer.from_pretrained(prepared["base"]).get_vocab()
    other = tmp_path / "other_tokenizer"
    LlamaForCausalLM(AutoConfig.from_pretrained(prepared["base"])).save_pretrained(other)  # the student's size
    theirs.save_pretrained(other)
    assert main(kd(prepared, tmp_path / "out", "--teacher_model", str(other))) == 2
    assert "its tokenizer maps tokens to other ids than the student's" in capsys.readouterr().err


def weights(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(next(iter(sorted(path.glob("*.safetensors")))))


def test_the_teacher_enters_the_update_through_kd_coef(prepared, other_teacher, tmp_path, one_torch_thread):
    """Two teachers: with `--kd_coef 0` the student's weights come out bit-identical (the NLL alone,
    which is SFT), with `--kd_coef 1` they differ; the manifest records the teacher and the coefficient."""
    out = {}
    for coef in ("0", "1"):
        for name, teacher in (("base", prepared["base"]), ("other", other_teacher)):
            out[coef, name] = tmp_path / f"{coef}-{name}"
            assert main(kd(prepared, out[coef, name], "--teacher_model", teacher, "--kd_coef", coef)) == 0
    same = weights(out["0", "base"]), weights(out["0", "other"])
    assert all(torch.equal(same[0][k], same[1][k]) for k in same[0])
    apart = weights(out["1", "base"]), weights(out["1", "other"])
    assert max((apart[0][k] - apart[1][k]).abs().max().item() for k in apart[0]) > 1e-4
    manifest = json.loads((out["1", "other"] / "stage.json").read_text())
    assert manifest["inputs"]["teacher_model"] == other_teacher
    assert manifest["config"]["model"]["kd_coef"] == 1.0
