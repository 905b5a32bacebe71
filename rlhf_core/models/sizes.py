"""The base-model sizes `rlhf prep` builds (for the tiny Llama and every family): plain data, so
the torch-free flow parameters validate against the same names."""

MAX_POSITION_EMBEDDINGS = 256

MODEL_SIZES: dict[str, dict[str, int]] = {  # smallest first
    # ~0.1M parameters besides embeddings: a student smaller than `tiny` (knowledge distillation).
    "nano": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 256},
    # ~1.05M parameters besides embeddings.
    "tiny": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512},
    # ~6.3M parameters besides embeddings: for machines with more cores, or a GPU.
    "small": {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 8, "intermediate_size": 1024},
    # GPT-2 small's width and depth with a gated MLP: ~113M parameters besides embeddings (the
    # scale benchmarks' model, benchmarks/README.md).
    "100m": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
    # Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 query heads sharing 2 key/value heads, MLP of
    # 4864): ~360M parameters besides the embeddings, which the task's tokenizer keeps small. For a GPU.
    "500m": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864},
}


def size_dims(size: str, kv_heads_ratio: int = 1) -> dict[str, int]:
    """A size's dimensions as config keywords; `num_key_value_heads` is the size's own where it names
    one, else one per `kv_heads_ratio` attention heads (the family's grouping)."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; valid sizes: {', '.join(MODEL_SIZES)}")
    dims = dict(MODEL_SIZES[size])
    dims.setdefault("num_key_value_heads", dims["num_attention_heads"] // kv_heads_ratio)
    return dims


def smaller_size(size: str) -> str | None:
    """The next size down (a distilled student's default), None below the smallest."""
    names = list(MODEL_SIZES)
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; valid sizes: {', '.join(MODEL_SIZES)}")
    return names[names.index(size) - 1] if names.index(size) > 0 else None
