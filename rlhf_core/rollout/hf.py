"""Rollouts with `transformers.generate`, on CPU or GPU.

Prompts are tokenized one by one and left-padded into batches (the position ids generate derives
from the attention mask keep padded rows exact). `n` samples per prompt come from
`num_return_sequences`; greedy decoding (temperature 0) runs once per prompt and repeats the
result. Sampling is seeded per batch inside a forked RNG, so a seed gives the same completions
on CPU and the caller's random state is left alone. Sampling parameters are passed explicitly
(top_k=0, top_p=1, no penalties): a checkpoint's generation_config, which hub models use to ship
top-k/top-p/penalty defaults, must not silently reshape the policy's distribution.
"""

from __future__ import annotations

import torch

from rlhf_core.rollout.base import (
    Completion,
    RolloutEngine,
    check_request,
    cut_at_eos,
    inference_device,
    inference_dtype,
)

GREEDY = {"do_sample": False, "num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}
UNSHAPED_SAMPLING = {"do_sample": True, "num_beams": 1, "top_k": 0, "top_p": 1.0, "min_p": None, "typical_p": 1.0,
                     "repetition_penalty": 1.0, "no_repeat_ngram_size": 0}


def left_pad(ids: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)`, both `(B, T_max)`, padding on the left."""
    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(ids), width), dtype=torch.long)
    for i, x in enumerate(ids):
        input_ids[i, width - len(x) :] = torch.tensor(x, dtype=torch.long)
        attention[i, width - len(x) :] = 1
    return input_ids, attention


class TransformersEngine(RolloutEngine):
    """Generation with a loaded causal LM; `batch_size` counts sequences (prompts x samples)."""

    def __init__(self, model, tokenizer, batch_size: int = 64, add_special_tokens: bool = False):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        # A chat template writes its own special tokens; a raw prompt gets the tokenizer's (as in training).
        self.add_special_tokens = add_special_tokens
        configured = model.generation_config.eos_token_id
        configured = configured if isinstance(configured, list) else [configured]
        self.eos_ids = sorted({tokenizer.eos_token_id, *configured} - {None})
        if not self.eos_ids:
            raise ValueError("the tokenizer has no eos_token: completions could never end")
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    @classmethod
    def from_pretrained(cls, path: str, device: torch.device | None = None, dtype: torch.dtype | None = None,
                        **kwargs) -> TransformersEngine:
        from rlhf_core.models.loading import load_causal_lm, load_tokenizer

        device = device or inference_device()
        model = load_causal_lm(path, dtype=dtype or inference_dtype(device)).to(device)
        return cls(model, load_tokenizer(path), **kwargs)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(self, prompts: list[str], n: int = 1, temperature: float = 0.0, max_new_tokens: int = 64,
                 seed: int = 0) -> list[list[Completion]]:
        check_request(n, temperature, max_new_tokens)
        greedy = temperature == 0
        per_prompt = 1 if greedy else n
        options = GREEDY if greedy else {**UNSHAPED_SAMPLING, "temperature": temperature}
        ids = [self.tokenizer(p, add_special_tokens=self.add_special_tokens)["input_ids"] for p in prompts]
        prompts_per_batch = max(1, self.batch_size // per_prompt)
        device = self.device
        results: list[list[Completion]] = []
        for b, start in enumerate(range(0, len(ids), prompts_per_batch)):
            chunk = ids[start : start + prompts_per_batch]
            input_ids, attention = left_pad(chunk, self.pad_id)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(seed + b)
                out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention.to(device),
                                          max_new_tokens=max_new_tokens, num_return_sequences=per_prompt,
                                          pad_token_id=self.pad_id, eos_token_id=self.eos_ids, **options)
            responses = out[:, input_ids.shape[1] :].tolist()
            for i in range(len(chunk)):
                group = [self._completion(r) for r in responses[i * per_prompt : (i + 1) * per_prompt]]
                results.append(group * n if greedy else group)
        return results

    def _completion(self, token_ids: list[int]) -> Completion:
        response = cut_at_eos(token_ids, set(self.eos_ids))
        return Completion(self.tokenizer.decode(response, skip_special_tokens=True), tuple(response))

    def close(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
