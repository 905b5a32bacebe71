"""SFT learns the built-in RL setting: held-out exact match of the shared `rl_setting` SFT model.

Multi-minute training tests live in tests/learning: `rl_setting` trains 1000 SFT steps for this
test and the RL tests (test_rl_stage.py), whichever runs first."""

import json
from pathlib import Path

import pytest

SFT_EXACT_MATCH = 0.85  # held-out greedy exact match of rl_setting's SFT model (benchmarks/README.md: 0.98)


@pytest.mark.timeout(2400)
@pytest.mark.usefixtures("one_torch_thread")
def test_sft_answers_held_out_prompts(rl_setting, tmp_path):
    """Held-out exact match (greedy, the task's verifier) by `rlhf eval`, of the SFT model that
    `rl_setting` trains (sort, 1000 steps, 30% of the demonstrations wrong; shared with the RL
    tests): ~98% greedy per benchmarks/README.md and conftest; the random base answers none; a trainer that learned only the
    format, or from the wrong tokens, stays far below the threshold."""
    from rlhf_core.cli import main

    base = str(Path(rl_setting["root"]) / "prep" / "base")
    out = tmp_path / "eval"
    assert main(["eval", "--pretrain", rl_setting["sft"], "--ref_pretrain", base, "--dataset",
                 f"json@{rl_setting['prompts']}", "--task", "sort", "--max_samples", "100", "--n_samples_per_prompt", "1",
                 "--rollout_backend", "transformers", "--use_mlflow", "false", "--save_path", str(out)]) == 0
    m = json.loads((out / "eval.json").read_text())["metrics"]
    assert m["eval/reference/greedy_accuracy"] == 0.0, m
    assert m["eval/policy/greedy_accuracy"] >= SFT_EXACT_MATCH, m
