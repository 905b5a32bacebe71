"""Where hub names (a model or dataset given as `org/name`) are fetched from: the Hugging Face Hub,
or ModelScope with `--use_ms` (OpenRLHF's flag), for users whose network reaches ModelScope better.

`use_modelscope` patches this process's Hugging Face download functions with ModelScope's
(`modelscope.utils.hf_util.patch_hub`, as OpenRLHF does); every process that loads by name calls
it: the driver, each training rank, each rollout engine (a vLLM engine reads `VLLM_USE_MODELSCOPE`).
"""

from __future__ import annotations

import importlib.util
import os

from rlhf_core.infra.settings import ConfigError

_PATCHED = False


def use_modelscope(enabled: bool) -> None:
    """`--use_ms`: hub names resolve on ModelScope in this process from now on (once per process)."""
    global _PATCHED
    if not enabled or _PATCHED:
        return
    if importlib.util.find_spec("modelscope") is None:
        raise ConfigError("--use_ms needs the modelscope package: pip install modelscope")
    from modelscope.utils.hf_util import patch_hub

    patch_hub()
    os.environ["VLLM_USE_MODELSCOPE"] = "True"  # vLLM's own switch, for an engine started from here
    _PATCHED = True
