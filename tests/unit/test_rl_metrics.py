"""What an RL run records in MLflow: every per-step metric docs/flags.md lists, with values that
say the step happened (rewards with variance, groups dropped by dynamic filtering, a ratio near
1, time spent), the held-out evaluation, the precision used, and a run marked finished (two GRPO
steps with a KL loss and dynamic filtering, on the tiny base model)."""

import json

import pytest
import torch

from rlhf_core.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_torch_thread")]

PER_STEP = ["rollout/reward_mean", "rollout/reward_std", "rollout/score_mean", "rollout/kl", "rollout/response_length",
            "rollout/truncated_frac", "rollout/logprob_mismatch", "rollout/filter_pass_rate", "train/policy_loss",
            "train/clip_frac", "train/entropy", "train/ratio", "train/kl_loss", "train/kl_coef", "train/lr",
            "time/generate_s", "time/reward_s", "time/experience_s", "time/train_s", "time/sync_s", "time/step_s",
            "perf/samples_per_s"]


# Half the prompts (by a digest of the prompt) score FILTERED on every sample, above the filtering
# range: their groups must be dropped. The others score a digest of the response in [0, 1): the
# samples of a group differ, so rewards and advantages have variance.
# Each call also appends the responses' first characters per prompt to FIRSTS: with --top_k 2 a
# prompt's samples start with at most 2 different tokens.
FILTERED = 3.0
REWARD_FILE = """
import json
import zlib
import torch

def reward_func(queries, prompts, labels, responses):
    firsts = {{}}
    for p, r in zip(prompts, responses):
        firsts.setdefault(p, set()).add(r[:1])
    with open({firsts!r}, "a") as f:
        f.write(json.dumps([sorted(v) for v in firsts.values()]) + "\\n")
    return torch.tensor([{filtered} if zlib.crc32(p.encode()) % 2 else (zlib.crc32(q.encode()) % 100) / 100
                         for q, p in zip(queries, prompts)])
"""


def test_every_step_metric_reaches_mlflow(prepared, tmp_path, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    from rlhf_core.infra import not_applied

    monkeypatch.setattr(not_applied, "_SAID", set())  # each line once per process: this run's own
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    reward = tmp_path / "reward.py"
    firsts = tmp_path / "firsts.jsonl"
    reward.write_text(REWARD_FILE.format(firsts=str(firsts), filtered=FILTERED))
    code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--eval_dataset", f"json@{prepared['prompts']}", "--eval.n_samples_per_prompt", "1",
                 "--remote_rm_url", str(reward), "--eval.task", "addition",
                 "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "8",
                 "--train_batch_size", "16", "--micro_train_batch_size", "16", "--generate_max_len", "6",
                 "--use_kl_loss", "--dynamic_filtering", "--dynamic_filtering_reward_range", "-0.5", "2",
                 "--param_dtype", "fp32", "--max_steps", "2", "--mlflow_experiment", "rl-metrics",
                 "--top_p", "0.95", "--top_k", "2",
                 # OpenRLHF's GPU-only flags, as its hybrid-engine scripts give them: one line each says
                 # what was not applied on this CPU; --packing_samples is what the RL passes always do
                 "--deepspeed_enable_sleep", "--attn_implementation", "flash_attention_2", "--packing_samples",
                 "--normalize_reward",  # given by OpenRLHF's reward-function scripts: it normalizes reward models only
                 "--save_path", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    manifest = json.loads(captured.out[captured.out.index("{"):])  # after what MLflow prints
    assert "note: --reward.normalize_enable (--normalize_reward) applies to reward models; the scores of " \
           "--reward.remote_url are used as given" in captured.err
    if not torch.cuda.is_available():
        not_applied = sorted({line for line in captured.err.splitlines() if line.startswith("not applied here:")})
        assert not_applied == [
            "not applied here: --ds.attn_implementation flash_attention_2 needs a CUDA device and the flash_attn "
            "package; attention runs PyTorch SDPA",
            "not applied here: --ds.enable_sleep True needs a CUDA device; the trainers' states stay where they are"]
    client = MlflowClient(uri)
    run = client.get_run(manifest["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["rlhf.precision"] == "fp32"
    values = {}
    for key in PER_STEP:
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [1, 2], key
        values[key] = [m.value for m in history]
    for step in range(2):
        v = {key: values[key][step] for key in PER_STEP}
        assert 0 < v["rollout/filter_pass_rate"] < 1, "the constant groups were dropped, the others kept"
        assert 0 < v["rollout/reward_mean"] < 1, "only kept groups (rewards in [0, 1)) are trained on"
        assert v["rollout/reward_std"] > 0.05 and v["rollout/score_mean"] == v["rollout/reward_mean"]
        # fp32 engine against the fp32 trainer: float noise, both under the top-k / top-p filtered
        # distribution (renormalising alone moves a log-prob by -log(kept mass), >= 0.1 here)
        assert 0 <= v["rollout/logprob_mismatch"] < 1e-3
        assert 0.5 < v["train/ratio"] < 2 and v["train/entropy"] > 0 and v["train/lr"] > 0
        assert v["train/kl_coef"] > 0 and v["rollout/response_length"] > 0
        assert all(v[k] > 0 for k in PER_STEP if k.startswith("time/") and k != "time/sync_s")
        assert v["perf/samples_per_s"] > 0
    groups = [g for line in firsts.read_text().splitlines() for g in json.loads(line)]
    assert groups and all(len(g) <= 2 for g in groups), "top-k 2: at most two first tokens in a prompt's samples"
    # k1's mean over samples drawn from the filtered distribution, not the policy: it may be negative
    assert values["rollout/kl"][0] == 0.0 != values["rollout/kl"][1], "the policy starts at the reference, then moves"
    for key in ("eval_initial/sampled_reward", "eval/sampled_reward", "eval/greedy_accuracy"):
        assert client.get_metric_history(run.info.run_id, key), key
