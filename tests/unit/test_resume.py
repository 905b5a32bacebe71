"""A killed supervised/preference run, resumed, ends bit-identical to an uninterrupted one (fp32, CPU).

For SFT, RM, DPO, KTO, KD and PRM, on a tiny Llama with attention dropout on (so every rank's RNG state
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
from rlhf_core.distributed.cluster import prepare_environment
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


@pytest.fixture(scope="module")
def step_rows(prepared, tmp_path_factory) -> str:
    """Process-reward rows on the addition task: a prompt and an answer, one step each (its `=`,
    a single token of this tokenizer, the placeholder), labelled `+` when the answer is right."""
    rows = []
    for line in Path(prepared["preference_train"]).read_text().splitlines()[:64]:
        row = json.loads(line)
        rows += [{"input": row["prompt"] + row["chosen"], "label": ["+"]},
                 {"input": row["prompt"] + row["rejected"], "label": ["-"]}]
    out = tmp_path_factory.mktemp("prm") / "train.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(out)


def values(stage, prepared, base, out: Path, ckpt: Path, step_rows: str | None = None) -> dict:
    data = "sft" if stage in ("sft", "kd") else "preference"
    teacher = {"teacher_model": prepared["base"]} if stage == "kd" else {}  # distillation's frozen teacher
    source = {"dataset": f"json@{prepared[data]}", "apply_chat_template": True}
    if stage == "prm":  # rows as OpenRLHF's train_prm reads them, as they are
        source = {"dataset": step_rows, "placeholder_token": "=", "reward_tokens": ["+", "-"]}
    return {**teacher, "pretrain": base, **source, "save_path": str(out), "max_len": 48, "train_batch_size": 16, "micro_train_batch_size": 8,
            "max_samples": 48, "max_eval_samples": 16, "max_epochs": 3, "max_steps": STEPS,
            "learning_rate": 1e-3, "lr_warmup_ratio": 0.25, "param_dtype": "fp32", "zero_stage": 2, "seed": 7,
            "use_mlflow": False, "save_steps": SAVE_STEPS, "ckpt_path": str(ckpt), "max_ckpt_num": 10,
            "load_checkpoint": True}


def cli_args(stage, v: dict) -> list[str]:
    args = [sys.executable, "-m", "rlhf_core.cli", "train", stage]
    for key, value in v.items():
        args += [f"--{key}", *(value if isinstance(value, list) else
                               [str(value).lower() if isinstance(value, bool) else str(value)])]
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
        elif type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):  # e.g. DeepSpeed's loss scaler
            assert type(a) is type(b), where
            assert_same_state(vars(a), vars(b), f"{where}:{type(a).__name__}")
        else:
            assert a == b, (where, a, b)


def assert_same_checkpoint(a: Path, b: Path) -> list[str]:
    """Every file of checkpoint folder `a` equals `b`'s: `.pt` contents exactly, others byte for byte."""
    files = sorted(p.name for p in a.iterdir() if p.is_file())
    assert files and files == sorted(p.name for p in b.iterdir() if p.is_file()), (a, b)
    for name in files:
        if name.endswith(".pt"):
            assert_same_state(torch.load(a / name, weights_only=False), torch.load(b / name, weights_only=False),
                              f"{a.name}/{name}")
        else:
            assert (a / name).read_bytes() == (b / name).read_bytes(), f"{a.name}/{name}"
    return files


def optimizer_state(tag: Path) -> dict:
    """The Adam moments of a checkpoint (one CPU rank trains ZeRO-2 as stage 0: in the model states)."""
    states = torch.load(tag / "mp_rank_00_model_states.pt", weights_only=False)
    optim = states.get("optimizer") or torch.load(next(tag.glob("*optim_states.pt")), weights_only=False)
    return optim


@pytest.mark.parametrize("stage, optim", [("sft", {}), ("rm", {}), ("dpo", {}), ("kto", {}), ("kd", {}), ("prm", {}),
                                          ("sft", {"optim": "muon", "muon.lr": 0.01}),
                                          ("sft", {"load_in_4bit": True, "lora_rank": 8})],
                         ids=["sft", "rm", "dpo", "kto", "kd", "prm", "sft-muon", "sft-qlora"])
def test_killed_mid_step_run_resumes_bit_identical(stage, optim, prepared, dropout_base, step_rows, tmp_path, capfd,
                                                   one_torch_thread):
    """(With `--optim muon` too: Muon's momentum buffers are in the checkpoint and come back; and
    QLoRA's adapters on 4-bit weights.)"""
    prepare_environment()
    # Uninterrupted, through --load_checkpoint on an empty folder: step 0, said and recorded.
    full_v = {**values(stage, prepared, dropout_base, tmp_path / "full", tmp_path / "full_ckpt", step_rows), **optim}
    full = run_recipe(build_config(STAGE_CONFIGS[stage], None, {**full_v, "save_hf_ckpt": True}))
    assert "--load_checkpoint: no checkpoint in" in capfd.readouterr().err
    assert full["resume"] == {"requested": True, "checkpoint": None, "start_step": 0}
    assert json.loads((tmp_path / "full" / "stage.json").read_text())["resume"]["checkpoint"] is None
    assert full["metrics"]["train/steps_run"] == STEPS

    # Killed by SIGKILL in the middle of step 6, a real process; the step-4 checkpoint is the latest.
    ckpt = tmp_path / "ckpt"
    split_v = {**values(stage, prepared, dropout_base, tmp_path / "split", ckpt, step_rows), **optim}
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
    files = assert_same_checkpoint(tmp_path / "full_ckpt" / final, ckpt / final)  # weights, Adam, scheduler, RNG
    assert "mp_rank_00_model_states.pt" in files and "rng_state_rank0.pt" in files
    moments = optimizer_state(ckpt / final)["state"]
    kinds = {"exp_avg_sq"} | ({"momentum_buffer"} if "optim" in optim else set())  # Adam's, Muon's for matrices
    assert moments and {k for s in moments.values() for k in s} >= kinds
    assert all(torch.count_nonzero(v) for s in moments.values() for k, v in s.items() if k in kinds)
    wa, wb = load_file(str(tmp_path / "full" / "model.safetensors")), load_file(str(tmp_path / "split" /
                                                                                    "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    w0 = load_file(str(Path(dropout_base) / "model.safetensors"))
    assert any(not torch.equal(w0[k], wa[k]) for k in w0 if k in wa)  # it trained at all
    # --save_hf_ckpt: each checkpoint holds the model in Hugging Face format; the last one's is the output's
    hf = tmp_path / "full_ckpt" / final / "hf"
    assert (hf / "config.json").is_file() and (hf / "tokenizer_config.json").is_file()
    wh = load_file(str(hf / "model.safetensors"))
    assert wh.keys() == wa.keys() and all(torch.equal(wh[k], wa[k]) for k in wa)
    assert (tmp_path / "full_ckpt" / f"global_step{SAVE_STEPS}" / "hf" / "model.safetensors").is_file()
    assert not (ckpt / final / "hf").exists()  # not asked for


# -- PPO: the RL stage's own loop and checkpoint (actor, critic, both optimizers, KL, prompts, RNG) --

REWARD_FILE = '''
import os, signal
from pathlib import Path
import torch

COUNTER = Path(__file__).with_suffix(".calls")

def reward_func(queries, prompts, labels, **kwargs):
    calls = int(COUNTER.read_text()) + 1 if COUNTER.exists() else 1
    COUNTER.write_text(str(calls))
    if calls == int(os.environ.get("TEST_KILL_AT_CALL", "0")):
        os.kill(os.getpid(), signal.SIGKILL)  # in the middle of a rollout step, after its generation
    return torch.tensor([float(len(q) % 3) for q in queries])
'''

PPO_STEPS, PPO_SAVE = 4, 2  # 12 prompts / 4 per step = 3 steps per episode: the resume crosses into episode 2


def ppo_args(prepared, base, tmp_path: Path, name: str, *extra) -> list[str]:
    reward = tmp_path / f"{name}_reward.py"
    if not reward.exists():
        reward.write_text(REWARD_FILE)
    return ["train", "ppo", "--pretrain", base, "--prompt_data", f"json@{prepared['prompts']}", "--max_samples",
            "12", "--remote_rm_url", str(reward), "--advantage_estimator", "gae", "--init_kl_coef", "0.05",
            "--kl_target", "0.1", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
            "--train_batch_size", "4", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "8",
            "--max_epochs", "2", "--num_episodes", "2", "--generate_max_len", "5", "--actor_learning_rate", "1e-3",
            "--critic_learning_rate", "1e-3", "--lr_warmup_ratio", "0.25", "--param_dtype", "fp32",
            "--use_mlflow", "false", "--seed", "3", "--max_steps", str(PPO_STEPS), "--save_steps", str(PPO_SAVE),
            "--ckpt_path", str(tmp_path / f"{name}_ckpt"), "--max_ckpt_num", "10", "--save_path",
            str(tmp_path / f"{name}_out"), "--load_checkpoint", *extra]


def test_killed_ppo_run_resumes_bit_identical(prepared, dropout_base, tmp_path, capfd, one_torch_thread,
                                              monkeypatch):
    from rlhf_core.cli import main

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # every role in this process
    assert main(ppo_args(prepared, dropout_base, tmp_path, "whole", "--save_hf_ckpt")) == 0
    assert "no checkpoint in" in capfd.readouterr().err
    whole = json.loads((tmp_path / "whole_out" / "stage.json").read_text())
    assert whole["resume"] == {"requested": True, "checkpoint": None, "start_step": 0}

    env = {**os.environ, "TEST_KILL_AT_CALL": str(PPO_SAVE + 1), "OMP_NUM_THREADS": "1", "RLHF_NO_PROGRESS": "1"}
    killed = subprocess.run([sys.executable, "-m", "rlhf_core.cli", *ppo_args(prepared, dropout_base, tmp_path,
                                                                                "split")],
                            env=env, capture_output=True, text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    ckpt = tmp_path / "split_ckpt"
    assert (ckpt / "latest").read_text().strip() == f"global_step{PPO_SAVE}"
    assert not (tmp_path / "split_out" / "stage.json").exists()

    assert main(ppo_args(prepared, dropout_base, tmp_path, "split")) == 0
    assert f"resumed from {ckpt / f'global_step{PPO_SAVE}'} at step {PPO_SAVE}" in capfd.readouterr().err
    resumed = json.loads((tmp_path / "split_out" / "stage.json").read_text())
    assert resumed["resume"] == {"requested": True, "checkpoint": str(ckpt / f"global_step{PPO_SAVE}"),
                                 "start_step": PPO_SAVE}
    m = resumed["metrics"]
    assert m["train/start_step"] == PPO_SAVE and m["train/steps_run"] == PPO_STEPS - PPO_SAVE, m
    # The reward file saw the killed run's 3 calls and the resumed run's 2: not a restart's 4.
    assert (tmp_path / "split_reward.calls").read_text() == str(PPO_SAVE + 1 + PPO_STEPS - PPO_SAVE)

    final = f"global_step{PPO_STEPS}"
    top = assert_same_checkpoint(tmp_path / "whole_ckpt" / final, ckpt / final)  # controller: KL, prompts, RNG
    assert "controller.pt" in top and "rng_actor_rank0.pt" in top and "rng_critic_rank0.pt" in top
    for role in ("actor", "critic"):  # weights, Adam moments, scheduler of each
        assert "mp_rank_00_model_states.pt" in assert_same_checkpoint(tmp_path / "whole_ckpt" / final / role,
                                                                      ckpt / final / role)
    wa, wb = load_file(str(tmp_path / "whole_out" / "model.safetensors")), load_file(str(tmp_path / "split_out" /
                                                                                         "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    wh = load_file(str(tmp_path / "whole_ckpt" / final / "hf" / "model.safetensors"))  # --save_hf_ckpt: the actor
    assert wh.keys() == wa.keys() and all(torch.equal(wh[k], wa[k]) for k in wa)
