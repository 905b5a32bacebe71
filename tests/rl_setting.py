"""The RL tests' shared setting, built by its own process (`python -m tests.rl_setting ROOT`): sort
with 30% wrong SFT demonstrations. An SFT model of it answers held-out prompts right greedily
(~98%) but only ~65-70% of the time sampled at temperature 1; a reward model trained on the (always
correct) preference pairs ranks ~98% of held-out pairs. fp32, one in-process rank each: the same on
every CPU kind.

Building it trains for minutes on the CPU. conftest starts this process, niced, as soon as a test
that needs the setting is collected, so it trains on the cores the tests before that one leave idle
(they mostly wait on Ray, Prefect and their subprocesses); the `rl_setting` fixture then waits for
it and reads `setting.json`.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from tests.background import BackgroundProcess

REPO = Path(__file__).resolve().parents[1]


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
    setting = {"sft": str(root / "sft"), "rm": str(root / "rm"), "prompts": paths["prompts"], "root": str(root)}
    (root / "setting.json").write_text(json.dumps(setting))
    return setting


class PendingSetting(BackgroundProcess):
    """The build, started in the background; `stop` also removes what it wrote."""

    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, RLHF_HOME=str(root / ".rlhf"), RLHF_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false")
        env.pop("RAY_ADDRESS", None)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        # (started at full priority, it slowed the first pipeline beside it from 160 to 407 s)
        super().__init__([sys.executable, "-m", "tests.rl_setting", str(root)], root / "build.log", cwd=REPO, env=env)

    def result(self, timeout_s: float = 1800) -> dict:
        self.wait(timeout_s)
        return json.loads((self.root / "setting.json").read_text())

    def stop(self) -> None:
        super().stop()
        shutil.rmtree(self.root, ignore_errors=True)


if __name__ == "__main__":
    build(Path(sys.argv[1]))
