"""The distillation tests' teacher (tests/learning/test_kd_learning.py), built beside the tests by
tests/settings.py after the RL setting: the RL setting's base trained on clean demonstrations
(same task, seed and tokenizer's text), and its held-out accuracy. One torch thread, as the tests
of that file run."""

from __future__ import annotations

import json
from pathlib import Path

COMMON = ["--apply_chat_template", "--max_len", "64", "--packing_samples", "--param_dtype", "fp32",
          "--lr_warmup_ratio", "0.05", "--seed", "0", "--use_mlflow", "false",
          "--max_epochs", "50", "--train_batch_size", "32", "--micro_train_batch_size", "32"]


def accuracy(model: str, prompts: str, out: Path) -> dict[str, float]:
    """Held-out greedy and sampled accuracy: 200 prompts, 4 samples each at temperature 1."""
    from rlhf_core.cli import main

    assert main(["eval", "--pretrain", model, "--dataset", f"json@{prompts}", "--task", "sort", "--max_samples", "200",
                 "--n_samples_per_prompt", "4", "--rollout_backend", "transformers", "--use_mlflow", "false",
                 "--save_path", str(out)]) == 0
    metrics = json.loads((out / "eval.json").read_text())["metrics"]
    return {kind: metrics[f"eval/policy/{kind}_accuracy"] for kind in ("greedy", "sampled")}


def build(root: Path, rl_setting: dict) -> dict:
    import torch

    from rlhf_core.cli import main
    from rlhf_core.stages.prep import prepare

    torch.set_num_threads(1)
    clean = prepare(root / "clean", task="sort", seed=0, model_size="tiny", n_train=4000, n_test=200,
                    demo_error_rate=0.0)
    base = str(Path(rl_setting["root"]) / "prep" / "base")
    assert main(["train", "sft", "--pretrain", base, "--dataset", f"json@{clean['sft']}", "--save_path",
                 str(root / "teacher"), "--max_steps", "600", "--learning_rate", "1e-3", *COMMON]) == 0
    teacher = str(root / "teacher")
    return {"teacher": teacher, "accuracy": accuracy(teacher, rl_setting["prompts"], root / "eval_teacher")}
