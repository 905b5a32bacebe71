"""`--dry_run` on every stage: the flags and --config parsed and validated, the resolved config
printed in one spelling, exit 0, and nothing else: no data, model or tokenizer read (hub names and
missing paths pass), no MLflow, S3 or home directory touched, no placement checked against this
machine (8 GPUs asked for on a CPU). A config error still exits 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlhf_core.cli import main

HUB = "meta-llama/Meta-Llama-3-8B"
COMMANDS = {
    "sft": ["train", "sft", "--pretrain", HUB, "--dataset", "Open-Orca/OpenOrca", "--save_path", "./ckpt/sft",
            "--zero_stage", "2", "--bf16", "--max_len", "2048"],
    "rm": ["train", "rm", "--pretrain", HUB, "--dataset", "OpenRLHF/preference_dataset_mixture2_and_safe_pku",
           "--save_path", "./ckpt/rm", "--chosen_key", "chosen", "--rejected_key", "rejected"],
    "dpo": ["train", "dpo", "--pretrain", HUB, "--dataset", "OpenRLHF/preference_dataset_mixture2_and_safe_pku",
            "--save_path", "./ckpt/dpo", "--beta", "0.1"],
    "kto": ["train", "kto", "--pretrain", HUB, "--dataset", "Dylan2048/ultrafeedback-unpaired-preferences",
            "--save_path", "./ckpt/kto"],
    "kd": ["train", "kd", "--pretrain", HUB, "--teacher_model", "meta-llama/Meta-Llama-3-70B-Instruct", "--dataset",
           "Open-Orca/OpenOrca", "--save_path", "./ckpt/kd", "--kd_coef", "0.4", "--teacher_offload"],
    "ppo": ["train", "ppo", "--pretrain", HUB, "--prompt_data", "OpenRLHF/prompt-collection-v0.1", "--save_path", "./ckpt/ppo",
            "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "8", "--vllm_num_engines", "4",
            "--vllm_tensor_parallel_size", "2", "--remote_rm_url", "/nowhere/reward_func.py"],
}


@pytest.fixture
def untouched(tmp_path, monkeypatch):
    """An empty home and working directory, with no MLflow or S3 set: left empty by a dry run."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    for name in ("MLFLOW_TRACKING_URI", "RLHF_HOME", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    yield home, cwd
    assert not os.listdir(home) and not os.listdir(cwd), "a dry run wrote nothing"


@pytest.mark.parametrize("stage", sorted(COMMANDS))
def test_a_dry_run_prints_the_resolved_config_and_does_nothing_else(stage, untouched, capsys):
    assert main([*COMMANDS[stage], "--dry_run"]) == 0
    out, err = capsys.readouterr()
    resolved = json.loads(out)
    model = resolved["actor"]["model_name_or_path"] if stage == "ppo" else resolved["model"]["model_name_or_path"]
    assert model == HUB
    if stage == "ppo":
        assert resolved["actor"]["num_gpus_per_node"] == 8 and resolved["vllm"]["num_engines"] == 4


def test_a_dry_run_still_refuses_a_bad_config(untouched, capsys):
    assert main([*COMMANDS["dpo"], "--beta", "-1", "--dry_run"]) == 2
    assert "beta" in capsys.readouterr().err


@pytest.mark.parametrize("stage, argv", [
    ("ppo", ["--data.image_key", "images"]),
    ("ppo", ["--actor.freeze_visual_encoder"]),
])
def test_an_openrlhf_flag_of_a_feature_not_built_yet_is_refused_by_name(stage, argv, untouched, capsys):
    """Recognised (not `unrecognized arguments`) and refused with exit 2, saying what is not built."""
    with pytest.raises(SystemExit) as e:
        main([*COMMANDS[stage], *argv, "--dry_run"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"error: {argv[0]}: not built yet: " in err and "unrecognized" not in err


def test_a_deferred_flag_in_yaml_is_refused_the_same_way(untouched, tmp_path, capsys):
    config = tmp_path / "ppo.yaml"
    config.write_text("data:\n  image_key: images\n")
    assert main([*COMMANDS["ppo"], "--config", str(config), "--dry_run"]) == 2
    assert "--data.image_key: not built yet: vision-language RL" in capsys.readouterr().err


def test_the_flag_table_in_docs_is_generated_from_the_configs():
    """docs/openrlhf-flags.md is `python -m rlhf_core.flag_table`'s output: a flag added to a config is
    in it once the file is regenerated, and this fails until it is."""
    from pathlib import Path

    from rlhf_core.flag_table import markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "openrlhf-flags.md"
    assert doc.read_text() == markdown(), "regenerate: python -m rlhf_core.flag_table > docs/openrlhf-flags.md"
    assert "| `--ds.attn_implementation`, `--attn_implementation` |" in doc.read_text()
    assert "`--enable_vllm_is_correction`" in doc.read_text()


def test_no_config_field_is_accepted_and_left_unread():
    """Every field of every stage config is read by the code (an attribute access `.name` somewhere in
    rlhf_core, or its name given to getattr outside the config modules), or marked no-op by design
    with its reason (`flat(..., noop=...)`, listed in docs/openrlhf-flags.md). A field added to a
    config and wired to nothing fails here. A read inside the config modules counts: there a field
    is folded into the one the code reads (`--flash_attn` into `ds.attention`, `--margin_loss` into
    `data.margin_key`, `--eps_clip` into `eps_clip_low_high`, `ckpt.output_dir` as `save_path`)."""
    import re

    from rlhf_core.config import STAGE_CONFIGS, BatchInferenceConfig
    from rlhf_core.flags import leaves
    from rlhf_core.rl_config import PPOConfig

    package = Path(__file__).resolve().parents[2] / "rlhf_core"
    sources = {p: p.read_text() for p in package.rglob("*.py")}
    configs = {package / "config.py", package / "rl_config.py"}
    unread = set()
    for cls in [*STAGE_CONFIGS.values(), PPOConfig, BatchInferenceConfig]:
        for path, field in leaves(cls).items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            name = path.rsplit(".", 1)[-1]
            read = any(re.search(rf"\.{name}\b", text) for text in sources.values()) or any(
                re.search(rf"""["']{name}["']""", text) for p, text in sources.items() if p not in configs)
            if not read and not extra.get("noop"):
                unread.add(path)
    assert not unread, sorted(unread)
