"""Held-out task accuracy: greedy generation checked by the task's exact verifier.

Prompts are formatted the way training formatted them (chat template or not), generated in
left-padded batches, and decoded after the prompt. The result is the fraction of prompts whose
completion the verifier accepts, plus a few samples to show.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlhf_core.data.synthetic import get_task
from rlhf_core.models.loading import load_causal_lm, load_tokenizer


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 64) -> list[str]:
    """Greedy completions (decoded, special tokens removed) for already-formatted prompts."""
    tokenizer.padding_side = "left"
    outputs: list[str] = []
    model.eval()
    try:
        for i in range(0, len(prompts), batch_size):
            enc = tokenizer(prompts[i : i + batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            outputs += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = "right"
    return outputs


def exact_match(model_path: str, prompts_file: str, task: str, apply_chat_template: bool = True,
                max_new_tokens: int | None = None, limit: int | None = None) -> dict:
    """Exact-match accuracy of `model_path` on a prompts jsonl (`prompt`, `answer`)."""
    rows = [json.loads(line) for line in Path(prompts_file).read_text().splitlines() if line.strip()]
    rows = rows[:limit] if limit else rows
    tokenizer = load_tokenizer(model_path)
    model = load_causal_lm(model_path)
    formatted = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                               add_generation_prompt=True) if apply_chat_template else r["prompt"]
                 for r in rows]
    verifier = get_task(task)
    completions = generate(model, tokenizer, formatted, max_new_tokens or verifier.max_answer_len + 1)
    correct = [verifier.verify(c, r["answer"]) for c, r in zip(completions, rows, strict=True)]
    samples = [{"prompt": r["prompt"], "answer": r["answer"], "completion": c}
               for r, c in zip(rows[:5], completions[:5], strict=True)]
    return {"accuracy": sum(correct) / max(1, len(correct)), "n": len(correct), "samples": samples}
