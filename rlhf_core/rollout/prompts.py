"""Prompt sets for generation: rows of (prompt, answer) read and checked like training data.

Sources are what `--dataset` accepts, through the same loader and DataErrors. Answers are
required only where a verifier needs them. Prompts are formatted by the trainers'
`PromptFormatter`, so a model is asked exactly what it was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlhf_core.config import DataConfig
from rlhf_core.data.examples import PromptFormatter
from rlhf_core.data.loading import DataError, check_rows, has_split, load_mixture, resolve_source


@dataclass
class PromptSet:
    prompts: list  # raw prompts: text, or a list of {role, content} messages
    answers: list[str | None]
    sources: list[dict]  # dataset descriptors (spec, split, rows, path, digest) for lineage

    def __len__(self) -> int:
        return len(self.prompts)


def held_out_split(dataset: str) -> str:
    """"test" when every source has one (json@DIR), else "train" (a single file is its own split)."""
    sources = [resolve_source(s) for s in dataset.split(",") if s.strip()]
    return "test" if sources and all(has_split(s, "test") for s in sources) else "train"


def load_prompt_set(dataset: str, split: str, input_key: str = "prompt", label_key: str = "answer",
                    require_answers: bool = False, max_samples: int = 100_000_000, seed: int = 0,
                    chat: bool = False, probs: list[float] | None = None) -> PromptSet:
    """Read and check prompts (and answers), several datasets mixed by `probs` (None: by their
    sizes); raises DataError naming the file, row and key."""
    text_keys = [input_key, label_key] if require_answers else [input_key]
    chat_keys = {input_key} if chat else set()
    ds, described = load_mixture(dataset, split, probs, max_samples, seed, [input_key, label_key],
                                 lambda d, where: check_rows(d, where, text_keys, chat_keys=chat_keys))
    if len(ds) == 0:
        raise DataError(f"{dataset}: no prompts in the {split!r} split")
    answers = ds[label_key] if label_key in ds.column_names else [None] * len(ds)
    return PromptSet(list(ds[input_key]), [None if a is None else str(a) for a in answers], described)


def prompt_formatter(tokenizer, apply_chat_template: bool, input_template: str | None = None,
                     tokenizer_chat_template: str | None = None) -> PromptFormatter:
    """The trainers' formatter outside a training data config (only its formatting fields matter)."""
    cfg = DataConfig.model_construct(apply_chat_template=apply_chat_template, input_template=input_template,
                                     tokenizer_chat_template=tokenizer_chat_template)
    return PromptFormatter(tokenizer, cfg)
