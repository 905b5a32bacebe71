"""A killed supervised/preference run, resumed, ends bit-identical to an uninterrupted one (fp32, CPU).

For SFT, RM, DPO and KTO, on a tiny Llama with attention dropout on (so every rank's RNG state
must come back), 3 optimizer steps per epoch and 8 in all:

- the uninterrupted run asks for `--load_checkpoint` with an empty checkpoint folder: it starts at
  step 0, says so on stderr and records `resume.checkpoint: null` in `stage.json`;
- the interrupted run is a real `rlhf train` process that SIGKILLs itself in the middle of step 6
  (`RLHF_TEST_KILL_AT_STEP`: after the forward of the step's second micro-batch, the first one's
  gradient accumulated, no update made), after the step-4 checkpoint was written;
- the resumed run must report that it started at step 4 and executed exactly 4 optimizer steps
  (a `--load_checkpoint` that loaded nothing would run 8), cross the epoch boundary after step 6,
  and end with a final checkpoint whose weights, optimizer state, scheduler, DeepSpeed counters
  and RNG states are `torch.equal` to the uninterrupted run's, and the same published weights.

PPO (a rollout-step loop with its own checkpoint, `rl/checkpoint.py`) is tested the same way below.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import STAGE_CONFIGS, build_config
from rlhf_core.launch import prepare_environment
from rlhf_core.trainers import run_recipe

pytestmark = pytest.mark.slow

STEPS, SAVE_STEPS, KILL_AT = 8, 4, 6  # 3 steps per epoch: the resumed run crosses into epoch 3


@pytest.fixture(scope="module")
def dropout_base(prepared, tmp_path_factory):
    """The prepared tiny Llama's twin with attention dropout 0.1 (tokenizer and shape unchanged)."""
    from transformers import AutoTokenizer

    from rlhf_core.models.tiny import build_tiny_llama

    out = tmp_path_factory.mktemp("dropout_base")
    tok = AutoTokenizer.from_pretrained(prepared["base"])
    model = build_tiny_llama(tok, seed=0, dropout=0.1)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    # Dropout is really on: two training-mode forwards of the same batch differ.
    ids = torch.tensor([tok("add 1+2=3").input_ids])
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, model(ids).logits)
    return str(out)


def values(stage, prepared, base, out: Path, ckpt: Path) -> dict:
    data = "sft" if stage == "sft" else "preference"
    return {"pretrain": base, "dataset": f"json@{prepared[data]}", "save_path": str(out),
            "apply_chat_template": True, "max_len": 48, "train_batch_size": 16, "micro_train_batch_size": 8,
            "max_samples": 48, "max_eval_samples": 16, "max_epochs": 3, "max_steps": STEPS,
            "learning_rate": 1e-3, "lr_warmup_ratio": 0.25, "param_dtype": "fp32", "zero_stage": 2, "seed": 7,
            "use_mlflow": False, "save_steps": SAVE_STEPS, "ckpt_path": str(ckpt), "max_ckpt_num": 10,
            "load_checkpoint": True}


def cli_args(stage, v: dict) -> list[str]:
    args = [sys.executable, "-m", "rlhf_core.cli", "train", stage]
    for key, value in v.items():
        args += [f"--{key}", str(value).lower() if isinstance(value, bool) else str(value)]
    return args


def assert_same_state(a, b, where: str) -> None:
    """`a` and `b` (nested checkpoint contents) equal exactly: tensors `torch.equal`, the rest `==`."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        assert same, f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, set(a) ^ set(b))
        for k in a:
            assert_same_state(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        import numpy as np

        if isinstance(a, np.ndarray):
            assert np.array_equal(a, b), where
        else:
            assert a == b, (where, a, b)


def assert_same_checkpoint(a: Path, b: Path) -> None:
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    assert any("optim" in f or "model_states" in f for f in files) and any(f.startswith("rng_") for f in files)
    for name in files:
        assert_same_state(torch.load(a / name, weights_only=False), torch.load(b / name, weights_only=False), name)


def optimizer_state(tag: Path) -> dict:
    """The Adam moments of a checkpoint (one CPU rank trains ZeRO-2 as stage 0: in the model states)."""
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    optim = states.get("optimizer") or torch.load(next(tag.glob("*optim_states.pt")), weights_only=False)
    return optim


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo", "kto"])
def test_killed_mid_step_run_resumes_bit_identical(stage, prepared, dropout_base, tmp_path, capfd,
                                                   one_torch_thread):
    prepare_environment()
    # Uninterrupted, through --load_checkpoint on an empty folder: step 0, said and recorded.
    full_v = values(stage, prepared, dropout_base, tmp_path / "full", tmp_path / "full_ckpt")
    full = run_recipe(build_config(STAGE_CONFIGS[stage], None, full_v))
    assert "--load_checkpoint: no checkpoint in" in capfd.readouterr().err
    assert full["resume"] == {"requested": True, "checkpoint": None, "start_step": 0}
    assert json.loads((tmp_path / "full" / "stage.json").read_text())["resume"]["checkpoint"] is None
    assert full["metrics"]["train/steps_run"] == STEPS

    # Killed by SIGKILL in the middle of step 6, a real process; the step-4 checkpoint is the latest.
    ckpt = tmp_path / "ckpt"
    split_v = values(stage, prepared, dropout_base, tmp_path / "split", ckpt)
    env = {**os.environ, "RLHF_TEST_KILL_AT_STEP": str(KILL_AT), "OMP_NUM_THREADS": "1", "RLHF_NO_PROGRESS": "1"}
    killed = subprocess.run(cli_args(stage, {**split_v, "load_checkpoint": False}), env=env, capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "SIGKILL mid-step" in killed.stderr
    assert (ckpt / "latest").read_text().strip() == f"global_step{SAVE_STEPS}"
    assert not (tmp_path / "split" / "stage.json").exists()  # nothing half-done looks finished

    resumed = run_recipe(build_config(STAGE_CONFIGS[stage], None, split_v))
    assert f"resumed from {ckpt / f'global_step{SAVE_STEPS}'} at step {SAVE_STEPS}" in capfd.readouterr().err
    assert resumed["resume"] == {"requested": True, "checkpoint": str(ckpt / f"global_step{SAVE_STEPS}"),
                                 "start_step": SAVE_STEPS}
    m = resumed["metrics"]
    # Started at the checkpoint and ran only the rest: a resume that restarted from 0 runs 8.
    assert m["train/start_step"] == SAVE_STEPS and m["train/steps_run"] == STEPS - SAVE_STEPS, m
    assert m["train/steps"] == STEPS

    final = f"global_step{STEPS}"
    assert_same_checkpoint(tmp_path / "full_ckpt" / final, ckpt / final)  # weights, Adam, scheduler, RNG
    moments = optimizer_state(ckpt / final)["state"]
    assert moments and all(torch.count_nonzero(s["exp_avg_sq"]) for s in moments.values())
    wa, wb = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "split" /
                                                                                    "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    w0 = load_file(str(Path(dropout_base) / "model.safetensors"))
    assert any(not torch.equal(w0[k], wa[k]) for k in w0 if k in wa)  # it trained at all
