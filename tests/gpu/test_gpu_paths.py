"""GPU-only paths: DeepSpeed bf16 on CUDA, flash-attn packing, NCCL across two ranks.

Skipped without CUDA (see conftest); run on a GPU machine with `pytest -m gpu`.
"""

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu


def _sft(prepared, out, **overrides):
    from rlhf_core.config import SFTConfig, build_config

    values = {"pretrain": prepared["base"], "dataset": f"json@{prepared['sft']}", "save_path": str(out),
              "apply_chat_template": True, "max_len": 48, "train_batch_size": 32, "micro_train_batch_size": 16,
              "learning_rate": 2e-3, "max_steps": 20, "param_dtype": "auto", "max_eval_samples": 64,
              "use_mlflow": False, **overrides}  # the GPU paths, not tracking (tested on CPU)
    return build_config(SFTConfig, None, values)


def test_bf16_deepspeed_on_cuda_learns(prepared, tmp_path):
    from rlhf_core.stages.launch import run_stage

    manifest = run_stage(_sft(prepared, tmp_path / "sft"))
    assert manifest["metrics"]["eval/loss"] < 0.7 * manifest["metrics"]["eval_initial/loss"]
    # auto on a CUDA device with bf16 (Ampere and later) is DeepSpeed's bf16, and the manifest says so
    assert manifest["precision"] == ("bf16" if torch.cuda.is_bf16_supported() else "fp32")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None, reason="flash_attn not installed")
def test_flash_attention_packing_matches_padding(prepared):
    from rlhf_core.data.batching import pack_batch, pad_batch
    from rlhf_core.models.forward import per_sample_sum, token_logprobs
    from rlhf_core.models.loading import load_causal_lm

    model = load_causal_lm(prepared["base"], attention="flash_attention_2", dtype=torch.bfloat16).cuda().eval()
    assert model.config._attn_implementation == "flash_attention_2"
    seqs = [list(range(10, 10 + n)) for n in (5, 9, 13)]
    masks = [[0] + [1] * (len(s) - 1) for s in seqs]
    with torch.no_grad():
        padded = pad_batch(seqs, masks, 0).to("cuda")
        packed = pack_batch(seqs, masks).to("cuda")
        a = per_sample_sum(token_logprobs(model, padded), padded)
        b = per_sample_sum(token_logprobs(model, packed), packed)
    assert torch.allclose(a, b, atol=5e-2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_over_nccl_match_one(prepared, tmp_path):
    from rlhf_core.stages.launch import run_stage

    one = run_stage(_sft(prepared, tmp_path / "one", param_dtype="fp32", max_steps=3))
    two = run_stage(_sft(prepared, tmp_path / "two", param_dtype="fp32", max_steps=3, num_gpus_per_node=2, zero_stage=3,
                         micro_train_batch_size=8))
    assert abs(one["metrics"]["train/final_loss"] - two["metrics"]["train/final_loss"]) < 1e-4
