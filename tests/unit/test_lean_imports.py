"""Process start-up (infra/lean_imports.py): a process of this project loads a transformers model
without importing scikit-learn, which transformers only wants for assisted decoding; scikit-learn
itself stays importable, and RLHF_TRANSFORMERS_SKLEARN=1 restores transformers' own behaviour.
Naming `DataError` (the CLI, the flows and every RL role do) does not import `datasets`. DeepSpeed
loads without importing MLflow (its autotuner's only use of it), which stays importable."""

import os
import subprocess
import sys

LOADS_A_MODEL = """
import sys
import rlhf_core
from transformers import LlamaConfig, LlamaForCausalLM
LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2))
before = "sklearn" in sys.modules
import sklearn.metrics  # still there for whoever wants it
print(before, sklearn.metrics.roc_curve is not None)
"""


def run(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_a_model_loads_without_sklearn_which_stays_importable():
    assert run(LOADS_A_MODEL, RLHF_TRANSFORMERS_SKLEARN="0") == ["False", "True"]


def test_the_opt_out_gives_transformers_its_sklearn_back():
    assert run(LOADS_A_MODEL, RLHF_TRANSFORMERS_SKLEARN="1") == ["True", "True"]


def test_naming_data_errors_does_not_import_datasets():
    code = "import sys\nfrom rlhf_core.data.loading import DataError\nimport flows.user_errors\nprint('datasets' in sys.modules)"
    assert run(code) == ["False"]


IMPORTS_DEEPSPEED = """
import sys
import rlhf_core
import deepspeed
from deepspeed.autotuning import autotuner
before = "mlflow" in sys.modules
import mlflow  # still there for whoever wants it
print(before, autotuner.has_mlflow, mlflow.MlflowClient is not None)  # last: DeepSpeed prints to stdout
"""


def test_deepspeed_loads_without_mlflow_which_stays_importable():
    assert run(IMPORTS_DEEPSPEED, RLHF_DEEPSPEED_MLFLOW="0")[-3:] == ["False", "False", "True"]


def test_the_opt_out_gives_deepspeed_its_mlflow_back():
    assert run(IMPORTS_DEEPSPEED, RLHF_DEEPSPEED_MLFLOW="1")[-3:] == ["True", "True", "True"]
