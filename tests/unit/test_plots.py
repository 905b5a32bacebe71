"""rlhf_core.stages.plots: valid, small PNGs whose bytes follow the data; the stage curves read the right keys."""

import struct

import pytest

from rlhf_core.stages import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def report(kl_ppo=0.35):
    return {"policies": [{"name": "dpo", "uri": "a"}, {"name": "ppo", "uri": "b"}], "reference": "sft",
            "num_prompts": 200, "n_samples_per_prompt": 4, "temperature": 1.0,
            "metrics": {"eval/dpo/greedy_accuracy": 0.98, "eval/dpo/sampled_accuracy": 0.70, "eval/dpo/pass_at_4": 0.97,
                        "eval/ppo/greedy_accuracy": 0.975, "eval/ppo/sampled_accuracy": 0.82,
                        "eval/ppo/pass_at_4": 0.99, "eval/reference/greedy_accuracy": 0.995,
                        "eval/reference/sampled_accuracy": 0.69, "eval/reference/pass_at_4": 0.96,
                        "eval/dpo/reward": 1.2, "eval/ppo/reward": 1.5, "eval/reference/reward": 1.1,
                        "eval/dpo/win_rate": 0.498, "eval/ppo/win_rate": 0.61, "eval/dpo/kl": 0.13,
                        "eval/ppo/kl": kl_ppo}}


def test_line_panels_are_small_pngs_that_follow_the_data():
    panels = [("loss", {"train": [(s, 1 / s) for s in range(1, 50)], "held-out": [(0, 1.5), (49, 0.1)]})]
    a = plots.line_panels_png("sft", panels)
    width, height = png_size(a)
    assert 300 <= width <= 1100 and 200 <= height <= 900
    assert plots.line_panels_png("sft", panels) == a  # deterministic
    changed = [("loss", {"train": [(s, 2 / s) for s in range(1, 50)], "held-out": [(0, 1.5), (49, 0.1)]})]
    assert plots.line_panels_png("sft", changed) != a
    assert plots.line_panels_png("dpo", panels) != a  # the title is drawn
    with pytest.raises(ValueError):
        plots.line_panels_png("x", [])


def test_bar_panels_follow_the_values_and_check_their_length():
    a = plots.bar_panels_png("eval", ["p", "q"], [("acc", {"greedy": [0.5, 0.7]})], [True])
    png_size(a)
    assert plots.bar_panels_png("eval", ["p", "q"], [("acc", {"greedy": [0.5, 0.8]})], [True]) != a
    assert plots.bar_panels_png("eval", ["p", "r"], [("acc", {"greedy": [0.5, 0.7]})], [True]) != a
    with pytest.raises(ValueError, match="1 values for 2 names"):
        plots.bar_panels_png("eval", ["p", "q"], [("acc", {"greedy": [0.5]})])


def test_eval_comparison_draws_every_policy():
    a = plots.eval_comparison_png(report())
    width, height = png_size(a)
    assert width <= 1100 and height <= 900
    assert plots.eval_comparison_png(report(kl_ppo=0.5)) != a
    only = {"policies": [{"name": "policy", "uri": "a"}], "reference": None, "num_prompts": 4,
            "metrics": {"eval/policy/response_len": 3.0}}
    png_size(plots.eval_comparison_png(only))  # nothing but lengths: still a chart


def test_stage_panels_read_the_stage_keys_and_its_initial_evaluation():
    history = {"train/loss": [(1, 2.0), (2, 1.0)], "eval/loss": [(2, 1.1)], "eval_initial/loss": [(0, 5.0)],
               "train/accuracy": [(1, 0.6)], "train/lr": [(1, 1e-3)]}
    assert plots.stage_panels("rm", history) == [
        ("loss", {"train": [(1, 2.0), (2, 1.0)], "held-out": [(2, 1.1), (0, 5.0)]}),
        ("pairwise accuracy", {"train": [(1, 0.6)]})]
    ppo = plots.stage_panels("ppo", {"rollout/kl": [(1, 0.0), (2, 0.1)], "train/clip_frac": [(1, 0.02)]})
    assert [title for title, _ in ppo] == ["KL to reference (rollouts)", "clip fraction"]
    assert plots.stage_panels("kto", history)[0][0] == "loss"  # no curves of its own: the loss
    assert plots.training_curves_png("sft", "sft", {"train/lr": [(1, 1e-3)]}) is None
    assert "eval_initial/sampled_accuracy" in plots.curve_keys("ppo") and "rollout/kl" in plots.curve_keys("ppo")
    png_size(plots.training_curves_png("ppo", "ppo", {"rollout/kl": [(s, s / 100) for s in range(30)]}))


def test_the_guard_panel_draws_the_training_reward_against_each_held_out_check():
    """The reward-hacking guard's two numbers on one chart (issue 26): the training reward and the
    held-out checks (the verifier's accuracy and a gold reward model's score, on the selection
    prompts during training and the reported ones before and after), and the chart follows them."""
    rising = [(s, 0.4 + 0.03 * s) for s in range(1, 41)]
    history = {"rollout/reward_mean": rising,
               "select/sampled_accuracy": [(s, 0.6 - 0.01 * s) for s in range(0, 41, 4)],
               "eval_initial/sampled_accuracy": [(0, 0.62)], "eval/sampled_accuracy": [(40, 0.2)],
               "select/sampled_gold_reward": [(s, 1.0 - 0.05 * s) for s in range(0, 41, 4)],
               "eval/sampled_gold_reward": [(40, -1.0)], "eval_initial/sampled_gold_reward": [(0, 1.1)]}
    panels = dict(plots.stage_panels("ppo", history))
    guard = panels["training reward against the held-out check"]
    assert guard["training reward"] == rising
    assert guard["held-out accuracy (selection)"] == history["select/sampled_accuracy"]
    assert guard["held-out accuracy"] == [(40, 0.2), (0, 0.62)]  # before training too
    assert guard["gold reward (selection)"] == history["select/sampled_gold_reward"]
    assert guard["gold reward"] == [(40, -1.0), (0, 1.1)]
    assert {"select/sampled_gold_reward", "eval_initial/sampled_gold_reward"} <= plots.curve_keys("ppo")
    drawn = plots.training_curves_png("ppo", "ppo", history)
    png_size(drawn)
    held = {**history, "select/sampled_gold_reward": [(s, 1.0) for s in range(0, 41, 4)]}
    assert plots.training_curves_png("ppo", "ppo", held) != drawn  # the check's curve is drawn
    verifier_only = {k: v for k, v in history.items() if "gold" not in k}
    assert set(dict(plots.stage_panels("ppo", verifier_only))["training reward against the held-out check"]) == {
        "training reward", "held-out accuracy (selection)", "held-out accuracy"}
