"""Rollouts with vLLM (GPU only; `pip install 'rlhf-lifecycle[gpu]'`), behind the same interface.

vllm is imported when an engine is built, never at module import, so CPU machines never need it.
Prompts are tokenized by our tokenizer and handed over as token ids: vLLM's own text path adds
the tokenizer's special tokens, which would put a second BOS in front of a chat-templated prompt.
Each prompt gets its own sampling seed (`seed + index`), so results do not depend on how vLLM
schedules the batch; greedy requests run once per prompt and are repeated, like the transformers
engine. `generation_config="vllm"` keeps a checkpoint's sampling defaults out, as there.
"""

from __future__ import annotations

import gc
import importlib.util

import torch

from rlhf_core.rollout.base import Completion, RolloutEngine, check_request, cut_at_eos


def vllm_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


class VLLMEngine(RolloutEngine):
    def __init__(self, model_path: str, add_special_tokens: bool = False, gpu_memory_utilization: float = 0.4,
                 dtype: str = "auto", enforce_eager: bool = False, seed: int = 0):
        from vllm import LLM

        from rlhf_core.models.loading import load_tokenizer

        self.tokenizer = load_tokenizer(model_path)
        self.add_special_tokens = add_special_tokens
        # Leaves room on the GPU for the transformers models evaluation loads next to it.
        self.llm = LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
                       gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                       generation_config="vllm")
        self.eos_ids = {self.tokenizer.eos_token_id}

    def generate(self, prompts: list[str], n: int = 1, temperature: float = 0.0, max_new_tokens: int = 64,
                 seed: int = 0) -> list[list[Completion]]:
        from vllm import SamplingParams

        check_request(n, temperature, max_new_tokens)
        greedy = temperature == 0
        inputs = [{"prompt_token_ids": self.tokenizer(p, add_special_tokens=self.add_special_tokens)["input_ids"]}
                  for p in prompts]
        params = [SamplingParams(n=1 if greedy else n, temperature=temperature, top_p=1.0, max_tokens=max_new_tokens,
                                 seed=seed + i, skip_special_tokens=True, repetition_penalty=1.0)
                  for i in range(len(prompts))]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        results = []
        for out in outputs:
            group = [self._completion(list(c.token_ids)) for c in out.outputs]
            results.append(group * n if greedy else group)
        return results

    def _completion(self, token_ids: list[int]) -> Completion:
        response = cut_at_eos(token_ids, self.eos_ids)
        return Completion(self.tokenizer.decode(response, skip_special_tokens=True), tuple(response))

    def close(self) -> None:
        engine = getattr(getattr(self, "llm", None), "llm_engine", None)
        core = getattr(engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        gc.collect()
        torch.cuda.empty_cache()
