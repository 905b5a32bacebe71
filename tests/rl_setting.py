"""The RL tests' shared setting: sort with 30% wrong SFT demonstrations. An SFT model of it answers held-out prompts right greedily
(~98%) but only ~65-70% of the time sampled at temperature 1; a reward model trained on the (always
correct) preference pairs ranks ~98% of held-out pairs. fp32, one in-process rank each: the same on
every CPU kind.

Building it trains for minutes on the CPU: tests/settings.py builds it beside the tests.
"""

from __future__ import annotations

from pathlib import Path


def build(root: Path) -> dict:
    from rlhf_core.cli import main
    from rlhf_core.stages.prep import prepare

    paths = prepare(root / "prep", task="sort", seed=0, model_size="tiny", n_train=4000, n_test=200,
                    demo_error_rate=0.3)
    common = ["--apply_chat_template", "--max_len", "64", "--packing_samples", "--param_dtype", "fp32",
              "--lr_warmup_ratio", "0.05", "--seed", "0", "--use_mlflow", "false", "--learning_rate", "1e-3",
              "--max_epochs", "50"]
    assert main(["train", "sft", "--pretrain", paths["base"], "--dataset", f"json@{paths['sft']}",
                 "--save_path", str(root / "sft"), "--train_batch_size", "32", "--micro_train_batch_size", "32",
                 "--max_steps", "1000", *common]) == 0
    assert main(["train", "rm", "--pretrain", str(root / "sft"), "--dataset", f"json@{paths['preference']}",
                 "--save_path", str(root / "rm"), "--train_batch_size", "64", "--micro_train_batch_size", "32",
                 "--max_steps", "300", *common]) == 0
    return {"sft": str(root / "sft"), "rm": str(root / "rm"), "prompts": str(paths["prompts"]), "root": str(root)}
