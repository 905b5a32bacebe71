"""What an RL run records in MLflow: every per-step metric the README lists, the held-out
evaluation, the precision used, and a run marked finished (two GRPO steps with a KL loss and
dynamic filtering, on the tiny base model)."""

import json

import pytest

from rlhf_core.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PER_STEP = ["rollout/reward_mean", "rollout/reward_std", "rollout/score_mean", "rollout/kl", "rollout/response_length",
            "rollout/truncated_frac", "rollout/logprob_mismatch", "rollout/filter_pass_rate", "train/policy_loss",
            "train/clip_frac", "train/entropy", "train/ratio", "train/kl_loss", "train/kl_coef", "train/lr",
            "time/generate_s", "time/reward_s", "time/experience_s", "time/train_s", "time/sync_s", "time/step_s",
            "perf/samples_per_s"]


def test_every_step_metric_reaches_mlflow(prepared, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--eval_dataset", f"json@{prepared['prompts']}", "--eval.n_samples_per_prompt", "1", "--task", "addition",
                 "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8",
                 "--train_batch_size", "16", "--micro_train_batch_size", "16", "--generate_max_len", "6",
                 "--use_kl_loss", "--dynamic_filtering", "--dynamic_filtering_reward_range", "-0.5", "2",
                 "--param_dtype", "fp32", "--max_steps", "2", "--mlflow_experiment", "rl-metrics",
                 "--save_path", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    manifest = json.loads(captured.out[captured.out.index("{"):])  # after what MLflow prints
    client = MlflowClient(uri)
    run = client.get_run(manifest["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlhf.precision"] == "fp32"
    for key in PER_STEP:
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2], key
    mismatch = client.get_metric_history(run.info.run_id, "rollout/logprob_mismatch")
    assert all(0 <= m.value < 1e-3 for m in mismatch)  # fp32 engine against the fp32 trainer: float noise
    for key in ("eval_initial/sampled_reward", "eval/sampled_reward", "eval/greedy_accuracy"):
        assert client.get_metric_history(run.info.run_id, key), key
