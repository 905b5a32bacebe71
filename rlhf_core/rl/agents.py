"""Multi-turn rollouts against an environment (`--train.agent_func_path` / `--agent_func_path`).

An episode: the prompt (or what the environment's `reset` makes of it) is the observation; the
policy acts (one generation, up to the episode's remaining token budget); the environment's
`step` answers with a reward, feedback text and whether it is done; the feedback's tokens are
appended and the policy acts again, until the environment says done, the budget
(`--data.max_len` tokens for the whole episode, prompt included) is spent or
`--train.agent_max_turns` actions were taken. As in OpenRLHF: the feedback is tokenized on its own
and appended after the action's tokens; the episode's reward is the sum of its turns' rewards,
on its last action token; only action tokens carry loss, KL and advantages
(`RolloutSample.action_mask`); the engine's log-probs are kept for the action tokens.

Unlike OpenRLHF, which runs each episode as its own coroutine inside a vLLM actor, the loop here
runs in the RL controller and batches the turn of every active episode into one engine call, so
it works with every rollout engine (transformers or vLLM, local or on Ray). Each environment
call has a deadline (`--train.agent_timeout_s`): the coroutines run on a few event loops in
daemon threads; one that raises, returns something malformed or does not answer in time ends its
episode (the reward it earned so far stays; `rollout/agent_failed_frac` counts them) and never
the run, unless every episode of a batch failed, which is a broken environment and an error. A
call that blocks its thread (synchronous code that hangs) cannot be interrupted: its event loop
is abandoned and replaced, and the episodes that shared it end too.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import sys
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from rlhf_core.infra.not_applied import say_once
from rlhf_core.infra.settings import ConfigError
from rlhf_core.rl import agent_api
from rlhf_core.rl.env_calls import LOOPS, AgentError, EnvFailure, EventLoops, call_env, extra_logs, number
from rlhf_core.rl.experience import RolloutSample

SHIM_MODULES = ("openrlhf", "openrlhf.utils", "openrlhf.utils.agent")


# -- loading ---------------------------------------------------------------------------------
@contextlib.contextmanager
def _openrlhf_names():
    """`openrlhf.utils.agent` resolves to `rl/agent_api.py` while an agent file is imported."""
    saved = {name: sys.modules.get(name) for name in SHIM_MODULES}
    for name in SHIM_MODULES[:-1]:
        package = types.ModuleType(name)
        package.__path__ = []
        sys.modules[name] = package
    sys.modules["openrlhf.utils.agent"] = agent_api
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# Environments that come with rlhf, by the name `--agent_func_path` takes instead of a file.
BUILTIN_AGENTS = {"calculator": Path(__file__).with_name("calculator_agent.py"),
                  "calculator-http": Path(__file__).with_name("calculator_http_agent.py")}


def load_agent(path: str):
    """What an agent file (or a built-in one, `BUILTIN_AGENTS`) runs: the environment class its
    `AgentExecutor(MultiTurnAgentExecutor)` names, or its `AgentExecutor(OpenAIAgentExecutor)`
    itself (an agent driving the policy's HTTP endpoint). Raises `ConfigError` naming the file
    and what is wrong. Imported once per process: the CLI checks the file before any model loads,
    and the stage then gets the same classes."""
    file = BUILTIN_AGENTS.get(path, Path(path))
    if file.suffix != ".py":
        raise ConfigError(f"--train.agent_func_path {path}: must be a Python file (.py)")
    if not file.is_file():
        raise ConfigError(f"--train.agent_func_path {path}: no such file")
    return _load(path, file.resolve())


def check_agent(path: str, turn_rewards: bool = False):
    """`load_agent`, and whether the run's flags suit it: per-turn rewards need an environment
    (an OpenAIAgentExecutor's run_agent returns one reward per episode). ConfigError when not."""
    loaded = load_agent(path)
    if turn_rewards and isinstance(loaded, agent_api.OpenAIAgentExecutor):
        raise ConfigError(f"--train.agent_turn_rewards: {path} drives the policy's endpoint (OpenAIAgentExecutor), "
                          "whose run_agent returns one reward per episode; per-turn rewards come from an "
                          "environment's step() (AgentInstance)")
    return loaded


@functools.cache
def _load(path: str, file: Path):
    spec = importlib.util.spec_from_file_location(f"rlhf_agent_{abs(hash(str(file.resolve())))}", file)
    module = importlib.util.module_from_spec(spec)
    with _openrlhf_names():
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise ConfigError(f"--train.agent_func_path {path}: importing it failed: {type(e).__name__}: {e}") from e
        executor_cls = getattr(module, "AgentExecutor", None)
        if executor_cls is None:
            raise ConfigError(f"--train.agent_func_path {path}: defines no AgentExecutor class (OpenRLHF's interface: "
                             "class AgentExecutor(MultiTurnAgentExecutor) whose __init__ calls "
                             "super().__init__(AgentInstance))")
        if isinstance(executor_cls, type) and issubclass(executor_cls, agent_api.OpenAIAgentExecutor):
            if executor_cls.run_agent is agent_api.OpenAIAgentExecutor.run_agent:
                raise ConfigError(f"--train.agent_func_path {path}: AgentExecutor(OpenAIAgentExecutor) must define "
                                  "async run_agent(self, prompt, label, session_id) -> {'reward': ...}")
            try:
                return executor_cls()
            except Exception as e:
                raise ConfigError(f"--train.agent_func_path {path}: AgentExecutor() failed: "
                                  f"{type(e).__name__}: {e}") from e
        if not (isinstance(executor_cls, type) and issubclass(executor_cls, agent_api.MultiTurnAgentExecutor)):
            raise ConfigError(f"--train.agent_func_path {path}: AgentExecutor must subclass MultiTurnAgentExecutor "
                             "(from openrlhf.utils.agent) or rlhf's OpenAIAgentExecutor (rlhf_core.rl.agent_api: "
                             "an agent that talks to the policy over HTTP); an executor with a loop of its own "
                             "(AgentExecutorBase.execute driving OpenRLHF's vLLM actor) is not supported")
        if executor_cls.execute is not agent_api.MultiTurnAgentExecutor.execute:
            raise ConfigError(f"--train.agent_func_path {path}: AgentExecutor overrides execute(); rlhf runs the "
                             "multi-turn loop itself (batched over its engines), so only the AgentInstance's "
                             "reset/step are used: move the logic there")
        try:
            executor = executor_cls()
        except Exception as e:
            raise ConfigError(f"--train.agent_func_path {path}: AgentExecutor() failed: {type(e).__name__}: {e}") from e
    instance_cls = getattr(executor, "agent_instance_cls", None)
    if instance_cls is None:
        raise ConfigError(f"--train.agent_func_path {path}: AgentExecutor.__init__ must call "
                         "super().__init__(AgentInstance)")
    return instance_cls


# -- environments ----------------------------------------------------------------------------
async def _new_instance(cls: type):
    """`cls()`, awaiting an `async def __init__` (OpenRLHF v0.9.10's example declares one)."""
    if inspect.iscoroutinefunction(cls.__init__):
        instance = cls.__new__(cls)
        await instance.__init__()
        return instance
    return cls()


# -- episodes --------------------------------------------------------------------------------
@dataclass
class Episode:
    slot: int
    prompt_index: int
    label: object
    prompt_ids: list[int]
    observation: str
    sampling: agent_api.SamplingParams
    instance: object = None
    tokens: list[int] = field(default_factory=list)  # everything after the prompt: actions and feedback
    mask: list[int] = field(default_factory=list)  # 1 on action tokens
    logprobs: list[float] = field(default_factory=list)  # the engine's, of the action tokens
    versions: list = field(default_factory=list)  # the policy version of each action token (partial rollouts)
    reward: float = 0.0
    step_rewards: list = field(default_factory=list)  # (index among the action tokens, reward) per answered turn
    score: float | None = None
    turns: int = 0
    done: bool = False  # the environment ended the episode
    over: bool = False
    failure: str | None = None
    last_action: str = ""
    extra_logs: dict = field(default_factory=dict)

    def fail(self, why: str) -> None:
        self.failure, self.over = why, True


def _apply_step(ep: Episode, result, tokenize: Callable[[str], list[int]]) -> None:
    """Fold one `step` answer into the episode (raises `EnvFailure` on a malformed one)."""
    try:
        _fold_step(ep, result, tokenize)
    except EnvFailure:
        raise
    except Exception as e:  # whatever a malformed answer makes fail here is the environment's fault
        raise EnvFailure(f"an unusable answer ({type(e).__name__}: {e})") from None


def _fold_step(ep: Episode, result, tokenize: Callable[[str], list[int]]) -> None:
    if not isinstance(result, dict):
        raise EnvFailure(f"step() must return a dict, got {type(result).__name__}")
    missing = [k for k in ("rewards", "environment_feedback", "done") if k not in result]
    if missing:
        raise EnvFailure(f"step() returned no {', '.join(missing)}")
    feedback = result["environment_feedback"]
    if not isinstance(feedback, str):
        raise EnvFailure(f"environment_feedback must be text, got {type(feedback).__name__}")
    reward = number(result["rewards"], "rewards")  # everything read before the episode changes
    score = number(result["scores"], "scores") if result.get("scores") is not None else None
    done = result["done"]
    done = bool(done.item() if isinstance(done, torch.Tensor) else done)
    logs = extra_logs(result.get("extra_logs"))
    ids = tokenize(feedback) if feedback else []
    params = result.get("sampling_params")
    if params is not None and any(getattr(params, k, v) != v for k, v in (
            ("temperature", ep.sampling.temperature), ("top_p", ep.sampling.top_p), ("top_k", ep.sampling.top_k))):
        say_once("rlhf: an environment's step() returned other sampling_params (temperature, top_p, top_k): not "
                 "applied; every turn samples with the RL stage's settings (the trainer's log-probs must match "
                 "the engine's)")
    ep.reward += reward
    ep.step_rewards.append((sum(ep.mask) - 1, reward))  # at the turn's last action token (action tokens only)
    if score is not None:
        ep.score = score
    ep.extra_logs.update(logs)
    ep.observation += ep.last_action + feedback
    ep.tokens += ids
    ep.mask += [0] * len(ids)
    if done:
        ep.done = ep.over = True


class AgentRollouts:
    """Episodes of an environment class on the rollout engines.

    `generate(prompt_ids, temperature, max_new_tokens, seed, top_k, top_p)` -> one `Sample` per
    prompt (the controller's engines). `max_length`: the episode's token budget, prompt included;
    `max_new_tokens`: the room left for the first action when a long observation is cut from the
    left (OpenRLHF's rule)."""

    def __init__(self, instance_cls: type, tokenizer, max_length: int, max_new_tokens: int, max_turns: int = 0,
                 timeout_s: float = 60.0, loops: int = LOOPS):
        self.instance_cls, self.tokenizer = instance_cls, tokenizer
        self.max_length, self.max_new_tokens = max_length, max_new_tokens
        self.max_turns, self.timeout_s = max_turns, timeout_s
        self.loops = EventLoops(loops)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def run(self, prompt_ids: list[list[int]], indices: list[int], labels: list, n: int, temperature: float,
            seed: int, generate: Callable, top_k: int = -1, top_p: float = 1.0,
            between: Callable[[], int] | None = None) -> list[RolloutSample]:
        """`n` episodes for each prompt (`prompt_ids[k]` is prompt `indices[k]` of its set, with
        `labels[k]`), as `RolloutSample`s with `extra["agent_reward"]`/`["agent_score"]`.
        `between()` (partial rollouts, `rl/partial.py`): called before each turn's generation, where a
        pending weight sync happens; returns the policy version of the turn's tokens (`extra["versions"]`)."""
        decode = self.tokenizer.decode
        episodes = []
        for ids, index, label in zip(prompt_ids, indices, labels, strict=True):
            text = decode(ids, skip_special_tokens=False)
            for _ in range(n):
                episodes.append(Episode(len(episodes), index, label, list(ids), text,
                                        agent_api.SamplingParams(temperature, top_p, top_k)))
        self._reset(episodes)
        turn = 0
        while active := [ep for ep in episodes if not ep.over]:
            version = between() if between is not None else None
            self._act(active, generate, temperature, seed + 7919 * turn, top_k, top_p, version)
            stepping = [ep for ep in active if not ep.over]
            answers = self.loops.run([(ep.slot, self._step_call(ep)) for ep in stepping], self.timeout_s)
            for ep, answer in zip(stepping, answers, strict=True):
                try:
                    if isinstance(answer, EnvFailure):
                        raise answer
                    _apply_step(ep, answer, self.tokenize)
                except EnvFailure as e:
                    ep.fail(f"step: {e}")
                    continue
                if self.max_turns and ep.turns >= self.max_turns:
                    ep.over = True
            turn += 1
        failed = [ep for ep in episodes if ep.failure]
        if failed and len(failed) == len(episodes):
            raise AgentError(f"the environment failed every one of {len(episodes)} episodes; the first: "
                             f"{failed[0].failure}")
        if failed:
            print(f"rlhf: {len(failed)} of {len(episodes)} agent episodes ended by their environment failing (first: "
                  f"{failed[0].failure})", file=sys.stderr, flush=True)
        return [self._sample(ep) for ep in episodes]

    def _reset(self, episodes: list[Episode]) -> None:
        cls = self.instance_cls

        def start(ep: Episode):
            async def call():
                instance = await _new_instance(cls)
                return instance, await call_env(instance.reset, {"observation": ep.observation, "label": ep.label})
            return call

        answers = self.loops.run([(ep.slot, start(ep)) for ep in episodes], self.timeout_s)
        for ep, answer in zip(episodes, answers, strict=True):
            if isinstance(answer, EnvFailure):
                ep.fail(f"reset: {answer}")
                continue
            ep.instance, result = answer
            observation = result.get("observation") if isinstance(result, dict) else None
            if not isinstance(observation, str):
                ep.fail(f"reset: must return {{'observation': text}}, got {result!r:.200}")
                continue
            if observation != ep.observation:  # the environment rewrote the prompt
                ep.prompt_ids, ep.observation = self.tokenize(observation), observation
            room = self.max_length - self.max_new_tokens
            if len(ep.prompt_ids) > room:  # left-truncate, leaving room for the first action
                ep.prompt_ids = ep.prompt_ids[-room:] if room > 0 else []
                ep.observation = self.tokenizer.decode(ep.prompt_ids, skip_special_tokens=False)
            if not ep.prompt_ids:
                ep.fail(f"reset: --data.max_len {self.max_length} leaves no room for the observation")

    def _act(self, active: list[Episode], generate: Callable, temperature: float, seed: int, top_k: int,
             top_p: float, version: int | None) -> None:
        """One action for each active episode, all in one engine call, each up to its own episode's
        room left."""
        group = []
        for ep in active:
            room = self.max_length - len(ep.prompt_ids) - len(ep.tokens)
            if room <= 0:
                ep.over = True
                continue
            ep.sampling.max_tokens = room
            group.append(ep)
        if group:
            samples = generate([ep.prompt_ids + ep.tokens for ep in group], temperature,
                               [ep.sampling.max_tokens for ep in group], seed, top_k, top_p)
            for ep, sample in zip(group, samples, strict=True):
                ids = list(sample.token_ids)
                if not ids:  # nothing sampled (no room the engine would use): the episode cannot go on
                    ep.over = True
                    continue
                ep.tokens += ids
                ep.mask += [1] * len(ids)
                ep.logprobs += list(sample.logprobs)
                ep.versions += [version] * len(ids)
                ep.last_action = self.tokenizer.decode(ids, skip_special_tokens=False)
                ep.turns += 1

    def _step_call(self, ep: Episode) -> Callable[[], Awaitable]:
        states = {"observation_text": ep.observation, "action_text": ep.last_action, "label": ep.label,
                  "sampling_params": replace(ep.sampling)}  # a copy: what the environment does to it stays there
        return lambda: call_env(ep.instance.step, states)

    def _sample(self, ep: Episode) -> RolloutSample:
        keep = max(0, self.max_length - len(ep.prompt_ids))  # feedback past the budget is cut
        tokens, mask = ep.tokens[:keep], ep.mask[:keep]
        actions = [t for t, m in zip(tokens, mask, strict=True) if m]
        last = _last_action_ids(tokens, mask)
        return RolloutSample(
            ep.prompt_ids, tokens, ep.prompt_index, torch.tensor(ep.logprobs[: len(actions)], dtype=torch.float32),
            ep.done, action_mask=mask,
            extra={"agent_reward": ep.reward, "agent_score": ep.reward if ep.score is None else ep.score,
                   # each turn's reward where it came, read with --train.agent_turn_rewards (`step_reward_matrix`)
                   "step_rewards": list(ep.step_rewards),
                   "turns": ep.turns, "failed": ep.failure is not None, "agent_logs": dict(ep.extra_logs),
                   "versions": ep.versions[: len(actions)],  # (None each without partial rollouts)
                   "final_text": self.tokenizer.decode(last, skip_special_tokens=True)})

    def close(self) -> None:
        self.loops.close()


def _last_action_ids(tokens: list[int], mask: list[int]) -> list[int]:
    end = max((i for i, m in enumerate(mask) if m), default=-1) + 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return tokens[start:end]


def agent_stats(samples: list[RolloutSample]) -> dict[str, float]:
    """Per-rollout means: turns, failed episodes, and each number the environment logged."""
    if not samples or "turns" not in samples[0].extra:
        return {}
    n = len(samples)
    out = {"rollout/agent_turns": sum(s.extra["turns"] for s in samples) / n,
           "rollout/agent_failed_frac": sum(s.extra["failed"] for s in samples) / n}
    keys = sorted({k for s in samples for k in s.extra["agent_logs"]})
    for k in keys:
        values = [s.extra["agent_logs"][k] for s in samples if k in s.extra["agent_logs"]]
        out[f"rollout/agent/{k}"] = sum(values) / len(values)
    return out


class AgentRewardSource:
    """The rewards the environment gave (summed over turns) and its scores (`scores`, default the
    reward). Each turn's own reward stays in the sample too (`extra["step_rewards"]`), for
    `--train.agent_turn_rewards`."""

    def score(self, samples: list[RolloutSample], labels: list) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([float(s.extra["agent_reward"]) for s in samples]),
                torch.tensor([float(s.extra["agent_score"]) for s in samples]))


def make_agent_rollouts(path: str, tokenizer, max_length: int, max_new_tokens: int, max_turns: int,
                        timeout_s: float, raw_prompts: dict, turn_rewards: bool = False,
                        tool_call_parser: str = "auto"):
    """The episode runner of an agent file: `AgentRollouts` for an environment, `ServedRollouts`
    (`rl/served_agents.py`) for an agent that drives the policy's HTTP endpoint."""
    loaded = check_agent(path, turn_rewards)
    if isinstance(loaded, agent_api.OpenAIAgentExecutor):
        from rlhf_core.infra.not_applied import not_applied
        from rlhf_core.rl.served_agents import ServedRollouts

        if max_turns:
            not_applied("train.agent_max_turns", max_turns, "an environment (AgentInstance)",
                        "an OpenAIAgentExecutor's run_agent decides its calls; --data.max_len bounds the session")
        return ServedRollouts(loaded, tokenizer, max_length, max_new_tokens, raw_prompts, timeout_s,
                              tool_call_parser=tool_call_parser)
    if tool_call_parser != "auto":
        from rlhf_core.infra.not_applied import not_applied

        not_applied("train.agent_tool_call_parser", tool_call_parser,
                    "an agent that drives the policy's endpoint (OpenAIAgentExecutor)",
                    "an environment (AgentInstance) reads the policy's text itself")
    return AgentRollouts(loaded, tokenizer, max_length, max_new_tokens, max_turns, timeout_s)
