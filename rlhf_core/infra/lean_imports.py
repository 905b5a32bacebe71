"""Process start-up: transformers loads its models without importing scikit-learn.

transformers imports `sklearn.metrics` (and with it scipy.stats) as soon as a model class is
loaded, whenever scikit-learn is installed, for one thing only: tuning the confidence threshold of
assisted (speculative) decoding, which nothing in this project runs. MLflow requires
scikit-learn, so it is always installed here, and that import cost every process that loads a
model (each stage, each RL role, each rollout engine) about 1 s of its start on a 2-core CPU
(benchmarks/README.md, "Start-up").

`skip_sklearn_in_transformers()` runs when `rlhf_core` is imported: transformers' utilities module,
when it loads, reports scikit-learn as absent *to transformers*; `import sklearn` itself works as
before (a reward function may use it). `RLHF_TRANSFORMERS_SKLEARN=1` leaves transformers as it is.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

TARGET = "transformers.utils"
OPT_OUT = "RLHF_TRANSFORMERS_SKLEARN"


def sklearn_absent() -> bool:
    """transformers' `is_sklearn_available`, as this project's processes answer it."""
    return False


def _patch(module) -> None:
    module.is_sklearn_available = sklearn_absent


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds `transformers.utils` with the other finders and patches it right after it executes
    (before transformers' generation code reads the flag); then steps out of the import system."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)  # once, and never asked about its own lookup below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


def skip_sklearn_in_transformers() -> None:
    if os.environ.get(OPT_OUT) == "1" or "transformers.generation.candidate_generator" in sys.modules:
        return  # asked not to, or too late: transformers already read the flag
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    elif not any(isinstance(finder, _PatchOnLoad) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnLoad())
