"""`--ckpt.best_metric_key` (OpenRLHF's `--best_metric_key`): the RL stage keeps the checkpoint of its
best held-out evaluation as `best_global_step<N>`, apart from the rotated ones, and a resume keeps
the best so far."""

from __future__ import annotations

import json
import re

import pytest

from rlhf_core.cli import main
from rlhf_core.rl.checkpoint import BestMetric
from rlhf_core.trainers import checkpoints

REWARD = '''
import torch

def reward_func(queries, prompts, labels, **kwargs):  # shorter answers score higher: the policy moves
    return torch.tensor([float(len(p) - len(q)) for q, p in zip(queries, prompts)])
'''


def test_the_best_metric_is_the_highest_evaluation_and_comes_back_on_resume():
    best = BestMetric("")  # automatic: the sampled accuracy (OpenRLHF's first pass@1 metric)
    assert not best.improves({"eval/sampled_reward": 1.0}, 1)  # no accuracy (no verifier): nothing kept
    assert best.improves({"eval/sampled_accuracy": 0.2}, 1) and not best.improves({"eval/sampled_accuracy": 0.2}, 2)
    assert best.improves({"eval/sampled_accuracy": 0.5}, 3) and (best.step, best.value) == (3, 0.5)
    assert not BestMetric("none").improves({"eval/sampled_accuracy": 1.0}, 1)
    resumed = BestMetric("")
    resumed.load_state_dict(best.state_dict())
    assert not resumed.improves({"eval/sampled_accuracy": 0.4}, 4)  # below the best before the restart
    other = BestMetric("eval/greedy_reward")
    other.load_state_dict(best.state_dict())  # another metric: its own best from scratch
    assert other.improves({"eval/greedy_reward": -5.0}, 4)


def test_with_a_gold_reward_model_and_no_verifier_the_best_is_by_its_score_with_its_spread():
    best = BestMetric("", "eval/sampled_gold_reward")  # the run's default check (no verifier)
    assert best.metric == "eval/sampled_gold_reward"
    assert not best.improves({"eval/sampled_reward": 9.0}, 1)  # the training reward's own judge: never
    assert best.improves({"eval/sampled_gold_reward": 0.5, "eval/sampled_gold_reward_std": 2.0}, 2)
    assert (best.step, best.value, best.spread) == (2, 0.5, 2.0)
    resumed = BestMetric("", "eval/sampled_gold_reward")
    resumed.load_state_dict(best.state_dict())
    assert (resumed.step, resumed.value, resumed.spread) == (2, 0.5, 2.0)
    named = BestMetric("eval/sampled_gold_reward")  # the same metric asked for by name: the same best
    named.load_state_dict(best.state_dict())
    assert named.step == 2
    verifier = BestMetric("")  # a resume whose default check is the verifier's starts its own best
    verifier.load_state_dict(best.state_dict())
    assert verifier.step is None


def test_best_checkpoints_are_never_rotated_and_replace_each_other(tmp_path):
    for step in (1, 2, 3):
        (tmp_path / f"global_step{step}").mkdir()
        checkpoints.record_tag(tmp_path, f"global_step{step}", "run", "ppo", step)
        if step in (1, 3):
            (tmp_path / f"best_global_step{step}").mkdir()
            checkpoints.record_tag(tmp_path, f"best_global_step{step}", "run", "ppo", step, best=True)
    assert not (tmp_path / "best_global_step1").exists()  # the better one replaced it
    assert checkpoints.rotate(tmp_path, "run", keep=1) == ["global_step1", "global_step2"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["best_global_step3", "global_step3"]


@pytest.mark.parametrize("key", ["sampled_reward", "eval_math_pass1"])
def test_ppo_keeps_the_checkpoint_of_its_best_evaluation(key, prepared, tmp_path, capsys, monkeypatch,
                                                          one_torch_thread):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "reward.py").write_text(REWARD)
    held_out = tmp_path / "held_out.jsonl"
    rows = open(f"{prepared['prompts']}/test.jsonl").read().splitlines()[:4]
    held_out.write_text("\n".join(rows) + "\n")
    ckpt = tmp_path / "ckpt"
    code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--input_key", "prompt", "--label_key", "answer", "--max_samples", "16", "--remote_rm_url",
                 str(tmp_path / "reward.py"), "--eval_dataset", str(held_out), "--eval.task", "addition",
                 "--eval_n_samples_per_prompt", "2", "--eval_steps", "1", "--best_metric_key", key,
                 "--eval.selection_fraction", "0",  # every evaluation on the 4 prompts (below: a selection share)
                 "--rollout_batch_size", "4", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
                 "--generate_max_len", "6", "--actor_learning_rate", "5e-3", "--max_steps", "3",
                 "--save_steps", "1", "--max_ckpt_num", "1", "--ckpt_path", str(ckpt), "--save_path",
                 str(tmp_path / "out"), "--use_mlflow", "false", "--seed", "1"])
    out = capsys.readouterr()
    assert code == 0, out.err[-3000:]
    metric = "eval/sampled_reward" if key == "sampled_reward" else "eval/sampled_accuracy"
    evaluations = {int(step): float(value) for step, value in
                   re.findall(rf"\[rl step (\d+)\] .*{metric}=(-?[\d.]+)", out.err) if int(step) > 0}
    assert sorted(evaluations) == [1, 2, 3]  # every step's evaluation and the final one
    best_step = max(evaluations, key=lambda s: (evaluations[s], -s))  # the first of the highest
    kept = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert kept == sorted({f"best_global_step{best_step}", "global_step3"}), (kept, evaluations)
    assert checkpoints.latest_tag(ckpt) == "global_step3"  # `latest` names regular checkpoints only
    assert (ckpt / f"best_global_step{best_step}" / "actor").is_dir()
    import torch

    state = torch.load(ckpt / "global_step3" / "controller.pt", weights_only=False)["best"]  # what a resume reads
    assert state == {"key": metric, "step": best_step, "spread": None,
                     "value": pytest.approx(evaluations[best_step], abs=1e-4)}
    manifest = json.loads(out.out[out.out.index("{"):])
    assert manifest["metrics"]["best/step"] == best_step
    assert manifest["metrics"]["best/value"] == pytest.approx(evaluations[best_step], abs=1e-4)


def test_the_best_evaluated_policy_is_published_and_reported_on_prompts_it_was_not_chosen_on(
        prepared, tmp_path, capsys, monkeypatch, one_torch_thread):
    """At a learning rate this high the held-out reward (`--best_metric_key sampled_reward`) moves
    both ways, and the stage publishes the policy of its best evaluation, chosen on a selection
    share of the held-out prompts (`select/` metrics), then reports it on the rest (`eval/`). With `--eval.steps` left
    at -1 a run of 10 steps evaluates every step (a tenth of the run): the guard's and the
    choice's default cadence. The published weights are the chosen step's own (its checkpoint's
    Hugging Face copy, `--ckpt.save_hf`), a run resumed after the best step publishes the same
    (the kept weights are in the checkpoint); with `--eval.publish_best false` the last step's."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "reward.py").write_text(REWARD)
    held_out = tmp_path / "held_out.jsonl"
    rows = open(f"{prepared['prompts']}/test.jsonl").read().splitlines()[:16]
    held_out.write_text("\n".join(rows) + "\n")

    def train(name: str, *extra: str, ckpt: str | None = None) -> tuple[dict, str]:
        code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                     "--input_key", "prompt", "--label_key", "answer", "--max_samples", "40", "--remote_rm_url",
                     str(tmp_path / "reward.py"), "--eval_dataset", str(held_out), "--eval.task", "addition",
                     "--eval_n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
                     "--train_batch_size", "8", "--generate_max_len", "6", "--actor_learning_rate", "1e-2",
                     "--max_steps", "10", "--save_steps", "1", "--max_ckpt_num", "20", "--save_hf_ckpt",
                     "--ckpt_path", str(tmp_path / f"{ckpt or name}_ckpt"), "--save_path", str(tmp_path / name),
                     "--best_metric_key", "sampled_reward", "--use_mlflow", "false", "--seed", "1", *extra])
        out = capsys.readouterr()
        assert code == 0, out.err[-3000:]
        return json.loads(out.out[out.out.index("{"):])["metrics"], out.err

    metrics, err = train("published")
    chosen = {int(step): float(value) for step, value in
              re.findall(r"\[rl step (\d+)\] .*select/sampled_reward=(-?[\d.]+)", err)}
    assert sorted(chosen) == list(range(11))  # before training, every step, and the last policy
    assert "select/greedy" not in err  # the choice and the guard read sampled metrics: no greedy pass for them
    best = max(chosen, key=lambda s: (chosen[s], -s))  # the first of the highest
    assert metrics["best/step"] == best and metrics["published/step"] == best
    assert 0 < best < 10 and chosen[10] < chosen[best], chosen  # it moved both ways here: a choice was made
    assert f"publishing the policy of step {best}" in err
    from safetensors.torch import load_file

    published = load_file(str(tmp_path / "published" / "model.safetensors"))
    at_best = load_file(str(tmp_path / "published_ckpt" / f"global_step{best}" / "hf" / "model.safetensors"))
    assert all(__import__("torch").equal(published[k], at_best[k]) for k in published)
    assert "eval/sampled_reward" in metrics and "eval_initial/sampled_reward" in metrics  # the reported ones

    # Resumed after the best step (its checkpoint named `latest`), the run ends the same: the kept
    # weights come back from the checkpoint with the best evaluation, and are what it publishes.
    (tmp_path / "published_ckpt" / "latest").write_text(f"global_step{best + 1}")
    metrics, err = train("resumed", "--load_checkpoint", ckpt="published")
    assert f"at step {best + 1}" in err and metrics["published/step"] == best, err[-3000:]
    resumed = load_file(str(tmp_path / "resumed" / "model.safetensors"))
    assert all(__import__("torch").equal(resumed[k], published[k]) for k in published)

    metrics, err = train("last", "--eval.publish_best", "false")
    assert metrics["published/step"] == 10 and "publishing the policy" not in err
    last = load_file(str(tmp_path / "last" / "model.safetensors"))
    final = load_file(str(tmp_path / "last_ckpt" / "global_step10" / "hf" / "model.safetensors"))
    assert all(__import__("torch").equal(last[k], final[k]) for k in last)
