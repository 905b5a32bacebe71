"""Generation engines behind one interface (`RolloutEngine`): transformers anywhere, vLLM on GPU.

`make_engine(path, backend)` picks one: "auto" is vLLM when CUDA and vllm are both there, else
transformers; asking for vLLM where it cannot run is an error, never a silent fallback (the two
engines differ in speed by an order of magnitude, and a run should do what its config says).
"""

from __future__ import annotations

from rlhf_core.rollout.base import Completion, RolloutEngine
from rlhf_core.rollout.hf import TransformersEngine
from rlhf_core.rollout.prompts import PromptSet, load_prompt_set, prompt_formatter
from rlhf_core.rollout.vllm_engine import vllm_available

__all__ = ["Completion", "PromptSet", "RolloutEngine", "TransformersEngine", "load_prompt_set", "make_engine",
           "prompt_formatter", "vllm_available"]


def make_engine(model_path: str, backend: str = "auto", add_special_tokens: bool = False) -> RolloutEngine:
    """A rollout engine for a local model directory; `backend` is auto, transformers or vllm."""
    from rlhf_core.config import RolloutBackend
    from rlhf_core.infra.settings import ConfigError

    try:
        backend = RolloutBackend(backend)
    except ValueError:
        raise ConfigError(f"--rollout_backend {backend!r}: use one of "
                          f"{', '.join(b.value for b in RolloutBackend)}") from None
    if backend == RolloutBackend.VLLM and not vllm_available():
        import torch

        reason = "no CUDA device" if not torch.cuda.is_available() else "the vllm package is not installed"
        raise ConfigError(f"--rollout_backend vllm: {reason} (vLLM runs on GPUs only: pip install "
                          "'rlhf-lifecycle[gpu]'; or use --rollout_backend transformers)")
    if backend == RolloutBackend.VLLM or (backend == RolloutBackend.AUTO and vllm_available()):
        from rlhf_core.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model_path, add_special_tokens=add_special_tokens)
    return TransformersEngine.from_pretrained(model_path, add_special_tokens=add_special_tokens)
