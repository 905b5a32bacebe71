"""`--use_ds_universal_ckpt` (`--ds.use_universal_ckpt`): a run resumes on another number of ranks
through DeepSpeed's universal checkpoint format (OpenRLHF's users report theirs failing: its
issue #1067)."""

from __future__ import annotations

import json
import shutil

import pytest

from rlhf_core.cli import main
from rlhf_core.config import SFTConfig, build_config
from rlhf_core.distributed.engine import EngineSettings, deepspeed_config
from rlhf_core.infra.settings import ConfigError
from rlhf_core.trainers import universal
from rlhf_core.trainers.universal import FOLDER

GIVEN = {"pretrain": "m", "save_path": "o", "dataset": "d"}


def test_universal_checkpoints_keep_zero_on_one_cpu_rank_and_load_universally():
    cfg = build_config(SFTConfig, None, {**GIVEN, "use_ds_universal_ckpt": True, "zero_stage": 2})
    ds = deepspeed_config(EngineSettings.of(cfg))
    assert ds["zero_optimization"]["stage"] == 2  # not stage 0: its checkpoints have ZeRO slices to convert
    assert ds["checkpoint"] == {"load_universal": True}
    assert deepspeed_config(EngineSettings.of(build_config(SFTConfig, None, GIVEN)))["zero_optimization"]["stage"] == 0
    with pytest.raises(ConfigError, match=r"--ds.use_universal_ckpt \(--use_ds_universal_ckpt\) converts ZeRO"):
        build_config(SFTConfig, None, {**GIVEN, "use_ds_universal_ckpt": True, "zero_stage": 0})


def test_a_stage_0_checkpoint_cannot_be_converted_and_says_why(tmp_path):
    (tmp_path / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(RuntimeError, match="holds no ZeRO optimizer slices"):
        universal.universal_tag(tmp_path, 0, lambda: None)


ARGS = ["--apply_chat_template", "--max_len", "48", "--max_samples", "64", "--train_batch_size", "16",
        "--micro_train_batch_size", "4", "--max_steps", "4", "--param_dtype", "fp32", "--learning_rate", "1e-3",
        "--use_mlflow", "false", "--zero_stage", "2", "--use_ds_universal_ckpt", "--save_steps", "2",
        "--max_ckpt_num", "5"]


@pytest.mark.slow
def test_a_two_rank_run_resumes_on_one_rank_as_if_uninterrupted(prepared, tmp_path, capsys, monkeypatch):
    """Two ranks (Ray workers on this CPU, ZeRO-2: each holds half the optimizer state) checkpoint at
    step 2 and finish at 4; one rank resumes from their step-2 checkpoint and ends where they did:
    weights, Adam moments and schedule came back whole (the gradient sums' order aside)."""
    from safetensors.torch import load_file

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    data = ["--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}"]
    two = tmp_path / "two"
    assert main(["train", "sft", *data, *ARGS, "--num_gpus_per_node", "2", "--ckpt_path", str(two / "ckpt"),
                 "--save_path", str(two / "out")]) == 0, capsys.readouterr().err[-3000:]
    assert len(list((two / "ckpt" / "global_step2").glob("zero_pp_rank_*_optim_states.pt"))) == 2
    capsys.readouterr()

    one = tmp_path / "one"
    (one / "ckpt").mkdir(parents=True)
    shutil.copytree(two / "ckpt" / "global_step2", one / "ckpt" / "global_step2")
    (one / "ckpt" / "latest").write_text("global_step2")
    assert main(["train", "sft", *data, *ARGS, "--ckpt_path", str(one / "ckpt"), "--save_path", str(one / "out"),
                 "--load_checkpoint"]) == 0
    out = capsys.readouterr()
    metrics = json.loads(out.out[out.out.index("{"):])["metrics"]
    assert metrics["train/start_step"] == 2 and metrics["train/steps_run"] == 2, metrics
    assert (one / "ckpt" / "global_step2" / "universal" / "zero").is_dir()  # converted once, where it was loaded

    resumed, uninterrupted = load_file(str(one / "out" / "model.safetensors")), load_file(str(two / "out" /
                                                                                            "model.safetensors"))
    base = load_file(f"{prepared['base']}/model.safetensors")
    moved = max((uninterrupted[k] - base[k]).abs().max().item() for k in base)
    gap = max((resumed[k] - uninterrupted[k]).abs().max().item() for k in base)
    assert moved > 1e-3 and gap < 1e-6, (moved, gap)
    # the one-rank run wrote ZeRO slices of its own: convertible in turn
    assert list((one / "ckpt" / "global_step4").glob("zero_pp_rank_0_mp_rank_00_optim_states.pt"))


REWARD = '''
import torch

def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([float(len(q) % 3) for q in queries])
'''


@pytest.mark.slow
def test_the_rl_stage_resumes_through_universal_checkpoints(prepared, tmp_path, capsys, monkeypatch):
    """The RL roles' checkpoints (actor and critic, ZeRO-2) convert and load the same way; resumed
    at step 1, a run ends where an uninterrupted one does (one rank each: equal to rounding)."""
    from safetensors.torch import load_file

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "reward.py").write_text(REWARD)

    def ppo(name: str, steps: int, *extra: str) -> int:
        return main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                     "--input_key", "prompt", "--max_samples", "16", "--remote_rm_url", str(tmp_path / "reward.py"),
                     "--advantage_estimator", "gae", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
                     "--train_batch_size", "8", "--generate_max_len", "5", "--actor_learning_rate", "1e-3",
                     "--critic_learning_rate", "1e-3", "--param_dtype", "fp32", "--zero_stage", "2",
                     "--use_ds_universal_ckpt", "--save_steps", "1", "--max_ckpt_num", "5", "--seed", "3",
                     "--max_steps", str(steps), "--ckpt_path", str(tmp_path / f"{name}_ckpt"), "--save_path",
                     str(tmp_path / f"{name}_out"), "--use_mlflow", "false", *extra])

    assert ppo("full", 2) == 0, capsys.readouterr().err[-3000:]
    assert ppo("split", 1) == 0
    assert ppo("split", 2, "--load_checkpoint") == 0
    err = capsys.readouterr().err
    assert "resumed from" in err and (tmp_path / "split_ckpt" / "global_step1" / "actor" / FOLDER / "zero").is_dir()
    assert (tmp_path / "split_ckpt" / "global_step1" / "critic" / FOLDER / "zero").is_dir()
    a, b = load_file(str(tmp_path / "full_out" / "model.safetensors")), load_file(str(tmp_path / "split_out" /
                                                                                      "model.safetensors"))
    base = load_file(f"{prepared['base']}/model.safetensors")
    assert max((a[k] - base[k]).abs().max().item() for k in a) > 1e-4  # it trained
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
