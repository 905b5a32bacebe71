"""The base-model sizes `rlhf prep` builds (for the tiny Llama and every family): plain data, so
the torch-free flow parameters validate against the same names."""

MAX_POSITION_EMBEDDINGS = 256

MODEL_SIZES: dict[str, dict[str, int]] = {
    # ~0.1M parameters besides embeddings: a student smaller than `tiny` (knowledge distillation).
    "nano": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 256},
    # ~1.05M parameters besides embeddings.
    "tiny": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "intermediate_size": 512},
    # ~6.3M parameters besides embeddings: for machines with more cores, or a GPU.
    "small": {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 8, "intermediate_size": 1024},
    # GPT-2 small's width and depth with a gated MLP: ~113M parameters besides embeddings (the
    # scale benchmarks' model, benchmarks/README.md).
    "100m": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072},
}
