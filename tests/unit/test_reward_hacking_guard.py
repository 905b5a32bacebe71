"""The reward-hacking guard (rlhf_core/rl/guard.py): training reward up while the held-out check falls."""

import re

import pytest

from rlhf_core.rl.guard import Evaluation, Hacking, HackingGuard, reward_hacking


def evaluations(rewards, metrics, every=2):
    return [Evaluation(i * every, r, m) for i, (r, m) in enumerate(zip(rewards, metrics, strict=True))]


def test_it_fires_only_when_the_reward_rises_and_the_check_falls_by_the_margin():
    # reward 0.2 -> 0.9 while accuracy 0.60 -> 0.50 over the last 3 evaluations (steps 2..8)
    found = reward_hacking(evaluations([0.1, 0.2, 0.5, 0.7, 0.9], [0.6, 0.6, 0.58, 0.55, 0.5]), 3, 0.02)
    assert found == Hacking(since_step=2, step=8, reward_rise=pytest.approx(0.7), metric_drop=pytest.approx(0.1))
    assert "from step 2 to step 8" in found.message("eval/sampled_accuracy")
    assert reward_hacking(evaluations([0.2, 0.5, 0.7, 0.9], [0.6, 0.62, 0.65, 0.7]), 3, 0.02) is None  # learning
    assert reward_hacking(evaluations([0.9, 0.7, 0.5, 0.2], [0.6, 0.58, 0.55, 0.5]), 3, 0.02) is None  # both fall
    assert reward_hacking(evaluations([0.2, 0.5, 0.7, 0.9], [0.6, 0.6, 0.6, 0.59]), 3, 0.02) is None  # within margin
    assert reward_hacking(evaluations([0.2, 0.9, 0.9], [0.6, 0.5, 0.4]), 3, 0.02) is None  # window not full
    assert reward_hacking(evaluations([None, 0.5, 0.7, 0.9], [0.6, 0.55, 0.5, 0.4]), 3, 0.02) is None


def test_a_fall_within_the_noise_of_the_evaluations_does_not_fire():
    """Measured: an online round trained against the task's own verifier (which cannot be hacked)
    fired on 0.86 -> 0.84 over 100 responses while its reward rose by 0.003. Over 100 responses an
    evaluation's noise is about 0.05: such a fall is a draw; a fall of 0.15 from there is not, and
    over 1000 responses 0.04 is not either."""
    noise = evaluations([0.800, 0.801, 0.802, 0.803], [0.86, 0.87, 0.85, 0.84])
    assert reward_hacking(noise, 3, 0.02) is not None  # by the margin alone it fired
    assert reward_hacking(noise, 3, 0.02, "eval/sampled_accuracy", responses=100) is None
    fall = evaluations([0.8, 0.85, 0.9, 0.95], [0.86, 0.8, 0.76, 0.71])
    assert reward_hacking(fall, 3, 0.02, "eval/sampled_accuracy", responses=100).metric_drop == pytest.approx(0.15)
    assert reward_hacking(evaluations([0.8, 0.85, 0.9, 0.95], [0.86, 0.85, 0.84, 0.82]), 3, 0.02,
                          "eval/sampled_accuracy", responses=1000) is not None
    # a metric whose spread is not known (a held-out reward): the margin alone
    assert reward_hacking(noise, 3, 0.02, "eval/reward", responses=100) is not None


def test_the_guard_pairs_each_evaluation_with_the_rewards_before_it_and_resumes_its_window():
    g = HackingGuard("eval/acc", window=2, min_drop=0.05)
    assert g.evaluated(0, {"eval/acc": 0.8}) is None  # before training: its reward is the first rollout's
    g.rollout(0.1)
    g.rollout(0.3)
    assert g.evaluations[0].reward == 0.1
    assert g.evaluated(2, {"eval/acc": 0.78}) is None and g.evaluations[1].reward == pytest.approx(0.2)
    restored = HackingGuard("eval/acc", window=2, min_drop=0.05)
    restored.load_state_dict(g.state_dict())  # a resumed run keeps the window
    for guard in (g, restored):
        guard.rollout(0.6)
        found = guard.evaluated(4, {"eval/acc": 0.7})
        assert found == Hacking(0, 4, pytest.approx(0.5), pytest.approx(0.1)) and guard.fired == found
    assert g.evaluated(6, {"other": 1.0}) is None  # no held-out check in this evaluation: nothing recorded
    assert len(g.evaluations) == 3


def test_a_gold_reward_model_check_fires_beyond_the_spread_of_its_scores_and_keeps_it_on_resume():
    """Watching a gold reward model's held-out score (`eval/sampled_gold_reward`): a fall counts
    where it is beyond the noise of two evaluations, read from the spread each evaluation logs
    beside the mean (`_std`); the spread is part of the window a resume keeps."""
    gold = "eval/sampled_gold_reward"

    def run(spread: float, guard: HackingGuard | None = None) -> HackingGuard:
        g = guard or HackingGuard(gold, window=2, min_drop=0.02, responses=100)
        for step, (reward, score) in enumerate([(0.1, 2.0), (0.5, 1.7), (0.9, 1.4)]):
            g.rollout(reward)
            g.evaluated(2 * step, {gold: score, f"{gold}_std": spread})
        return g

    assert run(1.0).fired == Hacking(0, 4, pytest.approx(0.8), pytest.approx(0.6))  # 0.6 against 2 x 0.14
    assert run(3.0).fired is None  # against 2 x 0.42: within the noise
    g = HackingGuard(gold, window=2, min_drop=0.02, responses=100)
    g.rollout(0.1)
    g.evaluated(0, {gold: 2.0, f"{gold}_std": 1.0})
    restored = HackingGuard(gold, window=2, min_drop=0.02, responses=100)
    restored.load_state_dict(g.state_dict())
    assert restored.evaluations == g.evaluations and restored.evaluations[0].spread == 1.0
    # a window saved before spreads were kept loads, and is read by the margin alone
    old = {"metric": gold, "evaluations": [{"step": 0, "reward": 0.1, "metric": 2.0}], "rewards": [], "fired": None}
    restored.load_state_dict(old)
    assert restored.evaluations == [Evaluation(0, 0.1, 2.0)]


# A reward that rises with every call (the policy "pleases" it more each step), whatever the text.
RISING_REWARD = """
from pathlib import Path
import torch

COUNTER = Path(__file__).with_suffix(".calls")

def reward_func(queries, prompts, labels, **kwargs):
    calls = int(COUNTER.read_text()) + 1 if COUNTER.exists() else 1
    COUNTER.write_text(str(calls))
    return torch.tensor([0.1 * calls + 0.01 * (len(q) % 3) for q in queries])
"""


@pytest.mark.slow
@pytest.mark.usefixtures("one_torch_thread")
def test_a_run_whose_reward_rises_while_its_held_out_check_falls_is_flagged_and_can_stop(prepared, tmp_path,
                                                                                         monkeypatch, capsys):
    """The controller's own loop: an evaluation after every step whose held-out accuracy falls 0.1
    each time (scripted), against a reward that rises every step. The guard fires at step 3 (the
    window of 3 evaluations after the initial one): a warning line, the MLflow tag and metric; with
    --eval.stop_on_hacking the run stops there and still saves."""
    import json

    from mlflow.tracking import MlflowClient

    from rlhf_core.cli import main
    from rlhf_core.rl.controller import RLController

    def falling(self, prefix="eval/"):
        self.evaluations_made = getattr(self, "evaluations_made", 0) + 1
        return {f"{prefix}sampled_accuracy": 0.9 - 0.1 * self.evaluations_made}

    monkeypatch.setattr(RLController, "evaluate", falling)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    results = {}
    for name, extra in (("warn", []), ("stop", ["--eval.stop_on_hacking"])):
        reward = tmp_path / f"{name}_reward.py"
        reward.write_text(RISING_REWARD)
        code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                     "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt",
                     "2", "--rollout_batch_size", "4", "--train_batch_size", "8", "--generate_max_len", "4",
                     "--param_dtype", "fp32", "--max_steps", "5", "--eval_steps", "1", "--eval.task", "addition",
                     "--eval_dataset", f"json@{prepared['prompts']}", "--eval.selection_fraction", "0",
                     "--mlflow_experiment", "guard",
                     "--save_path", str(tmp_path / name), *extra])
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        results[name] = (json.loads(out[out.index("{"):]), err)
    # a run that evaluates only before and after training (5 steps: a tenth is under one) cannot stop
    # on the guard: the flag is said not applied and the run trains every step
    code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--remote_rm_url", str(tmp_path / "stop_reward.py"), "--advantage_estimator", "group_norm",
                 "--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8",
                 "--generate_max_len", "4", "--param_dtype", "fp32", "--max_steps", "5", "--eval.task", "addition",
                 "--eval_dataset", f"json@{prepared['prompts']}", "--mlflow_experiment", "guard",
                 "--save_path", str(tmp_path / "short"), "--eval.stop_on_hacking"])
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    assert "not applied here: --eval.stop_on_hacking True needs evaluations during training" in err
    assert json.loads(out[out.index("{"):])["metrics"]["train/steps"] == 5
    for manifest, err in results.values():
        metrics = manifest["metrics"]
        assert metrics["guard/reward_hacking"] == 1.0 and metrics["guard/fired_step"] == 3, metrics
        assert "rlhf: WARNING reward hacking: from step 0 to step 3 the training reward rose by" in err
        run = MlflowClient(uri).get_run(manifest["mlflow_run_id"])
        assert run.data.tags["rlhf.reward_hacking"].startswith("reward hacking: from step 0 to step 3")
        history = MlflowClient(uri).get_metric_history(run.info.run_id, "guard/reward_hacking")
        assert [m.value for m in sorted(history, key=lambda m: m.step)][:3] == [0.0, 0.0, 1.0]
    assert results["warn"][0]["metrics"]["train/steps"] == 5 and "guard/stopped_step" not in results["warn"][0]["metrics"]
    stopped = results["stop"][0]["metrics"]
    assert stopped["train/steps"] == 3 and stopped["guard/stopped_step"] == 3
    assert (tmp_path / "stop" / "model.safetensors").is_file()
    # the policy the guard stopped at was evaluated once, not again as the final evaluation
    assert "[rl step 3] eval/sampled_accuracy=0.5000" in results["stop"][1]
    assert "eval/sampled_accuracy=0.4000" not in results["stop"][1]


@pytest.mark.parametrize("flags, named", [
    (["--eval.hacking_guard_enable", "false"], "the guard on (--eval.hacking_guard_enable)"),
    (["--eval.dataset", None], "held-out prompts (--eval.dataset)"),
])
def test_stopping_on_hacking_needs_the_guard_and_evaluations(flags, named):
    from rlhf_core.infra.settings import ConfigError
    from rlhf_core.rl_config import build_ppo_config

    base = {"actor.model_name_or_path": "m", "reward.task": "addition", "data.prompt_dataset": "json@d",
            "ckpt.output_dir": "o", "eval.stop_on_hacking": True, "eval.dataset": "json@h"}
    build_ppo_config(base, {})  # a verifier (the task's) and held-out prompts (evaluated every tenth of the run)
    values = dict(base)
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        values[flag.removeprefix("--")] = value
    with pytest.raises(ConfigError, match=re.escape(named)):
        build_ppo_config(values, {})
    check = "a held-out check (--eval.task, a verifier, or --eval.reward_model_name_or_path)"
    with pytest.raises(ConfigError, match=re.escape(check)):
        build_ppo_config({**base, "reward.task": None, "reward.remote_url": "r.py"}, {})
    # a gold reward model is a held-out check too: the guard can stop on it
    gold = build_ppo_config({**base, "reward.task": None, "reward.model_name_or_path": "rm",
                             "eval.reward_model_name_or_path": "gold"}, {})
    assert gold.has_held_out_check and gold.eval.task is None


def test_a_gold_reward_model_is_one_held_out_check_not_trained_against():
    from rlhf_core.infra.settings import ConfigError
    from rlhf_core.rl.ray_roles import role_world_sizes
    from rlhf_core.rl_config import build_ppo_config

    base = {"actor.model_name_or_path": "m", "data.prompt_dataset": "json@d", "ckpt.output_dir": "o",
            "eval.dataset": "json@h", "algo.advantage.estimator": "group_norm", "rollout.n_samples_per_prompt": 2,
            "algo.kl.init_coef": 0}
    verifier_trained = build_ppo_config({**base, "reward.task": "sort", "eval.reward_model_name_or_path": "gold"}, {})
    assert verifier_trained.uses_reward_role and verifier_trained.reward_models == []
    assert role_world_sizes(verifier_trained, ["gold"]) == {"actor": 1, "reward": 1, "rollout": 1}
    assert not build_ppo_config({**base, "reward.task": "sort"}, {}).uses_reward_role
    with pytest.raises(ConfigError, match=re.escape("a gold reward model's score: give --eval.reward_model_name_or_path")):
        build_ppo_config({**base, "reward.task": "sort", "ckpt.best_metric_key": "sampled_gold_reward"}, {})
    for gold, named in (("./rm_a", "not one trained against"), ("g1,g2", "give one reward model")):
        with pytest.raises(ConfigError, match=re.escape(named)):
            build_ppo_config({**base, "reward.model_name_or_path": "rm_b, rm_a",
                              "eval.reward_model_name_or_path": gold}, {})
    with pytest.raises(ConfigError, match=re.escape("scores held-out responses: --eval.dataset (--eval_dataset) is "
                                                    "required")):  # where a pipeline does not fill it in
        build_ppo_config({**base, "eval.dataset": None, "reward.task": "sort", "eval.reward_model_name_or_path": "g"},
                         {})
