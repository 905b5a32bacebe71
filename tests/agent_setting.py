"""The agent tests' setting (tests/learning/test_rl_agent_learning.py), built beside the tests by
tests/settings.py: the `multiply` task prepared and SFT'd on its demonstrations (a quarter call the
tool). One torch thread, as the tests of that file run."""

from __future__ import annotations

from pathlib import Path


def build(root: Path) -> dict:
    import torch

    from rlhf_core.cli import main

    torch.set_num_threads(1)
    prep = root / "prep"
    assert main(["prep", "--task", "multiply", "--out", str(prep), "--n_train", "4000", "--n_test", "200",
                 "--seed", "0"]) == 0
    sft = root / "sft"
    assert main(["train", "sft", "--pretrain", str(prep / "base"), "--dataset", f"json@{prep / 'data' / 'sft'}",
                 "--input_key", "messages", "--multiturn", "--apply_chat_template", "--max_len", "64",
                 "--packing_samples", "--param_dtype", "fp32", "--lr_warmup_ratio", "0.05", "--seed", "0",
                 "--use_mlflow", "false", "--learning_rate", "1e-3", "--max_epochs", "50", "--train_batch_size", "32",
                 "--micro_train_batch_size", "32", "--max_steps", "600", "--save_path", str(sft)]) == 0
    return {"sft": str(sft), "prompts": f"json@{prep / 'data' / 'prompts'}"}
