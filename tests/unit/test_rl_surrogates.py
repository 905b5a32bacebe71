"""The actor's surrogate and its correction reach the update. `--actor.policy_loss_type`: a short
GRPO run with each surrogate (two optimizer steps per rollout, so the second is off-policy, and a
narrow clip, so PPO clips tokens) ends with other weights than the same run with `ppo`.
`--enable_vllm_is_correction`: weights from the engine's log-probs. The math itself is
tests/unit/test_rl_losses.py."""

import pytest
import torch

from rlhf_core.cli import main

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]

# Rewards that differ inside every group (a digest of the response): no advantage is zero.
REWARD_FILE = """
import zlib
import torch

def reward_func(queries, prompts, labels, **kwargs):
    return torch.tensor([(zlib.crc32(q.encode()) % 100) / 100 for q in queries])
"""


def test_each_policy_loss_type_changes_the_update(prepared, tmp_path, capsys):
    from safetensors.torch import load_file

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    weights = {}
    for kind in ("ppo", "gspo", "cispo", "sapo"):
        code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                     "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt",
                     "4", "--rollout_batch_size", "8", "--train_batch_size", "16", "--micro_train_batch_size", "16",
                     "--micro_rollout_batch_size", "16", "--generate_max_len", "6", "--actor_learning_rate", "2e-3",
                     "--eps_clip", "0.02", "--param_dtype", "fp32", "--max_steps", "1", "--use_mlflow", "false",
                     "--policy_loss_type", kind, "--save_path", str(tmp_path / kind)])
        err = capsys.readouterr().err
        assert code == 0, err[-3000:]
        weights[kind] = load_file(str(tmp_path / kind / "model.safetensors"))
    base = load_file(str(prepared["base"] + "/model.safetensors"))
    for kind, trained in weights.items():
        assert any(not torch.equal(trained[k], base[k]) for k in base), f"{kind} trained nothing"
        if kind != "ppo":
            gap = max((trained[k] - weights["ppo"][k]).abs().max().item() for k in base)
            assert gap > 1e-6, f"--policy_loss_type {kind} made PPO's update"


def test_the_engine_mismatch_correction_weights_the_update(prepared, tmp_path, capsys, monkeypatch):
    """`--enable_vllm_is_correction`: the engine's log-probs are made 1 nat above the trainer's
    (w = e^-1 for every token). icepop drops every token out of [0.5, 5]: the policy does not move;
    tis clamps w to 0.5; both log the gap (`train/vllm_kl`, OpenRLHF's name) and the weights. Off,
    the same run trains. GSPO takes its sequence ratio against the engine's log-probs instead."""
    import json

    from safetensors.torch import load_file

    from rlhf_core.rl import controller
    from rlhf_core.rl.experience import RolloutSample

    def engine_above_trainer(prompt_ids, response_ids, index, logprobs, *args, **kwargs):
        return RolloutSample(prompt_ids, response_ids, index, logprobs + 1.0, *args, **kwargs)

    monkeypatch.setattr(controller, "RolloutSample", engine_above_trainer)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    weights, metrics = {}, {}
    for name, flags in (("off", []), ("icepop", ["--enable_vllm_is_correction", "--vllm_is_correction_type", "icepop"]),
                        ("tis", ["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type", "tis"]),
                        ("gspo", ["--policy_loss_type", "gspo"]),
                        ("gspo corrected", ["--policy_loss_type", "gspo", "--enable_vllm_is_correction"])):
        code = main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                     "--remote_rm_url", str(reward), "--advantage_estimator", "group_norm", "--n_samples_per_prompt",
                     "4", "--rollout_batch_size", "4", "--train_batch_size", "16", "--micro_train_batch_size", "16",
                     "--micro_rollout_batch_size", "16", "--generate_max_len", "6", "--actor_learning_rate", "2e-3",
                     "--param_dtype", "fp32", "--max_steps", "1", "--use_mlflow", "false",
                     "--save_path", str(tmp_path / name), *flags])
        out, err = capsys.readouterr()
        assert code == 0, err[-3000:]
        weights[name] = load_file(str(tmp_path / name / "model.safetensors"))
        metrics[name] = json.loads(out)["metrics"]
    base = load_file(str(prepared["base"] + "/model.safetensors"))
    assert any(not torch.equal(weights["off"][k], base[k]) for k in base), "the uncorrected run trained"
    assert all(torch.equal(weights["icepop"][k], base[k]) for k in base), "icepop dropped every token"
    assert metrics["icepop"]["train/is_dropped_frac"] == 1.0 and metrics["icepop"]["train/is_weight"] == 0.0
    assert metrics["tis"]["train/is_weight"] == pytest.approx(0.5) and metrics["tis"]["train/is_dropped_frac"] == 0.0
    for name in ("icepop", "tis"):
        assert metrics[name]["train/vllm_kl"] == pytest.approx(1.0, abs=1e-4)
    assert "train/is_weight" not in metrics["off"]
    # GSPO takes its sequence ratio against the engine's log-probs instead (e^-1 per sequence): no weights
    assert metrics["gspo corrected"]["train/vllm_kl"] == pytest.approx(1.0, abs=1e-4)
    assert "train/is_weight" not in metrics["gspo corrected"]
    gap = max((weights["gspo"][k] - weights["gspo corrected"][k]).abs().max().item() for k in base)
    assert gap > 1e-6, "the correction left GSPO's update as it was"
