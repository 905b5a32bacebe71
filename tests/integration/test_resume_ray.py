"""Stages as Ray worker groups of 2 ranks: one rank killed mid-step, the run resumes bit-identical;
and 2 ranks train like 1 for the reward model, DPO, KTO and KD, and a tensor-parallel pair (AutoTP)
like 1 for KTO and KD (SFT: test_ray_stages.py; SFT, RM and DPO with AutoTP: test_parallel_training.py).

Run under `flock /tmp/rlhf-ray.lock`: each `run_stage` of 2 ranks starts (and stops) a local Ray.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.config import STAGE_CONFIGS, build_config
from rlhf_core.stages.launch import StageFailed, run_stage
from tests.unit.test_resume import assert_same_checkpoint

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def dropout_base(prepared, tmp_path_factory):
    from transformers import AutoTokenizer

    from rlhf_core.models.tiny import build_tiny_llama

    out = tmp_path_factory.mktemp("dropout_base")
    tok = AutoTokenizer.from_pretrained(prepared["base"])
    build_tiny_llama(tok, seed=0, dropout=0.1).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def weights(path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def test_one_rank_of_two_killed_mid_step_resumes_bit_identical(prepared, dropout_base, tmp_path, monkeypatch):
    """SFT on 2 ranks (ZeRO-2, dropout on: each rank's own RNG stream), 3 steps per epoch, 8 steps.
    Rank 1 SIGKILLs itself in the middle of step 6, after the step-4 checkpoint: the stage fails;
    the resumed run starts at step 4, runs 4 steps across the epoch boundary and ends with every
    rank's checkpoint files (weights, ZeRO-2 optimizer shards, scheduler, RNG) equal to an
    uninterrupted 2-rank run's."""
    def cfg(out, ckpt):
        return build_config(STAGE_CONFIGS["sft"], None, {
            "pretrain": dropout_base, "dataset": f"json@{prepared['sft']}", "save_path": str(out),
            "apply_chat_template": True, "max_len": 48, "train_batch_size": 16, "micro_train_batch_size": 4,
            "max_samples": 48, "max_eval_samples": 16, "max_epochs": 3, "max_steps": 8, "learning_rate": 1e-3,
            "lr_warmup_ratio": 0.25, "param_dtype": "fp32", "zero_stage": 2, "seed": 7, "use_mlflow": False,
            "save_steps": 4, "ckpt_path": str(ckpt), "max_ckpt_num": 10, "load_checkpoint": True,
            "num_gpus_per_node": 2})

    full = run_stage(cfg(tmp_path / "full", tmp_path / "full_ckpt"))
    assert full["resume"]["checkpoint"] is None and full["metrics"]["train/steps_run"] == 8

    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("RLHF_TEST_KILL_AT_STEP", "6:1")  # the local Ray started below passes it to the ranks
    with pytest.raises(StageFailed, match="died"):
        run_stage(cfg(tmp_path / "split", ckpt))
    monkeypatch.delenv("RLHF_TEST_KILL_AT_STEP")
    assert (ckpt / "latest").read_text().strip() == "global_step4"
    assert not (tmp_path / "split" / "stage.json").exists()

    resumed = run_stage(cfg(tmp_path / "split", ckpt))
    assert resumed["resume"] == {"requested": True, "checkpoint": str(ckpt / "global_step4"), "start_step": 4}
    assert resumed["metrics"]["train/start_step"] == 4 and resumed["metrics"]["train/steps_run"] == 4
    files = assert_same_checkpoint(tmp_path / "full_ckpt" / "global_step8", ckpt / "global_step8")
    assert {"rng_state_rank0.pt", "rng_state_rank1.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(files)
    wa, wb = weights(tmp_path / "full"), weights(tmp_path / "split")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert json.loads((tmp_path / "split" / "stage.json").read_text())["resume"]["start_step"] == 4


def pair_values(stage, prepared, out, **overrides):
    # distillation reads SFT rows, its teacher the tiny base (a teacher shares the student's vocabulary)
    kd = {"dataset": f"json@{prepared['sft']}", "teacher_model": prepared["base"]} if stage == "kd" else {}
    return {"pretrain": prepared["base"], "dataset": f"json@{prepared['preference']}", "save_path": str(out),
            "apply_chat_template": True, "max_len": 48, "train_batch_size": 16, "micro_train_batch_size": 4,
            "max_samples": 64, "max_eval_samples": 32, "max_steps": 3, "learning_rate": 1e-3,
            "lr_warmup_ratio": 0.0, "param_dtype": "fp32", "zero_stage": 2, "seed": 5, "use_mlflow": False,
            **kd, **overrides}


@pytest.mark.parametrize("stage", ["rm", "dpo", "kto", "kd"])
def test_two_ranks_train_like_one(stage, prepared, tmp_path):
    """The loss is normalised by the global count of units (pairs, examples, response tokens) and
    KTO's KL reference point is averaged over ranks: 2 ranks of 2 micro-batches make the updates of
    1 rank of 4 (distillation's teacher runs on each rank). KTO and KD also with DeepSpeed AutoTP:
    the policy (student) split over a tensor-parallel pair, the reference (teacher) whole on each."""
    one = run_stage(build_config(STAGE_CONFIGS[stage], None, pair_values(stage, prepared, tmp_path / "one")))
    two = run_stage(build_config(STAGE_CONFIGS[stage], None, pair_values(stage, prepared, tmp_path / "two",
                                                                         num_gpus_per_node=2)))
    assert two["config"]["train"]["num_gpus_per_node"] == 2 and one["metrics"]["train/steps"] == 3
    assert two["metrics"]["train/final_loss"] == pytest.approx(one["metrics"]["train/final_loss"], abs=1e-5)
    for key in [k for k in one["metrics"] if k.startswith("eval/")]:
        assert two["metrics"][key] == pytest.approx(one["metrics"][key], abs=1e-4), key
    w1, w2, w0 = weights(one["output_uri"]), weights(two["output_uri"]), weights(prepared["base"])
    moved = max((w1[k] - w0[k]).abs().max().item() for k in w0 if k in w1)
    assert moved > 1e-3  # it trained: the agreement below is not two copies of the base
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4
    if stage in ("kto", "kd"):  # DeepSpeed AutoTP: the policy (student) split over 2 ranks, its reference (teacher) whole
        tp = run_stage(build_config(STAGE_CONFIGS[stage], None, pair_values(
            stage, prepared, tmp_path / "tp", num_gpus_per_node=2, ds_tensor_parallel_size=2, save_steps=3,
            ckpt_path=str(tmp_path / "tp_ckpt"))))
        assert sorted(p.name for p in (tmp_path / "tp_ckpt" / "global_step3").glob("mp_rank_*_model_states.pt")) == [
            "mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt"]  # each rank holds its slices
        assert tp["metrics"]["train/final_loss"] == pytest.approx(one["metrics"]["train/final_loss"], rel=1e-4)
        for key in [k for k in one["metrics"] if k.startswith("eval/")]:
            assert tp["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-5), key
        wt = weights(tp["output_uri"])
        assert max((w1[k] - wt[k]).abs().max().item() for k in w1) < 5e-5
