"""The RLHF lifecycle library: stages, trainers, rollout engines and their infrastructure."""

from rlhf_core.infra.lean_imports import skip_mlflow_in_deepspeed, skip_sklearn_in_transformers

skip_sklearn_in_transformers()
skip_mlflow_in_deepspeed()
