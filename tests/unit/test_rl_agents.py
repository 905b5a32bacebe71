"""Multi-turn episodes against an environment (`rl/agents.py`): what the policy sampled is trained,
what the environment wrote is not; rewards add up over turns; budgets and turn limits end an
episode; an environment that raises, hangs or answers nonsense ends its episode, never the run;
OpenRLHF's agent files load as written."""

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.infra.settings import ConfigError
from rlhf_core.rl import env_calls
from rlhf_core.rl.agent_api import AgentInstanceBase
from rlhf_core.rl.agents import AgentError, AgentRewardSource, AgentRollouts, agent_stats, load_agent
from tests.unit.engine_stubs import within_budget


class CharTokenizer:
    """One token per character (its code point): what was tokenized is plain to read back."""

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


class Script:
    """A stand-in engine: the episode of prompt "k>" answers at its turn t `replies[k][t]` (log-prob -0.5 - position/100
    per token, so each token's log-prob is recognisable), cut to its own budget as engines do; records each call."""

    def __init__(self, replies):
        self.replies, self.calls, self.turn_of = replies, [], {}

    def __call__(self, prompt_ids, temperature, max_new_tokens, seed, top_k, top_p):
        self.calls.append({"n": len(prompt_ids), "temperature": temperature, "budget": max_new_tokens})
        out = []
        for ids, budget in zip(prompt_ids, max_new_tokens, strict=True):
            text = "".join(map(chr, ids))
            k = int(text[text.index(">") - 1])  # the prompt's digit before its ">" says which episode it is
            t = self.turn_of.get(k, 0)
            self.turn_of[k] = t + 1
            reply = self.replies[k][t]
            out.append(within_budget(map(ord, reply), [-0.5 - j / 100 for j in range(len(reply))], budget))
        return out


def episodes(instance_cls, replies, prompts=("0>",), labels=None, max_length=64, max_new_tokens=8, **kwargs):
    runner = AgentRollouts(instance_cls, CharTokenizer(), max_length, max_new_tokens, **kwargs)
    engine = Script(replies)
    try:
        ids = [[ord(c) for c in p] for p in prompts]
        out = runner.run(ids, list(range(len(prompts))), list(labels or ["x"] * len(prompts)), 1, 1.0, 0, engine)
    finally:
        runner.close()
    return out, engine


class TwoTries(AgentInstanceBase):
    """Right answer `label`: reward 1 and done; wrong: reward -0.25, feedback `?`, one more try."""

    def __init__(self):
        self.tries = 0

    async def step(self, states):
        self.tries += 1
        right = states["action_text"] == states["label"]
        done = right or self.tries == 2
        return {"rewards": torch.tensor([1.0 if right else -0.25]), "environment_feedback": "" if done else "?",
                "done": done, "extra_logs": {"tries": self.tries}}


def test_actions_are_trained_feedback_is_not_and_rewards_add_up_over_turns():
    (s,), engine = episodes(TwoTries, {0: ["ab", "x"]})
    assert s.prompt_ids == [ord("0"), ord(">")]
    assert s.response_ids == [ord(c) for c in "ab?x"]
    assert s.action_mask == [1, 1, 0, 1]
    assert s.response_len == 3 and s.sequence_len == 6  # per-token tensors: the action tokens only
    assert torch.allclose(s.rollout_logprobs, torch.tensor([-0.5, -0.51, -0.5]))  # both turns' own log-probs
    assert s.extra["agent_reward"] == pytest.approx(0.75) and s.extra["agent_score"] == pytest.approx(0.75)
    assert s.finished and s.extra["turns"] == 2 and s.extra["final_text"] == "x"
    assert [c["budget"] for c in engine.calls] == [[62], [59]]  # the episode's remaining room each turn
    rewards, scores = AgentRewardSource().score([s], ["x"])
    assert rewards.tolist() == [0.75] and scores.tolist() == [0.75]
    assert agent_stats([s]) == {"rollout/agent_turns": 2.0, "rollout/agent_failed_frac": 0.0,
                                "rollout/agent/tries": 2.0}


def test_episodes_in_one_engine_call_each_get_their_own_room():
    """The turns of a batch go in one call, each episode asking for its own room left (not the
    largest, cut afterwards): the longer prompt's episode has less."""
    (a, b), engine = episodes(TwoTries, {0: ["ab", "x"], 1: ["x"]}, prompts=("0>", "abc1>"), labels=["x", "x"])
    assert engine.calls[0]["budget"] == [62, 59] and engine.calls[1]["budget"] == [59]
    assert a.extra["turns"] == 2 and b.extra["turns"] == 1


def test_per_turn_rewards_sit_at_each_turn_s_last_action_token():
    """`--train.agent_turn_rewards`: the turns' rewards become step rewards at their turns' last
    action tokens (indices over action tokens, as every per-token tensor runs), so a return-based
    estimator credits each turn with what followed it; off, OpenRLHF's sum on the last action."""
    from rlhf_core.algos.advantages import compute_advantages
    from rlhf_core.rl.experience import step_reward_matrix

    (s,), _ = episodes(TwoTries, {0: ["ab", "x"]})  # rewards -0.25 after "ab", 1.0 after "x"
    rewards, _ = AgentRewardSource().score([s], ["x"])
    assert rewards.tolist() == [0.75] and s.extra["step_rewards"] == [(1, -0.25), (2, 1.0)]
    mask = torch.ones(1, s.response_len)
    _, per_turn = compute_advantages("reinforce", rewards, torch.zeros_like(mask), mask, kl_coef=0.0, n=1,
                                     step_rewards=step_reward_matrix([s], s.response_len))
    _, summed = compute_advantages("reinforce", rewards, torch.zeros_like(mask), mask, kl_coef=0.0, n=1)
    assert per_turn.tolist() == [[0.75, 0.75, 1.0]] and summed.tolist() == [[0.75, 0.75, 0.75]]  # the returns


def test_per_turn_rewards_need_an_environment_and_an_estimator_that_takes_them():
    from rlhf_core.rl.agents import check_agent
    from rlhf_core.rl_config import PPOConfig

    base = {"actor": {"model_name_or_path": "m"}, "data": {"prompt_dataset": "p"}, "rollout": {"max_new_tokens": 8},
            "algo": {"advantage": {"estimator": "group_norm"}}, "rollout.n_samples_per_prompt": 2}
    with pytest.raises(ValueError, match="give --train.agent_func_path"):
        PPOConfig.model_validate({**base, "reward": {"task": "sort"}, "train": {"agent_turn_rewards": True}})
    with pytest.raises(ValueError, match="estimator rloo takes one reward per sample"):
        PPOConfig.model_validate({**base, "algo": {"advantage": {"estimator": "rloo"}},
                                  "train": {"agent_func_path": "calculator", "agent_turn_rewards": True}})
    assert check_agent("calculator", turn_rewards=True) is load_agent("calculator")
    with pytest.raises(ConfigError, match="one reward per episode"):
        check_agent("calculator-http", turn_rewards=True)


def test_an_agent_run_of_a_task_needs_an_episode_budget():
    from rlhf_core.rl_config import PPOConfig

    with pytest.raises(ValueError, match="agent_func_path.*give --rollout.max_new_tokens"):
        PPOConfig.model_validate({"train": {"agent_func_path": "calculator"}, "eval": {"task": "multiply"}})
    PPOConfig.model_validate({"train": {"agent_func_path": "calculator"}, "eval": {"task": "multiply"},
                              "rollout": {"max_new_tokens": 24}})


def test_the_token_budget_and_the_turn_limit_end_an_episode():
    class Never(AgentInstanceBase):
        def __init__(self):
            pass

        async def step(self, states):
            return {"rewards": 0.5, "environment_feedback": "feedback!", "done": False}

    (s,), engine = episodes(Never, {0: ["abcdef"] * 9}, max_length=16)
    # 2 prompt tokens, 6 action, 8 of the 9 feedback characters (the budget cuts the rest), then no room
    assert s.response_ids == [ord(c) for c in "abcdef" + "feedback"] and sum(s.action_mask) == 6
    assert not s.finished and s.extra["turns"] == 1 and s.extra["agent_reward"] == 0.5
    (s,), engine = episodes(Never, {0: ["a"] * 9}, max_length=64, max_turns=3)
    assert s.extra["turns"] == 3 and len(engine.calls) == 3 and s.extra["agent_reward"] == 1.5 and not s.finished


def test_episodes_are_batched_per_turn_and_a_returned_temperature_is_not_applied(capsys):
    class Cooler(AgentInstanceBase):
        def __init__(self):
            self.turn = 0

        async def step(self, states):
            self.turn += 1
            params = states["sampling_params"]
            if states["label"] == "cool":
                params.temperature = 0.25
            return {"rewards": 0.0, "environment_feedback": ";", "done": self.turn == 2, "sampling_params": params}

    out, engine = episodes(Cooler, {0: ["a", "b"], 1: ["c", "d"]}, prompts=("0>", "1>"), labels=("warm", "cool"))
    assert [c["n"] for c in engine.calls] == [2, 2]  # one call per turn for both episodes
    assert [c["temperature"] for c in engine.calls] == [1.0, 1.0]  # the trainer's temperature, always
    assert "sampling_params (temperature, top_p, top_k): not applied" in capsys.readouterr().err
    assert [s.extra["turns"] for s in out] == [2, 2]


def test_an_environment_that_raises_hangs_or_answers_nonsense_ends_its_episode_only(monkeypatch):
    monkeypatch.setattr(env_calls, "GRACE_S", 0.5)

    class Faulty(AgentInstanceBase):
        def __init__(self):
            pass

        async def step(self, states):
            kind = states["label"]
            if kind == "raise":
                raise ValueError("the tool crashed")
            if kind == "async-hang":
                await asyncio.sleep(600)
            if kind == "sync-hang":
                time.sleep(3)  # blocks its event loop's thread
            if kind == "nonsense":
                return {"rewards": "lots"}
            if kind == "bad-done":  # a tensor of two can't be a truth value: the episode's failure, not the run's
                return {"rewards": 1.0, "environment_feedback": "", "done": torch.tensor([1, 0]), "extra_logs": 3}
            return {"rewards": 1.0, "environment_feedback": "", "done": True}

    labels = ("ok", "raise", "async-hang", "nonsense", "sync-hang", "bad-done", "ok", "ok")
    prompts = tuple(f"{k}>" for k in range(len(labels)))
    started, threads = time.perf_counter(), threading.active_count()
    out, _ = episodes(Faulty, {k: ["a"] for k in range(len(labels))}, prompts=prompts, labels=labels, timeout_s=1.0)
    assert time.perf_counter() - started < 10
    time.sleep(3.5)  # the blocked thread wakes up: its abandoned loop stops, nothing else is left running
    assert threading.active_count() <= threads + 1
    failed = {labels[s.prompt_index] for s in out if s.extra["failed"]}
    assert failed == {"raise", "async-hang", "nonsense", "sync-hang", "bad-done"}
    for s in out:
        assert s.response_len == 1 and not s.finished == s.extra["failed"]
    assert [s.extra["agent_reward"] for s in out] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]
    assert agent_stats(out)["rollout/agent_failed_frac"] == 5 / 8


def test_an_environment_that_fails_every_episode_is_an_error():
    class Broken(AgentInstanceBase):
        def __init__(self):
            pass

        async def step(self, states):
            raise KeyError("answer")

    with pytest.raises(AgentError, match="every one of 2 episodes.*KeyError"):
        episodes(Broken, {0: ["a"], 1: ["b"]}, prompts=("0>", "1>"))


def test_an_async_init_and_a_rewritten_observation_cut_from_the_left():
    class Rewrites(AgentInstanceBase):
        async def __init__(self):  # OpenRLHF v0.9.10's example declares __init__ async
            self.ready = True

        async def reset(self, states):
            return {"observation": "0" + "long context " * 4 + states["observation"]}

        def step(self, states):  # a plain function works too
            return {"rewards": float(self.ready), "environment_feedback": "", "done": True}

    (s,), _ = episodes(Rewrites, {0: ["ab"]}, max_length=20, max_new_tokens=8)
    assert len(s.prompt_ids) == 12 and CharTokenizer().decode(s.prompt_ids).endswith("ntext 0>")
    assert s.extra["agent_reward"] == 1.0


AGENT_FILE = '''
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.steps = 0

    async def reset(self, states, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states, **kwargs):
        self.steps += 1
        return {"rewards": torch.tensor([1.0]), "scores": torch.tensor([1.0]), "environment_feedback": "",
                "done": True, "sampling_params": states.get("sampling_params"), "extra_logs": {}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


def test_an_openrlhf_agent_file_loads_as_written_and_leaves_no_openrlhf_module_behind(tmp_path):
    path = tmp_path / "agent_func.py"
    path.write_text(AGENT_FILE)
    cls = load_agent(str(path))
    assert cls.__name__ == "AgentInstance" and issubclass(cls, AgentInstanceBase)
    assert "openrlhf" not in sys.modules and "openrlhf.utils.agent" not in sys.modules


def test_an_agent_file_is_imported_once_per_process(tmp_path):
    """The CLI checks the file before any model loads and the stage loads it again: one import."""
    path = tmp_path / "counted.py"
    path.write_text(f"open({str(tmp_path / 'imports')!r}, 'a').write('x')\n" + AGENT_FILE)
    assert load_agent(str(path)) is load_agent(str(path))
    assert (tmp_path / "imports").read_text() == "x"


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("import nothing_here\n", "importing it failed: ModuleNotFoundError"),
    ("x = 1\n", "defines no AgentExecutor"),
    (AGENT_FILE.replace("(MultiTurnAgentExecutor)", "").replace("super().__init__(AgentInstance)", "pass"),
     "must subclass MultiTurnAgentExecutor"),
    (AGENT_FILE + "\n    async def execute(self, *args, **kwargs):\n        return {}\n", "overrides execute"),
])
def test_a_bad_agent_file_is_a_config_error_naming_it(tmp_path, content, message):
    path = tmp_path / "agent.py"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as e:
        load_agent(str(path))
    assert str(path) in str(e.value)
    with pytest.raises(ConfigError, match="must be a Python file"):
        load_agent(str(Path(tmp_path) / "agent.txt"))


def test_env_tokens_inside_a_response_are_read_but_not_trained(prepared):
    """Collated (padded and packed with a sibling), an episode's per-token log-probs are the model's
    at its action tokens, in order, as a plain forward of the whole sequence gives them."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.algos.losses import gather_token_logprobs
    from rlhf_core.models.forward import response_logits
    from rlhf_core.rl.experience import RolloutSample, collate

    model = AutoModelForCausalLM.from_pretrained(prepared["base"]).eval()
    prompt, response = [1, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]
    mask = [1, 1, 0, 0, 1, 0, 1]
    episode = RolloutSample(prompt, response, 0, torch.zeros(4), True, action_mask=mask)
    sibling = RolloutSample(prompt, [15, 16, 17], 0, torch.zeros(3), True)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
        full = torch.log_softmax(logits, -1)
        positions = [len(prompt) + t for t, m in enumerate(mask) if m]
        expected = torch.stack([full[p - 1, (prompt + response)[p]] for p in positions])
        for packing in (False, True):
            batch, index, valid = collate([episode, sibling], 0, packing, 64)
            assert valid[0].sum() == 4  # the episode's four action tokens, the environment's three left out
            lp = gather_token_logprobs(response_logits(model, batch, index, 1.0), batch.input_ids.reshape(-1)[index])
            torch.testing.assert_close(lp[0, :4].float(), expected, atol=1e-5, rtol=0)


# OpenRLHF's example environment as its v0.9.10 file writes it (`async def __init__`, 1-3 random
# turns, feedback that opens a new "Human:" turn), rewritten here with a fixed seed.
OPENRLHF_STYLE_FILE = '''
import random
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

RNG = random.Random(0)


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0
        self.max_steps = RNG.randint(1, 3)

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs):
        done = self.step_idx >= self.max_steps
        reward = torch.tensor([float(len(states["action_text"]) % 2)]) if done else torch.tensor(0)
        feedback = "[CORRECT]" if done else " Human: [INCORRECT] try again. Assistant: "
        self.step_idx += 1
        return {"rewards": reward, "scores": reward, "environment_feedback": feedback, "done": done,
                "sampling_params": states.get("sampling_params", None), "extra_logs": {"dummy_scores": reward}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
'''


@pytest.mark.slow
def test_an_openrlhf_style_agent_file_trains_asynchronously_with_partial_rollouts(prepared, tmp_path, capsys,
                                                                                   one_torch_thread):
    import json

    from rlhf_core.cli import main

    agent = tmp_path / "agent_func.py"
    agent.write_text(OPENRLHF_STYLE_FILE)
    assert main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--agent_func_path", str(agent), "--advantage_estimator", "reinforce_baseline",
                 "--n_samples_per_prompt", "2", "--rollout_batch_size", "8", "--train_batch_size", "16",
                 "--micro_train_batch_size", "8", "--generate_max_len", "24", "--prompt_max_len", "16",
                 "--param_dtype", "fp32", "--use_mlflow", "false", "--max_steps", "3", "--async_train",
                 "--partial_rollout", "--packing_samples", "--save_path", str(tmp_path / "out")]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert 0.0 <= metrics["rollout/staleness"] <= metrics["rollout/staleness_max"] <= 1.0
    assert metrics["rollout/agent_failed_frac"] == 0.0
    # an untrained model rarely ends its first action before the episode's budget: one turn each mostly
    # (tests/learning/test_rl_agent_learning.py trains real multi-turn episodes)
    assert metrics["rollout/agent_turns"] >= 1.0 and "rollout/agent/dummy_scores" in metrics
    assert "rollout/step_rewards_per_sample" not in metrics  # without --agent_turn_rewards: OpenRLHF's sum


@pytest.mark.slow
def test_a_run_with_per_turn_rewards_trains_on_them(prepared, tmp_path, capsys, one_torch_thread):
    import json

    from rlhf_core.cli import main

    agent = tmp_path / "agent_func.py"
    agent.write_text(OPENRLHF_STYLE_FILE)
    assert main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--agent_func_path", str(agent), "--agent_turn_rewards", "--advantage_estimator", "group_norm",
                 "--n_samples_per_prompt", "2", "--rollout_batch_size", "8", "--train_batch_size", "16",
                 "--micro_train_batch_size", "8", "--generate_max_len", "24", "--prompt_max_len", "16",
                 "--param_dtype", "fp32", "--use_mlflow", "false", "--max_steps", "2",
                 "--save_path", str(tmp_path / "out")]) == 0
    metrics = json.loads(capsys.readouterr().out)["metrics"]
    assert metrics["rollout/step_rewards_per_sample"] >= 1.0  # each answered turn's reward, placed


def test_the_built_in_calculator_environment_runs_its_tool_and_scores_the_answer():
    cls = load_agent("calculator")
    env = cls()

    def step(action, label="27531"):
        return asyncio.run(env.step({"action_text": action, "label": label, "observation_text": ""}))

    called = step("calc: 483*57<|eos|>")
    assert called["environment_feedback"] == "<|user|>27531<|assistant|>" and not called["done"]
    assert called["rewards"] == 0.0 and called["extra_logs"]["tool_calls"] == 1
    assert step("27531<|eos|>") == {"rewards": 1.0, "scores": 1.0, "environment_feedback": "", "done": True,
                                    "extra_logs": {"tool_calls": 1, "used_tool": 1.0}}
    assert step("27530<|eos|>")["rewards"] == 0.0
    env = cls()
    crashed = step("calc: __import__('os').system('true')")  # not arithmetic: the tool raises, the episode ends
    assert crashed["done"] and crashed["rewards"] == 0.0


def test_a_tool_that_hangs_is_killed_at_its_deadline_and_the_sandbox_starts_again():
    from rlhf_core.rl.tools import ToolError, ToolSandbox

    sandbox = ToolSandbox(timeout_s=0.5, extra_source="def hang(text):\n    while True:\n        pass\n"
                                                     "TOOLS['hang'] = hang\n")
    try:
        assert sandbox.call("calc", "(2+3)*4") == "20"
        started = time.perf_counter()
        with pytest.raises(ToolError, match="no answer within 0.5 s"):
            sandbox.call("hang", "")
        assert time.perf_counter() - started < 3
        with pytest.raises(ToolError, match="ZeroDivisionError"):
            sandbox.call("calc", "1//0")
        assert sandbox.call("calc", "7*6") == "42" and sandbox.restarts == 1
    finally:
        sandbox.close()


def test_the_sandbox_worker_is_replaced_after_its_share_of_calls(monkeypatch):
    """Its CPU-seconds limit bounds a stretch of calls, not the whole run."""
    from rlhf_core.rl import tools

    monkeypatch.setattr(tools, "CALLS_PER_WORKER", 2)
    sandbox = tools.ToolSandbox(extra_source="import os\nTOOLS['pid'] = lambda text: str(os.getpid())\n")
    try:
        pids = [sandbox.call("pid", "") for _ in range(5)]
        assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4] and sandbox.restarts == 0
    finally:
        sandbox.close()


def test_a_tool_call_parser_without_an_agent_is_said_not_applied(prepared, tmp_path, capsys, one_torch_thread):
    """It is the policy endpoint's, which only an agent file's OpenAIAgentExecutor starts."""
    from rlhf_core.cli import main

    reward = tmp_path / "reward.py"
    reward.write_text("import torch\n\ndef reward_func(queries, prompts, labels, **kw):\n"
                      "    return torch.zeros(len(queries))\n")
    assert main(["train", "ppo", "--pretrain", prepared["base"], "--prompt_data", f"json@{prepared['prompts']}",
                 "--remote_rm_url", str(reward), "--rollout_batch_size", "2", "--n_samples_per_prompt", "2",
                 "--train_batch_size", "4", "--generate_max_len", "4", "--max_steps", "1", "--use_mlflow", "false",
                 "--train.agent_tool_call_parser", "mistral", "--save_path", str(tmp_path / "out")]) == 0
    assert ("not applied here: --train.agent_tool_call_parser mistral needs --train.agent_func_path"
            in capsys.readouterr().err)
