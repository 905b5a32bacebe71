"""Stages as Ray worker groups: 2 ranks (ZeRO-2, ZeRO-3) agree with 1 rank; a killed run resumes."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from safetensors.torch import load_file

from rlhf_core.config import SFTConfig, build_config
from rlhf_core.stages.launch import run_stage

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def sft_config(prepared, out, **overrides):
    values = {"pretrain": prepared["base"], "dataset": f"json@{prepared['sft']}", "save_path": str(out),
              "apply_chat_template": True, "max_len": 48, "train_batch_size": 32, "micro_train_batch_size": 8,
              "learning_rate": 1e-3, "lr_warmup_ratio": 0.0, "zero_stage": 2, "max_steps": 3, "seed": 5,
              "max_eval_samples": 32, "param_dtype": "fp32", **overrides}  # exact comparisons: fp32
    return build_config(SFTConfig, None, values)


def max_weight_diff(a, b):
    wa, wb = load_file(str(Path(a) / "model.safetensors")), load_file(str(Path(b) / "model.safetensors"))
    assert set(wa) == set(wb)
    return max((wa[k] - wb[k]).abs().max().item() for k in wa)


@pytest.fixture(scope="module")
def one_rank(prepared, tmp_path_factory):
    return run_stage(sft_config(prepared, tmp_path_factory.mktemp("one") / "sft"))


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_train_like_one(prepared, tmp_path, one_rank, zero_stage):
    two = run_stage(sft_config(prepared, tmp_path / "sft", num_gpus_per_node=2, zero_stage=zero_stage))
    assert two["config"]["train"]["num_gpus_per_node"] == 2
    assert abs(two["metrics"]["train/final_loss"] - one_rank["metrics"]["train/final_loss"]) < 1e-5
    assert abs(two["metrics"]["eval/loss"] - one_rank["metrics"]["eval/loss"]) < 1e-4
    assert max_weight_diff(two["output_uri"], one_rank["output_uri"]) < 1e-4


def test_ranks_train_on_the_data_the_driver_checked(prepared, tmp_path, one_rank, monkeypatch):
    """The driver tokenizes and checks the data once; the ranks get it from Ray's object store.
    With the files gone after the check, a rank that loaded them again would fail."""
    import shutil

    from rlhf_core import trainers

    data = tmp_path / "data"
    shutil.copytree(prepared["sft"], data)
    real_check = trainers.check_data

    def check_then_delete(cfg):
        checked = real_check(cfg)
        shutil.rmtree(data)
        return checked

    monkeypatch.setattr(trainers, "check_data", check_then_delete)
    two = run_stage(sft_config(prepared, tmp_path / "sft", dataset=f"json@{data}", num_gpus_per_node=2))
    assert not data.exists()
    assert abs(two["metrics"]["train/final_loss"] - one_rank["metrics"]["train/final_loss"]) < 1e-5


def _cli(args):
    return [sys.executable, "-m", "rlhf_core.cli", "train", "sft", *args]


def test_killed_cli_run_resumes_to_the_same_weights(prepared, tmp_path):
    env = {**os.environ, "RLHF_NO_PROGRESS": "1"}
    common = ["--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}", "--apply_chat_template",
              "--max_len", "48", "--train_batch_size", "32", "--micro_train_batch_size", "16", "--learning_rate",
              "1e-3", "--max_steps", "30", "--seed", "3", "--use_mlflow", "false", "--max_eval_samples", "16",
              "--param_dtype", "fp32"]
    full = subprocess.run(_cli([*common, "--save_path", str(tmp_path / "full")]), env=env, capture_output=True,
                          text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    ckpt = tmp_path / "ckpt"
    resumable = [*common, "--save_path", str(tmp_path / "resumed"), "--save_steps", "2", "--ckpt_path", str(ckpt)]
    proc = subprocess.Popen(_cli(resumable), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline = time.time() + 600
    while not (ckpt / "latest").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # kill right after the first complete checkpoint, ~28 steps before the end
    assert proc.poll() is None, "the run ended before it could be killed"
    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:  # the driver, its local Ray and the rank workers, mid-run
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=30)
    assert not (tmp_path / "resumed" / "stage.json").exists()
    resumed = subprocess.run(_cli([*resumable, "--load_checkpoint"]), env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stderr
    assert json.loads((tmp_path / "resumed" / "stage.json").read_text())["metrics"]["train/steps"] == 30
    assert max_weight_diff(tmp_path / "full", tmp_path / "resumed") < 1e-6
