"""Rollouts on CPU or GPU with a loaded `transformers` causal LM and our own sampling loop.

Prompts are left-padded into batches of at most `batch_size` sequences (prompts x samples) for
`rollout/sampling.py`. Greedy decoding runs once per prompt and repeats the result. Batch b uses a
generator seeded `seed + b`. No checkpoint `generation_config` is consulted: hub models' top-k/
top-p/penalty defaults must not reshape the policy's distribution.

`autocast_dtype` (the RL stage's half dtype) runs the forward under autocast over the fp32
weights, as the trainer's forward does, so the sampler's log-probs are the trainer's (mismatch
at rounding). On a GPU, `sleep`/`wake_up` move the weights to host memory and back, so a
colocated trainer has the device to itself; on CPU there is nothing to free.
"""

from __future__ import annotations

import torch

from rlhf_core.rollout.base import (
    Budget,
    RolloutEngine,
    Sample,
    check_request,
    inference_device,
    inference_dtype,
)
from rlhf_core.rollout.sampling import sample


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

    def __init__(self, model, tokenizer, batch_size: int = 64, add_special_tokens: bool = False,
                 autocast_dtype: torch.dtype | None = None):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        # Generate under autocast in this dtype (the trainer's half precision; weights stay as loaded):
        # the sampler then computes what the trainer's forward computes, with the faster matmuls.
        self.autocast_dtype = autocast_dtype
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

    def generate_ids(self, prompt_ids: list[list[int]], n: int = 1, temperature: float = 0.0,
                     max_new_tokens: Budget = 64, seed: int = 0, top_k: int = -1, top_p: float = 1.0
                     ) -> list[list[Sample]]:
        budgets = check_request(len(prompt_ids), n, temperature, max_new_tokens, top_k, top_p)
        greedy = temperature == 0
        per_prompt = 1 if greedy else n
        prompts_per_batch = max(1, self.batch_size // per_prompt)
        device = self.device
        eos = set(self.eos_ids)
        results: list[list[Sample]] = []
        for b, start in enumerate(range(0, len(prompt_ids), prompts_per_batch)):
            chunk = prompt_ids[start : start + prompts_per_batch]
            limits = budgets[start : start + prompts_per_batch]
            input_ids, attention = left_pad(chunk, self.pad_id)
            generator = torch.Generator(device).manual_seed(seed + b)
            with torch.autocast(device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
                tokens, logprobs, lengths = sample(self.model, input_ids.to(device), attention.to(device),
                                                   limits, temperature, self.eos_ids, self.pad_id, generator,
                                                   repeats=per_prompt, top_k=top_k, top_p=top_p)
            tokens, logprobs, lengths = tokens.tolist(), logprobs.tolist(), lengths.tolist()
            for i in range(len(chunk)):
                group = []
                for j in range(i * per_prompt, (i + 1) * per_prompt):
                    ids = tuple(tokens[j][: lengths[j]])
                    group.append(Sample(ids, tuple(logprobs[j][: lengths[j]]), bool(ids) and ids[-1] in eos))
                results.append(group * n if greedy else group)
        return results

    def update_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy the policy's weights in (cast to the engine's dtype); every parameter must be named."""
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        missing = [k for k in missing if k not in self._tied_names()]
        if missing or unexpected:
            raise ValueError(f"update_weights: weights do not match the engine's model (missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]})")

    def _tied_names(self) -> set[str]:
        tied = getattr(self.model, "_tied_weights_keys", None) or []
        return set(tied if isinstance(tied, (list, tuple, set)) else tied.keys())

    def sleep(self) -> None:
        if self.device.type == "cuda":
            self.model.to("cpu")
            torch.cuda.empty_cache()
            self._asleep_on = torch.device("cuda")

    def wake_up(self) -> None:
        if getattr(self, "_asleep_on", None) is not None:
            self.model.to(self._asleep_on)
            self._asleep_on = None

    def close(self) -> None:
        self.model = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
