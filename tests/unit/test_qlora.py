"""`--load_in_4bit` (QLoRA, OpenRLHF's flag): LoRA adapters trained on 4-bit NF4 weights
(bitsandbytes, which has a CPU backend since 0.48), published as a plain floating-point model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from rlhf_core.cli import main
from rlhf_core.config import SFTConfig, build_config
from rlhf_core.infra.settings import ConfigError
from rlhf_core.models.loading import export_model, four_bit_config, is_quantized, load_causal_lm


def test_a_qlora_model_is_published_as_the_plain_model_it_computes(prepared):
    """The adapters merged into the dequantised weights: plain transformers computes what the
    4-bit model with its adapters computed (to float rounding), with no quantisation left."""
    from peft import LoraConfig, get_peft_model

    model = load_causal_lm(prepared["base"], quantization=four_bit_config("fp32"))
    assert is_quantized(model) and type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear4bit"
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)  # adapters that moved
    ids = torch.tensor([[1, 10, 20, 30, 40, 50]])
    with torch.no_grad():
        trained = model(ids).logits
        plain = export_model(model, rank=0)
        published = plain(ids).logits
    assert not hasattr(plain.config, "quantization_config") and not is_quantized(plain)
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    assert torch.allclose(trained, published, atol=1e-4), (trained - published).abs().max()
    base = load_causal_lm(prepared["base"]).state_dict()
    weights = plain.state_dict()
    assert not torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(weights["model.embed_tokens.weight"], base["model.embed_tokens.weight"])  # never quantised


def test_after_an_evaluation_the_gradients_still_flow_through_the_4bit_layers(prepared):
    """bitsandbytes repacks 4-bit weights for a backward-less bf16 kernel at an eval-mode forward on
    CPUs with AVX-512 BF16 (such as Zen 5): kept from it, the first layer's adapters still learn
    after a held-out evaluation (on other CPUs this holds either way)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(load_causal_lm(prepared["base"], quantization=four_bit_config("fp32")),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    ids = torch.tensor([[1, 10, 20, 30, 40, 50]])
    model.eval()
    with torch.no_grad():
        model(ids)
    model.train()
    model(ids, labels=ids).loss.backward()
    first = model.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight  # (A: B starts at 0)
    assert first.grad is not None and first.grad.abs().sum() > 0


def test_4bit_needs_lora_and_no_zero_3_and_bitsandbytes(monkeypatch):
    given = {"pretrain": "m", "save_path": "o", "dataset": "d", "load_in_4bit": True}
    with pytest.raises(ConfigError, match=r"--ds.load_in_4bit \(--load_in_4bit\) trains LoRA adapters"):
        build_config(SFTConfig, None, given)
    with pytest.raises(ConfigError, match="cannot shard 4-bit weights with ZeRO-3"):
        build_config(SFTConfig, None, {**given, "lora_rank": 8, "zero_stage": 3})
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError, match=r"needs bitsandbytes: pip install 'rlhf-lifecycle\[qlora\]'"):
        four_bit_config("fp32")


def test_qlora_sft_trains_adapters_on_4bit_weights(prepared, tmp_path, capsys, one_torch_thread):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "ckpt"
    code = main(["train", "sft", "--pretrain", prepared["base"], "--dataset", f"json@{prepared['sft']}",
                 "--apply_chat_template", "--max_len", "48", "--max_samples", "512", "--max_eval_samples", "64",
                 "--train_batch_size", "16", "--micro_train_batch_size", "16", "--learning_rate", "1e-2",
                 "--max_steps", "24", "--load_in_4bit", "--lora_rank", "8", "--target_modules", "all-linear",
                 "--param_dtype", "fp32", "--save_steps", "24", "--ckpt_path", str(ckpt), "--save_path",
                 str(tmp_path / "out"), "--use_mlflow", "false"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    metrics = json.loads(out.out[out.out.index("{"):])["metrics"]
    assert metrics["eval/loss"] < 0.9 * metrics["eval_initial/loss"], metrics  # it learnt (as plain LoRA does here)
    # the model it trained held 4-bit weights: their quantisation entries are in the checkpoint
    states = torch.load(next((ckpt / "global_step24").glob("*model_states.pt")), weights_only=False)["module"]
    assert any(k.endswith("q_proj.base_layer.weight.absmax") for k in states)
    assert not any(p.requires_grad for k, p in states.items() if "base_layer" in k)
    # published: a plain model, every quantised layer dequantised with its adapter merged
    published = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert not is_quantized(published) and "quantization_config" not in (tmp_path / "out" / "config.json").read_text()
    saved, base = load_file(str(tmp_path / "out" / "model.safetensors")), load_file(f"{prepared['base']}/model.safetensors")
    assert saved.keys() == base.keys() and torch.equal(saved["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    assert not torch.equal(saved["model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])


REWARD = '''
import zlib
import torch

def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([(zlib.crc32(q.encode()) % 100) / 100 for q in queries])
'''


def test_qlora_ppo_syncs_the_dequantised_merged_weights_to_the_engine(prepared, tmp_path, capsys,
                                                                       one_torch_thread, monkeypatch):
    """The actor and the critic train adapters on 4-bit weights; the engine samples with the merged,
    dequantised weights, so its log-probs stay the trainer's (fp32: to rounding)."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "reward.py").write_text(REWARD)
    code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--remote_rm_url", str(tmp_path / "reward.py"), "--advantage_estimator", "gae", "--critic_pretrain",
                 prepared["base"], "--rollout_batch_size", "8", "--n_samples_per_prompt", "2", "--train_batch_size",
                 "8", "--generate_max_len", "6", "--actor_learning_rate", "5e-3", "--critic_learning_rate", "5e-3",
                 "--param_dtype", "fp32", "--max_steps", "3", "--use_mlflow", "false", "--load_in_4bit",
                 "--lora_rank", "8", "--save_path", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    assert "forward (reference, LlamaForCausalLM): transformers (4-bit weights (--ds.load_in_4bit))" in err
    mismatch = [float(v) for v in re.findall(r"\[rl step \d+/3\].*logprob_mismatch=([0-9.e+-]+)", err)]
    kl = [float(v) for v in re.findall(r"\[rl step \d+/3\].* kl=([0-9.e+-]+)", err)]
    assert len(mismatch) == 3 and max(mismatch) < 1e-3, mismatch
    assert kl[-1] > 0, "the adapters moved the policy away from the (4-bit) reference"
    assert (Path(tmp_path) / "out" / "model.safetensors").is_file()
