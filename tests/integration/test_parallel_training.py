"""Model parallelism in the supervised trainers, two ranks on this CPU (gloo), against one rank on
the same packed batches:

- DeepSpeed AutoTP (`--ds_tensor_parallel_size`, OpenRLHF's flag; `--ds.tensor_parallel_size`):
  the ranks split every linear layer of the model, see the same batches, and take the steps one
  rank takes (SFT, DPO, the reward model, a process reward model); a checkpoint of their slices
  resumes to the same weights. DeepSpeed's CPU accelerator
  runs AutoTP with ZeRO 0-2 (ZeRO-3 is refused by name).
- Ring attention (`--ring_attn_size`, `--ring_head_stride`; `--ds.ring_attn_size`,
  `--ds.ring_attn_head_stride`; `models/ring.py`): the ranks split each row's tokens and gather
  keys and values in every layer; SFT, DPO and the reward model take one rank's steps, and a ring's
  checkpoint resumes to the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlhf_core.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.slow]

COMMON = ["--apply_chat_template", "--max_len", "48", "--max_samples", "64", "--train_batch_size", "16",
          "--micro_train_batch_size", "4", "--param_dtype", "fp32", "--learning_rate", "1e-3", "--use_mlflow", "false",
          "--zero_stage", "1", "--max_ckpt_num", "5", "--packing_samples"]
TP2 = ["--num_gpus_per_node", "2", "--ds_tensor_parallel_size", "2"]
RING2 = ["--num_gpus_per_node", "2", "--ring_attn_size", "2", "--ring_head_stride", "1"]
# One rank and a tensor-parallel pair sum in different orders (the row-parallel layers all-reduce
# partial products): measured 8.8e-6 apart after 4 SFT steps that moved the weights 3.1e-3 (a 2-core
# AMD EPYC, Zen 4 class, fp32). A ring's attention is matmul attention over gathered keys where one
# rank runs SDPA, and its gradients are sums of two shares.
PARALLEL_GAP = 5e-5
# A reward model's first steps move its value projections by Adam's normalised update of gradients
# near zero (behind a new score head), where the last bits of a sum decide: a ring of two ended
# 2.6e-4 from one rank there (v_proj; every metric equal to 1e-6), within 6e-5 elsewhere (a 2-core
# Intel Xeon with AMX, fp32); two tensor-parallel ranks 5.2e-4 on a 2-core AMD EPYC (Zen 4, AVX-512).
RM_GAP = 1e-3
STEPS = {"sft": 4, "dpo": 2, "rm": 2}
PREFERENCE_METRICS = {"dpo": ("eval/loss", "eval/reward_accuracy", "eval/reward_margin", "train/final_loss"),
                      "rm": ("eval/loss", "eval/accuracy", "train/final_loss", "reward_mean", "reward_std")}


def weights(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def gap(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b) and all(a[k].shape == b[k].shape for k in a)  # whole tensors, not slices
    return max((a[k] - b[k]).abs().max().item() for k in a)


def metrics(folder) -> dict:
    return json.loads((folder / "stage.json").read_text())["metrics"]


def args(prepared, stage: str) -> list[str]:
    data = prepared["sft"] if stage == "sft" else prepared["preference"]
    return ["--pretrain", prepared["base"], "--dataset", f"json@{data}", *COMMON, "--max_steps", str(STEPS[stage])]


@pytest.fixture(scope="module")
def one_rank(prepared, tmp_path_factory):
    """Each stage's run on one rank (trained on first use)."""
    out = tmp_path_factory.mktemp("one_rank")
    runs = {}

    def run(stage: str) -> Path:
        if stage not in runs:
            assert main(["train", stage, *args(prepared, stage), "--save_path", str(out / stage)]) == 0
            runs[stage] = out / stage
        return runs[stage]

    return run


def assert_same_run(one: Path, parallel: Path, keys: tuple[str, ...], rel: float, tolerance: float = PARALLEL_GAP
                    ) -> None:
    assert gap(weights(one), weights(parallel)) < tolerance, gap(weights(one), weights(parallel))
    for key in keys:
        assert metrics(parallel)[key] == pytest.approx(metrics(one)[key], rel=rel, abs=1e-6), key


def resume_from_step2(prepared, tmp_path, stage: str, parallel: list[str], checkpoints: Path, trained: Path) -> None:
    """Resume from the run's step-2 checkpoint (copied alone): the same weights as the run's, exactly."""
    resumed = tmp_path / "resumed_ckpt"
    resumed.mkdir()
    shutil.copytree(checkpoints / "global_step2", resumed / "global_step2")
    (resumed / "latest").write_text("global_step2")
    assert main(["train", stage, *args(prepared, stage), *parallel, "--ckpt_path", str(resumed), "--load_checkpoint",
                 "--save_path", str(tmp_path / "resumed")]) == 0
    assert metrics(tmp_path / "resumed")["train/start_step"] == 2
    after, before = weights(tmp_path / "resumed"), weights(trained)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_two_tensor_parallel_ranks_train_as_one_and_resume_to_the_same_weights(prepared, one_rank, tmp_path,
                                                                              monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["train", "sft", *args(prepared, "sft"), *TP2, "--save_steps", "2", "--ckpt_path",
                 str(tmp_path / "ckpt"), "--save_path", str(tmp_path / "tp2")]) == 0
    one = one_rank("sft")
    assert gap(weights(one), weights(Path(prepared["base"]))) > 1e-3  # the steps moved the weights
    assert_same_run(one, tmp_path / "tp2", ("eval_initial/loss", "eval/loss", "train/final_loss"), rel=1e-5)
    step2 = tmp_path / "ckpt" / "global_step2"
    assert sorted(p.name for p in step2.glob("mp_rank_*_model_states.pt")) == [
        "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # each rank's slices
    resume_from_step2(prepared, tmp_path, "sft", TP2, tmp_path / "ckpt", tmp_path / "tp2")


def test_two_tensor_parallel_ranks_train_a_process_reward_model_as_one(tmp_path, monkeypatch, capfd):
    """`rlhf train prm` (the reward tokens' logits read at each step's placeholder) with its causal
    LM split over two ranks: one rank's steps."""
    from rlhf_core.stages.prep import prepare

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    steps = prepare(tmp_path / "steps", task="addition_steps", n_train=64, n_test=16)
    prm = ["train", "prm", "--pretrain", steps["base"], "--dataset", f"json@{steps['prm']}", "--placeholder_token",
           "ки", "--reward_tokens", "+", "-", *COMMON[3:], "--lr_warmup_ratio", "0", "--max_steps", "3"]
    # (rows read as written: no chat template, the stage's own max_len)
    assert main([*prm, "--save_path", str(tmp_path / "one")]) == 0
    capfd.readouterr()
    assert main([*prm, *TP2, "--save_path", str(tmp_path / "tp2")]) == 0
    assert "tensor-parallel layers (--ds.tensor_parallel_size)" in capfd.readouterr().err  # split, not two copies
    assert gap(weights(tmp_path / "one"), weights(Path(steps["base"]))) > 1e-3  # the steps moved the weights
    assert_same_run(tmp_path / "one", tmp_path / "tp2", ("eval/loss", "eval/acc", "train/final_loss"), rel=1e-5)


@pytest.mark.parametrize("stage", ["dpo", "rm"])
def test_two_tensor_parallel_ranks_take_one_ranks_preference_steps(stage, prepared, one_rank, tmp_path, monkeypatch):
    """DPO (the policy split over two ranks, its reference whole on each) and the reward model (its
    new score head started the same on both): one rank's steps."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["train", stage, *args(prepared, stage), *TP2, "--save_path", str(tmp_path / "tp2")]) == 0
    assert_same_run(one_rank(stage), tmp_path / "tp2", PREFERENCE_METRICS[stage], rel=1e-4,
                    tolerance=RM_GAP if stage == "rm" else PARALLEL_GAP)


def test_a_ring_of_two_trains_sft_as_one_rank_and_resumes_to_the_same_weights(prepared, one_rank, tmp_path,
                                                                             monkeypatch, capfd):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["train", "sft", *args(prepared, "sft"), *RING2, "--save_steps", "2", "--ckpt_path",
                 str(tmp_path / "ckpt"), "--save_path", str(tmp_path / "ring2")]) == 0
    # the ring ran (two ranks each taking every batch whole would take the same Adam steps)
    assert "forward (policy, LlamaForCausalLM): transformers with ring attention (2 ranks" in capfd.readouterr().err
    assert_same_run(one_rank("sft"), tmp_path / "ring2", ("eval_initial/loss", "eval/loss", "train/final_loss"),
                    rel=1e-5)
    resume_from_step2(prepared, tmp_path, "sft", RING2, tmp_path / "ckpt", tmp_path / "ring2")


def test_a_ring_of_tensor_parallel_pairs_trains_sft_as_one_rank(prepared, one_rank, tmp_path, monkeypatch, capfd):
    """OpenRLHF's 3-D layout: four ranks, a ring of two positions, each a tensor-parallel pair (AutoTP
    splits every linear layer between the pair; the ring splits each row's tokens between the
    positions, each slice's keys gathered from its own slice on the other position): one rank's steps."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["train", "sft", *args(prepared, "sft"), "--num_gpus_per_node", "4", "--ds_tensor_parallel_size", "2",
                 "--ring_attn_size", "2", "--ring_head_stride", "1", "--save_path", str(tmp_path / "both")]) == 0
    err = capfd.readouterr().err
    assert "ring attention (2 ranks" in err and "tensor-parallel layers (--ds.tensor_parallel_size)" in err, err[-3000:]
    assert_same_run(one_rank("sft"), tmp_path / "both", ("eval_initial/loss", "eval/loss", "train/final_loss"),
                    rel=1e-5)


@pytest.mark.parametrize("stage, zero", [("dpo", "1"), ("rm", "3")])
def test_a_ring_of_two_takes_one_ranks_preference_steps(stage, zero, prepared, one_rank, tmp_path, monkeypatch):
    """DPO (policy and reference in the ring, shared-prompt pairs) and the reward model (a score read
    at each sample's last token, wherever in the ring it lies), the latter under ZeRO-3 (its weights
    partitioned over the ring's ranks; the one rank trains at ZeRO-1): one rank's steps. Before the
    body's forward went through the whole model under ZeRO-3 (`forward.backbone_hidden`), a reward
    model there took other steps, ring or not."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert main(["train", stage, *args(prepared, stage), *RING2, "--zero_stage", zero,
                 "--save_path", str(tmp_path / "ring2")]) == 0
    assert_same_run(one_rank(stage), tmp_path / "ring2", PREFERENCE_METRICS[stage], rel=1e-4,
                    tolerance=RM_GAP if stage == "rm" else PARALLEL_GAP)
