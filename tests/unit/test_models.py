import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhf_core.models.loading import attention_implementation, load_reward_model, load_tokenizer


def test_value_head_prefix_maps_foreign_heads_onto_score(prepared, tmp_path):
    tok = load_tokenizer(prepared["tokenizer"])
    rm = load_reward_model(prepared["base"], tok.pad_token_id)
    rm.save_pretrained(tmp_path / "rm")
    state = load_file(str(tmp_path / "rm" / "model.safetensors"))
    head = torch.randn_like(state.pop("score.weight"))
    state["value_head.weight"] = head  # how OpenRLHF names its reward head
    save_file(state, str(tmp_path / "rm" / "model.safetensors"), metadata={"format": "pt"})
    loaded = load_reward_model(str(tmp_path / "rm"), tok.pad_token_id, value_head_prefix="value_head")
    assert torch.equal(loaded.score.weight.data, head)
    with pytest.raises(ValueError, match="--value_head_prefix 'critic_head'"):
        load_reward_model(str(tmp_path / "rm"), tok.pad_token_id, value_head_prefix="critic_head")


def test_flash_attn_falls_back_to_sdpa_with_a_notice(caplog):
    if torch.cuda.is_available():
        pytest.skip("CPU fallback only")
    with caplog.at_level("WARNING"):
        assert attention_implementation(True) == "rlhf_sdpa"
    assert "--flash_attn" in caplog.text and "SDPA" in caplog.text
    assert attention_implementation(False) == "rlhf_sdpa"
