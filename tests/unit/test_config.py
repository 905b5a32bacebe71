import pytest
import yaml

from rlhf_core.algos.names import DPOLossType
from rlhf_core.cli import main
from rlhf_core.config import DPOConfig, SFTConfig, build_config
from rlhf_core.infra.settings import ConfigError

BASE = {"pretrain": "m", "save_path": "out", "dataset": "d.jsonl"}


def test_flat_fields_nest_into_data_and_flags_override_yaml():
    cfg = build_config(SFTConfig, {**BASE, "max_len": 128, "learning_rate": 1e-4}, {"max_len": 256})
    assert cfg.data.max_len == 256
    assert cfg.learning_rate == 1e-4
    assert cfg.data.dataset == "d.jsonl"


def test_batch_arithmetic_and_accumulation():
    cfg = build_config(SFTConfig, BASE, {"train_batch_size": 64, "micro_train_batch_size": 8, "num_gpus_per_node": 2})
    assert cfg.world_size == 2 and cfg.accumulation_steps == 4
    with pytest.raises(ConfigError, match="train_batch_size"):
        build_config(SFTConfig, BASE, {"train_batch_size": 60, "micro_train_batch_size": 8})


def test_invalid_value_names_the_field():
    with pytest.raises(ConfigError, match="--zero_stage"):
        build_config(SFTConfig, BASE, {"zero_stage": 4})
    with pytest.raises(ConfigError, match="--bogus: unknown field"):
        build_config(SFTConfig, {**BASE, "bogus": 1}, {})
    with pytest.raises(ConfigError, match="--pretrain: required"):
        build_config(SFTConfig, {"save_path": "x", "dataset": "d"}, {})


def test_dpo_variants_resolve():
    cfg = build_config(DPOConfig, BASE, {"ipo": True})
    assert cfg.loss_type == DPOLossType.IPO and cfg.ref_pretrain == "m"
    with pytest.raises(ConfigError, match="label_smoothing"):
        build_config(DPOConfig, BASE, {"loss_type": "hinge", "label_smoothing": 0.1})


def test_cli_unknown_flag_exits_2_and_names_it(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "sft", "--pretrain", "m", "--save_path", "o", "--dataset", "d", "--no_such_flag", "1"])
    assert exc.value.code == 2
    assert "--no_such_flag" in capsys.readouterr().err


def test_cli_invalid_value_exits_2(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({**BASE, "learning_rate": -1}))
    assert main(["train", "sft", "--config", str(config)]) == 2
    assert "--learning_rate" in capsys.readouterr().err


def test_cli_bad_choice_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "rm", "--pretrain", "m", "--save_path", "o", "--dataset", "d", "--loss", "hinge"])
    assert exc.value.code == 2
    assert "--loss" in capsys.readouterr().err
