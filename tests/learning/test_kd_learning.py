"""Knowledge distillation teaches a student more than SFT does on the same rows and steps.

The rows are the RL setting's (`rl_setting`: sort, 30% of the demonstrations wrong). The teacher is
better than those rows, as a champion policy is better than its demonstrations: the same base
trained on clean demonstrations of the task. From the same base, 400 steps each on the noisy rows,
the distilled student (`rlhf train kd`, `--kd_coef 0.5`) answers held-out prompts right more often
under sampling than the SFT student: at the wrong demonstrations' tokens the teacher's distribution
still puts its mass on the right answer. Measured on a 2-core AMD EPYC (Zen 4 class), 200 held-out
prompts x 4 samples at temperature 1: see MARGIN. (A no-op distillation term is SFT: the test fails.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STEPS = "400"
COMMON = ["--apply_chat_template", "--max_len", "64", "--packing_samples", "--param_dtype", "fp32",
          "--lr_warmup_ratio", "0.05", "--seed", "0", "--use_mlflow", "false", "--learning_rate", "1e-3",
          "--max_epochs", "50", "--train_batch_size", "32", "--micro_train_batch_size", "32"]
# Sampled accuracy, distilled minus SFT. Measured as this test runs (600-step teacher: 0.925 greedy,
# 0.829 sampled): SFT 0.76 greedy / 0.3725 sampled, distilled 0.765 / 0.4775. Longer (a 1000-step
# teacher, 600 student steps): SFT 0.89 / 0.539, distilled 0.925 / 0.679 (--kd_coef 0.8: 0.905 / 0.72).
MARGIN = 0.06
GREEDY_NOISE = 0.02  # 200 prompts resolve about this much greedy accuracy: the greedy gain is not asserted


def accuracy(model: str, prompts: str, out: Path) -> dict[str, float]:
    from rlhf_core.cli import main

    assert main(["eval", "--pretrain", model, "--dataset", f"json@{prompts}", "--task", "sort", "--max_samples", "200",
                 "--n_samples_per_prompt", "4", "--rollout_backend", "transformers", "--use_mlflow", "false",
                 "--save_path", str(out)]) == 0
    metrics = json.loads((out / "eval.json").read_text())["metrics"]
    return {kind: metrics[f"eval/policy/{kind}_accuracy"] for kind in ("greedy", "sampled")}


@pytest.fixture(scope="module")
def clean_teacher(rl_setting, tmp_path_factory) -> str:
    """The RL setting's base trained on clean demonstrations (same task, seed and tokenizer's text)."""
    from rlhf_core.cli import main
    from rlhf_core.stages.prep import prepare

    root = tmp_path_factory.mktemp("kd")
    clean = prepare(root / "clean", task="sort", seed=0, model_size="tiny", n_train=4000, n_test=200,
                    demo_error_rate=0.0)
    base = str(Path(rl_setting["root"]) / "prep" / "base")
    assert main(["train", "sft", "--pretrain", base, "--dataset", f"json@{clean['sft']}", "--save_path",
                 str(root / "teacher"), "--max_steps", "600", *COMMON]) == 0
    return str(root / "teacher")


@pytest.mark.timeout(1800)
@pytest.mark.usefixtures("one_torch_thread")
def test_a_distilled_student_learns_more_than_sft_on_the_same_rows(rl_setting, clean_teacher, tmp_path):
    from rlhf_core.cli import main

    root = Path(rl_setting["root"])
    base, rows = str(root / "prep" / "base"), f"json@{root / 'prep' / 'data' / 'sft'}"
    assert main(["train", "sft", "--pretrain", base, "--dataset", rows, "--save_path", str(tmp_path / "sft"),
                 "--max_steps", STEPS, *COMMON]) == 0
    assert main(["train", "kd", "--pretrain", base, "--teacher_model", clean_teacher, "--kd_coef", "0.5",
                 "--dataset", rows, "--save_path", str(tmp_path / "kd"), "--max_steps", STEPS, *COMMON]) == 0
    prompts = rl_setting["prompts"]
    teacher = accuracy(clean_teacher, prompts, tmp_path / "eval_teacher")
    sft = accuracy(str(tmp_path / "sft"), prompts, tmp_path / "eval_sft")
    kd = accuracy(str(tmp_path / "kd"), prompts, tmp_path / "eval_kd")
    print(f"held-out accuracy: teacher {teacher}, SFT {sft}, distilled {kd}")
    assert teacher["sampled"] > 0.7, teacher  # better than the rows (SFT on them, 1000 steps: ~0.66)
    assert kd["sampled"] >= sft["sampled"] + MARGIN, (kd, sft)
    assert kd["greedy"] >= sft["greedy"] - GREEDY_NOISE, (kd, sft)
