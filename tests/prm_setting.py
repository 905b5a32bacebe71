"""The PRM tests' setting (tests/learning/test_prm_learning.py), built beside the tests by
tests/settings.py: the column-addition task's data, tokenizer and base (4000 training rows, 30% of
the demonstrations wrong); an SFT policy trained on its demonstrations; a process reward model
trained from that policy (it can add already: the PRM learns to check) on the step rows. fp32, one
in-process rank each: the same on every CPU kind."""

from __future__ import annotations

from pathlib import Path

TRAIN = ["--max_len", "64", "--packing_samples", "--param_dtype", "fp32", "--train_batch_size", "32",
         "--micro_train_batch_size", "32", "--max_epochs", "3", "--learning_rate", "1e-3", "--lr_warmup_ratio",
         "0.05", "--seed", "0", "--use_mlflow", "false"]


def build(root: Path) -> dict:
    from rlhf_core.cli import main
    from rlhf_core.stages.prep import prepare

    paths = prepare(root / "prep", task="addition_steps", n_train=4000, n_test=200, demo_error_rate=0.3)
    policy, prm = root / "sft", root / "prm"
    # 750 steps: greedy 1.0, sampled 0.73 (its demonstrations' errors); 375 steps left it at 0.08 sampled
    assert main(["train", "sft", "--pretrain", paths["base"], "--dataset", f"json@{paths['sft']}",
                 "--input_key", "prompt", "--output_key", "response", "--apply_chat_template", "--save_path",
                 str(policy), *TRAIN, "--max_epochs", "6"]) == 0
    assert main(["train", "prm", "--pretrain", str(policy), "--dataset", f"json@{paths['prm']}",
                 "--placeholder_token", "ки", "--reward_tokens", "+", "-", "--save_path", str(prm), *TRAIN]) == 0
    return {**{k: str(v) for k, v in paths.items()}, "policy": str(policy), "prm_model": str(prm), "root": str(root)}
