"""`rlhf train ppo` learns: PPO, REINFORCE++ and GRPO each raise held-out sampled accuracy over SFT.

All start from the shared `rl_setting` (SFT on 30% wrong demonstrations: right greedily, often
wrong sampled), with fixed seeds, one in-process rank per role, fp32. Accuracy is exact match on
the held-out split, sampled at temperature 1 (2 samples per prompt) and greedy.
"""

import json
import re
from pathlib import Path

import pytest

from rlhf_core.cli import main

# The first test also builds the shared SFT and reward models (about 2 minutes on a quiet 2-core machine).
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400), pytest.mark.usefixtures("one_torch_thread")]

REWARD_FILE = '''
import torch

def reward_func(queries, prompts, labels, **kwargs):
    """Exact match of the response (the query after its prompt, without the EOS token) with the label."""
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):].replace("<|eos|>", "").strip()
        rewards.append(1.0 if response == label else 0.0)
    rewards = torch.tensor(rewards)
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"exact": rewards}}
'''


def ppo(rl_setting, out: Path, *flags, capsys) -> tuple[dict, str]:
    """The stage's manifest and what it printed to stderr."""
    code = main(["train", "ppo", "--actor.model_name_or_path", rl_setting["sft"],
                 "--data.prompt_dataset", f"json@{rl_setting['prompts']}", "--eval.dataset",
                 f"json@{rl_setting['prompts']}", "--eval.temperature", "1.0", "--eval.n_samples_per_prompt", "2",
                 "--eval.task", "sort", "--ckpt.output_dir", str(out), "--ds.param_dtype", "fp32",
                 "--use_mlflow", "false", "--rollout.micro_batch_size", "64", "--train.seed", "0", *flags])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    # the manifest, after any line a library printed to stdout first (DeepSpeed's accelerator
    # warning, where this test is the process's first to import it)
    return json.loads(captured.out[captured.out.index("\n{") + 1 if not captured.out.startswith("{") else 0:]), \
        captured.err


def assert_learned(manifest: dict, min_gain: float = 0.10, max_kl: float = 1.0) -> None:
    m = manifest["metrics"]
    gain = round(m["eval/sampled_accuracy"] - m["eval_initial/sampled_accuracy"], 6)  # 0.76 - 0.66 is 0.0999...
    print(f"\nsampled accuracy {m['eval_initial/sampled_accuracy']:.3f} -> {m['eval/sampled_accuracy']:.3f} "
          f"(published step {m.get('published/step')}), greedy {m['eval_initial/greedy_accuracy']:.3f} -> "
          f"{m['eval/greedy_accuracy']:.3f}, kl {m['rollout/kl']:.3f}")
    assert gain >= min_gain, m
    assert m["eval/greedy_accuracy"] >= m["eval_initial/greedy_accuracy"] - 0.03, m
    assert 0 <= m["rollout/kl"] < max_kl, m  # the policy stays near the reference


def test_grpo_on_a_vllm_engine_with_a_reward_file(rl_setting, tmp_path, capsys):
    """GRPO with one vLLM engine (its CPU build here) on Ray: after every step's weight sync the
    engine samples with the actor's weights (the log-probs it reports are the trainer's, fp32, to
    within 1e-3), and the policy learns as it does on the transformers engine."""
    reward_file, steps = tmp_path / "exact_match.py", 60
    reward_file.write_text(REWARD_FILE)
    manifest, err = ppo(rl_setting, tmp_path / "grpo", "--algo.advantage.estimator", "group_norm",
                        "--reward.remote_url", str(reward_file), "--rollout.n_samples_per_prompt", "4",
                        "--rollout.batch_size", "32", "--train.batch_size", "64", "--train.micro_batch_size", "32",
                        "--actor.adam.lr", "1e-4", "--algo.kl.use_loss", "--algo.kl.estimator", "k3",
                        "--algo.kl.init_coef", "0.01", "--train.max_steps", str(steps), "--vllm.num_engines", "1",
                        "--logger.logging_steps", "1", capsys=capsys)
    assert "weight sync to 1 rollout engine(s): gloo" in err, err[-3000:]
    # vLLM's lines of every update that say nothing wrong stay out of the log (vllm_engine.ExpectedReloadLines)
    assert "Failed to load weights" not in err and "Successfully reset prefix cache" not in err
    mismatch = [float(v) for v in re.findall(rf"\[rl step \d+/{steps}\].*logprob_mismatch=([0-9.e+-]+)", err)]
    assert len(mismatch) == steps and max(mismatch) < 1e-3, mismatch
    assert_learned(manifest)
    out = Path(manifest["output_uri"])
    assert json.loads((out / "stage.json").read_text())["stage"] == "ppo"
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out)


def test_ppo_with_a_critic_and_the_reward_model(rl_setting, tmp_path, capsys):
    manifest, _ = ppo(rl_setting, tmp_path / "ppo", "--algo.advantage.estimator", "gae", "--algo.advantage.lambd", "0.95",
                   "--reward.model_name_or_path", rl_setting["rm"], "--reward.normalize_enable",
                   "--rollout.n_samples_per_prompt", "4", "--rollout.batch_size", "32", "--train.batch_size", "64",
                   "--train.micro_batch_size", "32", "--actor.adam.lr", "5e-5", "--critic.adam.lr", "2e-4",
                   "--critic.freezing_steps", "10", "--algo.kl.init_coef", "0.01", "--train.max_steps", "100",
                   capsys=capsys)
    assert_learned(manifest)
    assert manifest["metrics"]["train/value_loss"] > 0


def test_reinforce_plus_plus_with_the_verifier(rl_setting, tmp_path, capsys):
    manifest, _ = ppo(rl_setting, tmp_path / "reinforce", "--algo.advantage.estimator", "reinforce",
                   "--reward.task", "sort", "--rollout.n_samples_per_prompt", "1", "--rollout.batch_size", "128",
                   "--train.batch_size", "64", "--train.micro_batch_size", "32", "--actor.adam.lr", "1e-4",
                   "--algo.kl.init_coef", "0.01", "--train.max_steps", "60", capsys=capsys)
    assert_learned(manifest)


def test_the_tokenizer_chat_template_flag_formats_the_prompts(prepared):
    """`--data.tokenizer_chat_template` replaces the tokenizer's template for the RL prompts (and the
    tokenizer saved with the policy): a template that wraps each prompt in brackets shows in the ids."""
    from rlhf_core.models.loading import load_tokenizer
    from rlhf_core.rl_config import build_ppo_config
    from rlhf_core.trainers.ppo import load_prompts

    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    flags = {"actor.model_name_or_path": prepared["base"], "data.prompt_dataset": f"json@{prepared['prompts']}",
             "reward.task": "addition", "ckpt.output_dir": "unused"}
    cfg = build_ppo_config(None, flags)
    default_ids = load_prompts(cfg, load_tokenizer(prepared["base"]), "train")[0]
    cfg = build_ppo_config(None, {**flags, "data.tokenizer_chat_template": template})
    tokenizer = load_tokenizer(prepared["base"])
    ids = load_prompts(cfg, tokenizer, "train")[0]
    assert tokenizer.chat_template == template
    text = tokenizer.decode(ids[0])
    assert text.startswith("[") and text.endswith("]"), text
    assert ids[0] != default_ids[0]


@pytest.fixture(scope="module")
def weak_rm(rl_setting, tmp_path_factory):
    """A reward model trained for 40 steps only: about 63% of held-out pairs ranked right."""
    weak = tmp_path_factory.mktemp("weak") / "weak_rm"
    preference = Path(rl_setting["root"]) / "prep" / "data" / "preference"
    assert main(["train", "rm", "--pretrain", rl_setting["sft"], "--dataset", f"json@{preference}",
                 "--save_path", str(weak), "--train_batch_size", "64", "--micro_train_batch_size", "32",
                 "--max_steps", "40", "--apply_chat_template", "--max_len", "64", "--packing_samples",
                 "--param_dtype", "fp32", "--lr_warmup_ratio", "0.05", "--seed", "0", "--use_mlflow", "false",
                 "--learning_rate", "1e-3", "--max_epochs", "50"]) == 0
    return str(weak)


# REINFORCE with baseline at a high learning rate against the weak reward model (issue 26's setting)
OFF_A_CLIFF = ("--algo.advantage.estimator", "reinforce_baseline", "--rollout.n_samples_per_prompt", "4",
               "--rollout.batch_size", "16", "--train.batch_size", "64", "--train.micro_batch_size", "32",
               "--actor.adam.lr", "2e-4", "--algo.kl.init_coef", "0.01", "--train.max_steps", "64")


def test_a_policy_a_weak_reward_model_drives_off_a_cliff_is_caught_and_not_published(rl_setting, weak_rm, tmp_path,
                                                                                      capsys):
    """The reward-hacking guard's proof (issue 26's setting): a reward model trained for 40 steps
    only (about 63% of held-out pairs ranked right), REINFORCE with baseline at a high learning
    rate. The training reward rises while the verifier's held-out accuracy collapses; the guard
    warns, and the stage publishes its best evaluated policy (chosen on the selection prompts),
    which on the reported prompts is within 2 points of SFT, where the last policy, what a run
    without the choice publishes, has lost most of its accuracy."""
    capsys.readouterr()
    manifest, err = ppo(rl_setting, tmp_path / "hacked", "--reward.model_name_or_path", weak_rm, *OFF_A_CLIFF,
                        capsys=capsys)
    m = manifest["metrics"]
    assert "rlhf: WARNING reward hacking" in err and m["guard/reward_hacking"] == 1.0, err[-3000:]
    assert m["guard/reward_rise"] > 0 and m["guard/metric_drop"] >= 0.02
    sft = m["eval_initial/sampled_accuracy"]
    assert m["select/sampled_accuracy"] < sft - 0.3, m  # the last policy collapsed
    assert m["published/step"] < 64 and f"publishing the policy of step {m['published/step']}" in err
    assert m["eval/sampled_accuracy"] >= sft - 0.02, m  # what is published did not
    print(f"\nguard proof: SFT {sft:.1%} sampled (reported prompts); last policy {m['select/sampled_accuracy']:.1%} "
          f"(selection prompts), training reward +{m['guard/reward_rise']:.2f}; published step {m['published/step']}: "
          f"{m['eval/sampled_accuracy']:.1%} (reported prompts)")


def test_a_gold_reward_model_as_the_held_out_check_catches_the_same_cliff(rl_setting, weak_rm, tmp_path, capsys):
    """The same run with a gold reward model as the guard's check instead of the verifier: the
    setting's reward model (about 98% of held-out pairs), which the policy never trains against
    (`--eval.reward_model_name_or_path`), watched by the guard and choosing the published policy
    (`--ckpt.best_metric_key eval/sampled_gold_reward`; it is the default check where no verifier
    exists: here the verifier only reports). Its score falls beyond the spread of its scores while
    the training reward rises; the guard fires on it, and the policy it chooses keeps the
    verifier's accuracy within 2 points of SFT."""
    capsys.readouterr()
    manifest, err = ppo(rl_setting, tmp_path / "gold", "--reward.model_name_or_path", weak_rm, *OFF_A_CLIFF,
                        "--eval.reward_model_name_or_path", rl_setting["rm"],
                        "--ckpt.best_metric_key", "eval/sampled_gold_reward", capsys=capsys)
    m = manifest["metrics"]
    assert "held-out eval/sampled_gold_reward fell by" in err and m["guard/reward_hacking"] == 1.0, err[-3000:]
    assert m["select/sampled_gold_reward"] < m["eval_initial/sampled_gold_reward"] - 2, m  # the last policy fell
    sft = m["eval_initial/sampled_accuracy"]
    assert m["select/sampled_accuracy"] < sft - 0.3, m  # and so did its accuracy, which no choice read
    assert m["published/step"] < 64 and f"publishing the policy of step {m['published/step']} " \
        "(eval/sampled_gold_reward=" in err
    assert m["eval/sampled_accuracy"] >= sft - 0.02, m
    print(f"\ngold-check proof: gold reward {m['eval_initial/sampled_gold_reward']:.2f} (SFT, reported prompts) -> "
          f"{m['select/sampled_gold_reward']:.2f} (last policy, selection prompts), guard fired at step "
          f"{m['guard/fired_step']:.0f}; published step {m['published/step']}: {m['eval/sampled_accuracy']:.1%} "
          f"sampled accuracy against SFT's {sft:.1%}")


def test_with_the_guard_off_the_same_run_publishes_the_collapsed_policy(rl_setting, weak_rm, tmp_path, capsys):
    """The control of the guard's proof: the same run with the guard and the choice off
    (`--eval.hacking_guard_enable false --eval.publish_best false`), evaluated at the same steps
    on the same prompts. Nothing warns, and the stage publishes its last policy: the collapse
    reproduces on the reported prompts."""
    capsys.readouterr()
    manifest, err = ppo(rl_setting, tmp_path / "unguarded", "--reward.model_name_or_path", weak_rm, *OFF_A_CLIFF,
                        "--eval.hacking_guard_enable", "false", "--eval.publish_best", "false", "--eval.steps", "7",
                        capsys=capsys)
    m = manifest["metrics"]
    assert "reward hacking" not in err and "guard/reward_hacking" not in m, err[-3000:]
    assert m["published/step"] == 64
    sft = m["eval_initial/sampled_accuracy"]
    assert m["eval/sampled_accuracy"] < sft - 0.3, m
    print(f"\nguard off: SFT {sft:.1%} -> published (last) policy {m['eval/sampled_accuracy']:.1%} (reported prompts)")
