"""Tiny random models in the shape of the families users bring: `rlhf prep --model_family NAME`.

Each family is built from its own transformers config class (so its own modelling code runs:
Qwen2's q/k/v biases, Qwen3's QK-norm, Gemma-2's soft-capping, (1 + w) norms and sliding-window
layers, Phi-3's fused projections, Mixtral's experts) at the `tiny` or `small` dimensions, with a
BPE tokenizer trained locally that carries the family's special tokens and a chat template in the
family's format. Nothing is downloaded; the shapes are small, the structure is the family's.

The tokenizer's EOS is the token that ends an assistant turn in the family's chat format (Llama-3's
`<|eot_id|>`, ChatML's `<|im_end|>`, Gemma's `<end_of_turn>`, Phi-3's `<|end|>`, Mistral's `</s>`),
as the families' instruct tokenizers set it: a completion then ends the way the template ends an
assistant turn. Llama-3 and Mistral define no pad token, as theirs do not (the loader pads with EOS
and a reward model gets a pad of its own).

Templates are the families' formats without their system-prompt and tool branches: Llama-3's
headers; ChatML for Qwen (Qwen3's `enable_thinking=False` adds the empty think block);
Mistral's `[INST] ... [/INST]`; Gemma's turns with the `model` role; Phi-3's role tags.

Imports nothing heavy at module level: the CLI reads `FAMILIES` for its help.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from rlhf_core.models.sizes import MAX_POSITION_EMBEDDINGS, size_dims


@dataclass(frozen=True)
class Family:
    name: str
    model_type: str  # transformers' model_type: which modelling code runs
    specials: tuple[str, ...]  # ids 0.. in this order
    eos: str
    chat_template: str
    bos: str | None = None
    pad: str | None = None
    tie_word_embeddings: bool = False
    config: dict = field(default_factory=dict)  # the family's architecture settings beyond the dimensions
    kv_heads_ratio: int = 2  # attention heads per key/value head (grouped-query attention)


_LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
_CHATML_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}{{ '<think>\\n\\n</think>\\n\\n' }}{% endif %}"
    "{% endif %}"
)
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' + m['content'] + eos_token }}"
    "{% else %}{{ raise_exception('this Mistral template supports only user and assistant roles') }}{% endif %}"
    "{% endfor %}"
)
_GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = m['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\\n' + m['content'] + '<end_of_turn>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
)
_PHI3_TEMPLATE = (
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '<|end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
_LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>", "<|finetune_right_pad_id|>")
_CHATML_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    # Llama-3: grouped-query attention, rope theta 500k, untied (8B); no pad token.
    Family("llama", "llama", _LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>",
           chat_template=_LLAMA3_TEMPLATE, config={"rope_theta": 500000.0}),
    # Qwen2.5: biases on q/k/v (built into Qwen2's attention), tied embeddings (0.5B-3B), ChatML.
    Family("qwen2", "qwen2", _CHATML_SPECIALS, eos="<|im_end|>", pad="<|endoftext|>",
           chat_template=_CHATML_TEMPLATE, tie_word_embeddings=True, config={"rope_theta": 1000000.0}),
    # Qwen3: RMSNorm on queries and keys per head, no biases, untied (4B and up), ChatML with think tags.
    Family("qwen3", "qwen3", (*_CHATML_SPECIALS, "<think>", "</think>"), eos="<|im_end|>", pad="<|endoftext|>",
           chat_template=_CHATML_TEMPLATE, config={"rope_theta": 1000000.0, "attention_bias": False}),
    # Mistral v0.3: Llama's math under Mistral's code, no sliding window, [INST] format; no pad token.
    Family("mistral", "mistral", _MISTRAL_SPECIALS, bos="<s>", eos="</s>", chat_template=_MISTRAL_TEMPLATE,
           config={"rope_theta": 1000000.0, "sliding_window": None}),
    # Gemma-2: attention-logit and final-logit soft-capping, (1 + w) RMSNorms around each block,
    # scaled embeddings, GELU-tanh MLP, local/global layers alternating, tied embeddings.
    Family("gemma", "gemma2", ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"),
           bos="<bos>", eos="<end_of_turn>", pad="<pad>", chat_template=_GEMMA_TEMPLATE, tie_word_embeddings=True,
           config={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096,
                   "hidden_activation": "gelu_pytorch_tanh"}),
    # Phi-3 (mini, 4k): fused qkv and gate/up projections, full multi-head attention, untied.
    Family("phi3", "phi3", ("<unk>", "<s>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"),
           bos="<s>", eos="<|end|>", pad="<|endoftext|>", chat_template=_PHI3_TEMPLATE, kv_heads_ratio=1,
           config={"rope_theta": 10000.0}),
    # Qwen3-MoE (30B-A3B's design): Qwen3's attention (QK-norm, no biases), a sparse mixture of experts
    # in every layer (here 4 experts of a quarter of the dense MLP's width, top 2, top-k weights
    # renormalised), untied, ChatML with think tags.
    Family("qwen3_moe", "qwen3_moe", (*_CHATML_SPECIALS, "<think>", "</think>"), eos="<|im_end|>",
           pad="<|endoftext|>", chat_template=_CHATML_TEMPLATE,
           config={"rope_theta": 1000000.0, "attention_bias": False, "num_experts": 4, "num_experts_per_tok": 2,
                   "norm_topk_prob": True, "decoder_sparse_step": 1}),
    # Mixtral: Mistral's attention with a sparse mixture of experts (4 experts, top 2) in every layer.
    Family("mixtral", "mixtral", _MISTRAL_SPECIALS, bos="<s>", eos="</s>", chat_template=_MISTRAL_TEMPLATE,
           config={"rope_theta": 1000000.0, "sliding_window": None, "num_local_experts": 4,
                   "num_experts_per_tok": 2}),
)}


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; valid: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def template_texts(family: Family) -> list[str]:
    """The template's own words (role names, separators), for the tokenizer to learn them as tokens."""
    import jinja2

    render = jinja2.Environment().from_string(family.chat_template).render
    conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    text = render(messages=conversation, bos_token="", eos_token="", add_generation_prompt=True)
    for token in family.specials:
        text = text.replace(token, " ")
    return [text] * 50


def train_family_tokenizer(family: Family, texts: Iterable[str], vocab_size: int, extra_specials: Iterable[str] = ()):
    """A byte-level BPE tokenizer (tiny.train_tokenizer's rules) with the family's special tokens
    (and `extra_specials` after them) and chat template."""
    from rlhf_core.models.tiny import train_tokenizer

    return train_tokenizer([*texts, *template_texts(family)], vocab_size=vocab_size,
                           specials=[*family.specials, *extra_specials],
                           pad=family.pad, bos=family.bos, eos=family.eos, chat_template=family.chat_template)


def family_config(family: Family, tokenizer, size: str = "tiny"):
    from transformers import AutoConfig

    dims = size_dims(size, family.kv_heads_ratio)
    heads = dims["num_attention_heads"]
    head_dim = dims["hidden_size"] // heads
    extra = dict(family.config)
    if family.model_type == "gemma2":
        extra |= {"head_dim": head_dim, "query_pre_attn_scalar": head_dim}
    elif family.model_type in ("qwen3", "qwen3_moe"):
        extra |= {"head_dim": head_dim}
    if family.model_type == "qwen3_moe":  # each expert a quarter of the dense MLP: 4 of them hold as much
        extra |= {"moe_intermediate_size": dims["intermediate_size"] // 4}
    return AutoConfig.for_model(
        family.model_type, vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITION_EMBEDDINGS, tie_word_embeddings=family.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, **dims, **extra)


def build_family_model(family: Family, tokenizer, size: str = "tiny", seed: int = 0):
    """A randomly initialised causal LM of `family` matched to `tokenizer`, built under a forked RNG."""
    import torch
    from transformers import AutoModelForCausalLM

    config = family_config(family, tokenizer, size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    gen = model.generation_config
    gen.pad_token_id, gen.bos_token_id, gen.eos_token_id = (tokenizer.pad_token_id, tokenizer.bos_token_id,
                                                           tokenizer.eos_token_id)
    return model
