"""A trained reward model as a reward source, loaded with nothing but `transformers`.

The model is what `rlhf train rm` saves, loaded as a one-label `AutoModelForSequenceClassification`.
Each (prompt, response) becomes the token ids the trainer built (`PromptFormatter` prompt, then
the response plus EOS). The score is read at each row's last real token, found from the attention
mask: the classifier's own pooling looks for the pad id, which breaks when pad == EOS.
`normalize=True` applies the reward mean/std stored in the model config.
"""

from __future__ import annotations

import torch

from rlhf_core.data.examples import prompt_token_ids
from rlhf_core.rollout.base import inference_device, inference_dtype
from rlhf_core.rollout.prompts import prompt_formatter


class RewardModelReward:
    def __init__(self, path: str, apply_chat_template: bool = True, normalize: bool = False, batch_size: int = 32,
                 device: torch.device | None = None, dtype: torch.dtype | None = None,
                 value_head_prefix: str | None = None, use_fast: bool = True):
        from transformers import AutoConfig

        from rlhf_core.models.loading import load_reward_model, load_tokenizer

        device = device or inference_device()
        self.tokenizer = load_tokenizer(path, use_fast=use_fast)
        # A head saved under another name (OpenRLHF's `value_head`): the one given, else the config's.
        prefix = value_head_prefix or getattr(AutoConfig.from_pretrained(path), "value_head_prefix", None) or "score"
        self.model = load_reward_model(path, self.tokenizer.pad_token_id, prefix,
                                       dtype=dtype or inference_dtype(device)).to(device).eval()
        self.formatter = prompt_formatter(self.tokenizer, apply_chat_template)
        self.batch_size = batch_size
        self.shift, self.scale = 0.0, 1.0
        if normalize:
            mean, std = (getattr(self.model.config, k, None) for k in ("reward_mean", "reward_std"))
            if mean is None or not std:
                raise ValueError(f"{path}: no reward_mean/reward_std in the model config to normalise with "
                                 "(saved by `rlhf train rm`)")
            self.shift, self.scale = float(mean), float(std)

    def sequences(self, prompts: list, responses: list[str]) -> list[list[int]]:
        """Token ids of each (prompt, response) exactly as the reward-model trainer builds them."""
        fmt = self.formatter
        return [fmt.prompt_ids(p) + fmt.completion_ids(r) for p, r in zip(prompts, responses, strict=True)]

    def sequences_from_text(self, prompt_texts: list[str], responses: list[str]) -> list[list[int]]:
        """Token ids of (already formatted prompt text, response): the text is tokenized as it is,
        with the tokenizer's own special tokens (e.g. BOS) only when it does not already start with
        BOS (a chat template writes its own), which is how `sequences` tokenizes a prompt it formats."""
        ids = [prompt_token_ids(self.tokenizer, t, templated=False) for t in prompt_texts]
        return [p + self.formatter.completion_ids(r) for p, r in zip(ids, responses, strict=True)]

    def score(self, prompts: list, responses: list[str], answers: list[str | None] | None = None) -> list[float]:
        return self.score_sequences(self.sequences(prompts, responses))

    @torch.no_grad()
    def score_sequences(self, seqs: list[list[int]]) -> list[float]:
        """The head's value at each sequence's last token, normalised when asked."""
        device = next(self.model.parameters()).device
        body = getattr(self.model, self.model.base_model_prefix)
        pad_id = self.tokenizer.pad_token_id
        scores: list[float] = []
        for i in range(0, len(seqs), self.batch_size):
            chunk = seqs[i : i + self.batch_size]
            width = max(len(s) for s in chunk)
            input_ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in chunk], device=device)
            attention = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in chunk], device=device)
            hidden = body(input_ids=input_ids, attention_mask=attention, use_cache=False).last_hidden_state
            values = self.model.score(hidden).squeeze(-1).float()  # (B, T)
            last = attention.sum(-1) - 1
            scores += values[torch.arange(len(chunk), device=device), last].tolist()
        return [(s - self.shift) / self.scale for s in scores]
