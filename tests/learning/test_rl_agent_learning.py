"""Multi-turn RL with a tool: on the built-in `multiply` task (a 3-digit number times a 2-digit
one, beyond what the tiny model learns to do in its head), an SFT model that calls the
calculator in a quarter of its demonstrations learns from the task's reward to call it: held-out
success rises by well over 15 points and tool use goes to nearly every episode.

The whole chain as a user runs it: `rlhf prep --task multiply` (SFT rows with tool-use
conversations), `rlhf train sft --multiturn`, `rlhf train ppo --agent_func_path calculator` (the
built-in environment, an OpenRLHF agent file, with its tool in the sandbox), and the same
episodes driven through the policy's OpenAI-compatible endpoint (`calculator-http`), and on a
vLLM engine. fp32, one in-process rank each (the vLLM engine in a Ray actor); about three and a
half minutes on 2 cores.
"""

import json

import pytest

from rlhf_core.cli import main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.usefixtures("one_torch_thread")]


def rl(agent_setting, out, agent: str, steps: int, capsys, *extra: str) -> dict:
    capsys.readouterr()
    prompts = agent_setting["prompts"]
    assert main(["train", "ppo", "--actor.model_name_or_path", agent_setting["sft"], "--data.prompt_dataset", prompts,
                 "--data.apply_chat_template", "--eval.dataset", prompts, "--eval.temperature", "1.0",
                 "--eval.n_samples_per_prompt", "2", "--eval.task", "multiply", "--agent_func_path", agent,
                 "--ckpt.output_dir", str(out), "--ds.param_dtype", "fp32", "--use_mlflow", "false",
                 "--train.seed", "0", "--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
                 "--rollout.batch_size", "16", "--train.batch_size", "64", "--train.micro_batch_size", "32",
                 "--actor.adam.lr", "2e-4", "--algo.kl.init_coef", "0.01", "--train.max_steps", str(steps),
                 "--rollout.max_new_tokens", "24", "--data.prompt_max_len", "24", *extra]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    before, after = metrics["eval_initial/sampled_accuracy"], metrics["eval/sampled_accuracy"]
    print(f"{agent}: held-out success (150 prompts x 2, T=1): SFT {before:.3f} -> RL {after:.3f}; tool use "
          f"{metrics['eval_initial/sampled_agent/used_tool']:.2f} -> {metrics['eval/sampled_agent/used_tool']:.2f}")
    return metrics


def test_rl_with_the_calculator_tool_raises_success_and_the_policy_learns_to_call_it(agent_setting, tmp_path, capsys):
    metrics = rl(agent_setting, tmp_path / "rl", "calculator", 30, capsys)
    assert metrics["eval/sampled_accuracy"] >= metrics["eval_initial/sampled_accuracy"] + 0.15
    assert metrics["eval_initial/sampled_agent/used_tool"] < 0.5 < 0.9 < metrics["eval/sampled_agent/used_tool"]
    assert metrics["rollout/agent_failed_frac"] == 0.0 and metrics["rollout/agent_turns"] > 1.5


def test_rollouts_driven_through_the_openai_endpoint_train_the_same_way(agent_setting, tmp_path, capsys):
    """The same episodes, written as an agent that chats with the policy over HTTP
    (`calculator-http`, an `OpenAIAgentExecutor`): the endpoint's sessions train it."""
    metrics = rl(agent_setting, tmp_path / "rl_http", "calculator-http", 15, capsys)
    assert metrics["eval/sampled_accuracy"] >= metrics["eval_initial/sampled_accuracy"] + 0.15
    assert metrics["eval/sampled_agent/used_tool"] > 0.8 and metrics["rollout/agent_failed_frac"] < 0.1


def test_agent_episodes_on_a_vllm_engine_train_too(agent_setting, tmp_path, capsys):
    """The environment loop over vLLM (its CPU build, in a Ray actor): each episode is a request
    of its own, a batch's turns more prompt tokens than one scheduler step takes."""
    metrics = rl(agent_setting, tmp_path / "rl_vllm", "calculator", 15, capsys, "--vllm.num_engines", "1")
    assert metrics["eval/sampled_accuracy"] >= metrics["eval_initial/sampled_accuracy"] + 0.15
    assert metrics["eval/sampled_agent/used_tool"] > 0.8 and metrics["rollout/agent_failed_frac"] < 0.1
