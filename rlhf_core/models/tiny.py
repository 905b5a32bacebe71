"""The tiny-model factory: a BPE tokenizer trained on task text and a small random Llama.

With no model hub, ``rlhf prep`` still hands the pipeline a model and tokenizer that plain
``transformers`` loads, small enough to train on a laptop CPU in minutes.

- Byte-level BPE (no GPT-2 regex, all 256 bytes in the alphabet): no unknown token, and
  ``decode(encode(t)) == t`` exactly.
- Every digit and uppercase letter is its own pre-token, so one token: a tiny model learns
  carries and reversals only when it sees characters. Lowercase template words may merge.
- Special tokens ``<|pad|> <|bos|> <|eos|> <|user|> <|assistant|>`` are ids 0-4. Encoding adds no
  BOS; the chat template writes it, so templated text is encoded with ``add_special_tokens=False``.
- The template renders ``<|bos|><|user|>PROMPT<|assistant|>RESPONSE<|eos|>``; the prompt ends on a
  special token, so its ids are a prefix of the full conversation's (response-only loss masks
  rely on it).
- A standard ``LlamaForCausalLM`` so DeepSpeed, vLLM and peft know it; tied embeddings (tiny
  vocabulary); built under a forked torch RNG, leaving the caller's random state alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rlhf_core.models.sizes import MAX_POSITION_EMBEDDINGS, size_dims

PAD, BOS, EOS, USER, ASSISTANT = "<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT]

DEFAULT_VOCAB_SIZE = 384

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + ASSISTANT + "' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('tiny chat template supports only user and assistant roles') }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)



def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE,
                    specials: Iterable[str] = tuple(SPECIAL_TOKENS), pad: str | None = PAD, bos: str | None = BOS,
                    eos: str = EOS, chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts`` (see the module docstring for its rules).

    ``vocab_size`` is an upper bound: task text has few distinct words, so training usually stops
    with fewer merges than that allows. ``specials`` take ids 0.. in order; the defaults are this
    module's tokens and template (`models/families.py` passes a family's).
    """
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex("[A-Z]"), behavior="isolated"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=pad,
        bos_token=bos,
        eos_token=eos,
        padding_side="right",
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def build_tiny_llama(
    tokenizer: PreTrainedTokenizerFast, size: str = "tiny", seed: int = 0, dropout: float = 0.0
) -> LlamaForCausalLM:
    """A randomly initialised Llama sized by ``MODEL_SIZES[size]`` (`sizes.size_dims`), matched to ``tokenizer``.

    ``dropout``: Llama's attention dropout (its only dropout), active in training mode. It draws
    from torch's global RNG at every training forward, so a resumed run equals an uninterrupted
    one only if every rank's RNG state is restored (the resume tests train with it on).
    """
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attention_dropout=dropout,
        **size_dims(size),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model
