"""Generation engines behind one interface (`RolloutEngine`): transformers anywhere, vLLM on GPUs
(its CUDA build) and CPUs (its CPU build).

`make_engine(path, backend)` picks one: "auto" is vLLM on a GPU with vLLM installed, else
transformers (on CPUs the transformers engine is the default: see `auto_backend`); asking for vLLM
where it cannot run is an error, never a silent fallback (a run should do what its config says).
"""

from __future__ import annotations

from rlhf_core.rollout.base import Completion, RolloutEngine
from rlhf_core.rollout.hf import TransformersEngine
from rlhf_core.rollout.prompts import PromptSet, load_prompt_set, prompt_formatter
from rlhf_core.rollout.vllm_engine import vllm_available

__all__ = ["Completion", "PromptSet", "RolloutEngine", "TransformersEngine", "load_prompt_set", "make_engine",
           "prompt_formatter", "vllm_available"]


def auto_backend():
    """The engine `auto` means here: vLLM on a GPU where it is installed; the transformers engine on
    CPUs, vLLM's CPU build included (measured: benchmarks/README.md, "Rollout engines on CPU")."""
    import torch

    from rlhf_core.config import RolloutBackend

    return RolloutBackend.VLLM if torch.cuda.is_available() and vllm_available() else RolloutBackend.TRANSFORMERS


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
        raise ConfigError("--rollout_backend vllm: vLLM is not installed for this machine (GPUs: pip install "
                          "'rlhf-lifecycle[gpu]'; CPUs: vLLM's CPU build, README), or use --rollout_backend "
                          "transformers")
    if backend == RolloutBackend.AUTO:
        backend = auto_backend()
    if backend == RolloutBackend.VLLM:
        import torch

        from rlhf_core.rollout.base import inference_dtype
        from rlhf_core.rollout.vllm_engine import VLLMEngine

        # the transformers engine's dtype (fp32 on CPU, bf16 on GPU), not vLLM's "auto" (half precision
        # for an fp32 checkpoint): both engines evaluate a model alike
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dtype = str(inference_dtype(device)).removeprefix("torch.")
        return VLLMEngine(model_path, add_special_tokens=add_special_tokens, dtype=dtype)
    return TransformersEngine.from_pretrained(model_path, add_special_tokens=add_special_tokens)
