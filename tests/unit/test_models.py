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


def test_gpu_only_attention_runs_sdpa_here_and_says_so_in_one_line(capsys, monkeypatch):
    """flash_attention_2/3 (`--ds.attn_implementation`, or `--flash_attn`) need CUDA and their
    package: elsewhere attention runs SDPA, and one `not applied here:` line says what was not
    applied, once per process however many models load; eager and flex_attention go through."""
    from rlhf_core.infra import not_applied

    if torch.cuda.is_available():
        pytest.skip("CPU fallback only")
    monkeypatch.setattr(not_applied, "_SAID", set())
    assert attention_implementation(True) == attention_implementation("flash_attention_2") == "rlhf_sdpa"
    assert attention_implementation("flash_attention_3") == "rlhf_sdpa"
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(not_applied.PREFIX)]
    assert lines == ["not applied here: --ds.attn_implementation flash_attention_2 needs a CUDA device and the "
                     "flash_attn package; attention runs PyTorch SDPA",
                     "not applied here: --ds.attn_implementation flash_attention_3 needs a CUDA device and the "
                     "flash_attn_interface package; attention runs PyTorch SDPA"]
    assert attention_implementation(False) == attention_implementation("sdpa") == "rlhf_sdpa"
    assert attention_implementation("eager") == "eager"
    assert not capsys.readouterr().err


def test_stored_parameters_reads_the_headers_of_one_file_or_of_the_shards_an_index_names(tmp_path):
    """What the evaluation reports as a model's size: sharded or not, the same count, and a LoRA
    adapter saved beside the weights is not counted."""
    import shutil

    from rlhf_core.models.loading import stored_parameters
    from rlhf_core.models.tiny import build_tiny_llama, train_tokenizer

    model = build_tiny_llama(train_tokenizer(["abc def ghi"] * 20, vocab_size=300), size="nano", seed=0)
    total = sum(p.numel() for p in model.parameters())
    model.save_pretrained(tmp_path / "one")
    model.save_pretrained(tmp_path / "shards", max_shard_size="100KB")
    assert (tmp_path / "shards" / "model.safetensors.index.json").is_file()
    shutil.copy(tmp_path / "one" / "model.safetensors", tmp_path / "shards" / "adapter_model.safetensors")
    assert stored_parameters(str(tmp_path / "one")) == stored_parameters(str(tmp_path / "shards")) == total
    assert stored_parameters(str(tmp_path)) is None  # no weights here
