"""`--actor.policy_loss_type` reaches the actor's update: a short GRPO run with each surrogate (two
optimizer steps per rollout, so the second is off-policy, and a narrow clip, so PPO clips tokens)
ends with other weights than the same run with `ppo`; the math itself is tests/unit/test_rl_losses.py."""

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
