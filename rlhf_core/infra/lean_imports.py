"""Process start-up: transformers loads its models without importing scikit-learn, DeepSpeed
without importing MLflow.

transformers imports `sklearn.metrics` (and with it scipy.stats) as soon as a model class is
loaded, whenever scikit-learn is installed, for one thing only: tuning the confidence threshold of
assisted (speculative) decoding, which nothing in this project runs. MLflow requires
scikit-learn, so it is always installed here, and that import cost every process that loads a
model (each stage, each RL role, each rollout engine) about 1 s of its start on a 2-core CPU
(benchmarks/README.md, "Start-up").

`skip_sklearn_in_transformers()` runs when `rlhf_core` is imported: transformers' utilities module,
when it loads, reports scikit-learn as absent *to transformers*; `import sklearn` itself works as
before (a reward function may use it). `RLHF_TRANSFORMERS_SKLEARN=1` leaves transformers as it is.

`skip_mlflow_in_deepspeed()`, likewise: DeepSpeed's autotuner imports MLflow at module level to log
autotuning experiments (`deepspeed --autotuning`, which this project never runs), so every process
that imports DeepSpeed imported MLflow too. Inside that one module the import now fails, as where
MLflow is not installed; `RLHF_DEEPSPEED_MLFLOW=1` leaves DeepSpeed as it is.
"""

from __future__ import annotations

import builtins
import importlib.abc
import importlib.util
import os
import sys

TARGET = "transformers.utils"
OPT_OUT = "RLHF_TRANSFORMERS_SKLEARN"
AUTOTUNER = "deepspeed.autotuning.autotuner"
AUTOTUNER_OPT_OUT = "RLHF_DEEPSPEED_MLFLOW"


def sklearn_absent() -> bool:
    """transformers' `is_sklearn_available`, as this project's processes answer it."""
    return False


def _patch(module) -> None:
    module.is_sklearn_available = sklearn_absent


def _refuse_mlflow(module) -> None:
    """Before DeepSpeed's autotuner executes: its module-level `import mlflow` (for logging autotuning
    experiments, which nothing here runs) fails inside that module only, so DeepSpeed sets its
    `has_mlflow` False instead of importing MLflow into every process that imports DeepSpeed (0.5 s
    on a 2-core AMD EPYC, Zen 4 class; the `rlhf` command keeps MLflow in a process of its own, infra/mlflow_side.py)."""
    real = builtins.__import__

    def refusing(name, globals=None, locals=None, fromlist=(), level=0):
        if level == 0 and name.split(".", 1)[0] == "mlflow":
            raise ImportError(f"{AUTOTUNER} does not import MLflow in this project ({AUTOTUNER_OPT_OUT}=1 lets it)")
        return real(name, globals, locals, fromlist, level)

    module.__builtins__ = {**builtins.__dict__, "__import__": refusing}


def _restore_builtins(module) -> None:
    module.__builtins__ = builtins  # what its functions import later, they import as anywhere else


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Finds `target` with the other finders and runs `before` and `after` around its execution;
    then steps out of the import system."""

    def __init__(self, target: str, before=None, after=None):
        self.target, self.before, self.after = target, before, after

    def find_spec(self, name, path=None, target=None):
        if name != self.target:
            return None
        sys.meta_path.remove(self)  # once, and never asked about its own lookup below
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            if self.before is not None:
                self.before(module)
            try:
                execute(module)
            finally:
                if self.after is not None:
                    self.after(module)

        spec.loader.exec_module = exec_module
        return spec


def _on_load(target: str, before=None, after=None) -> None:
    if not any(isinstance(finder, _PatchOnLoad) and finder.target == target for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnLoad(target, before, after))


def skip_sklearn_in_transformers() -> None:
    if os.environ.get(OPT_OUT) == "1" or "transformers.generation.candidate_generator" in sys.modules:
        return  # asked not to, or too late: transformers already read the flag
    if TARGET in sys.modules:
        _patch(sys.modules[TARGET])
    else:
        _on_load(TARGET, after=_patch)


def skip_mlflow_in_deepspeed() -> None:
    if os.environ.get(AUTOTUNER_OPT_OUT) == "1" or AUTOTUNER in sys.modules:
        return  # asked not to, or too late
    _on_load(AUTOTUNER, before=_refuse_mlflow, after=_restore_builtins)
