"""Episodes of an agent that drives the policy over HTTP (`OpenAIAgentExecutor`, `rl/policy_server.py`).

Each episode is one `run_agent(prompt, label, session_id)` coroutine on the environment event
loops (`rl/agents.EventLoops`), all of a batch at once; their requests reach the endpoint
concurrently and are batched into engine calls. The deadline (`--train.agent_timeout_s`) covers a
whole episode here: the agent decides how many calls it makes. An episode becomes a training
sample from its session's calls (`policy_server.trace_sample`) and the reward `run_agent`
returned. One that raised, missed its deadline or returned no reward ends with reward 0 (and
counts in `rollout/agent_failed_frac`); if it never called the policy, a completion of its prompt
is sampled for it so that its prompt's group keeps its size. All episodes of a batch failing is
an error, as in `rl/agents.py`.
"""

from __future__ import annotations

import itertools
import os
import secrets
import sys
import uuid
from collections.abc import Callable

import torch

from rlhf_core.rl.env_calls import AgentError, EnvFailure, EventLoops, call_env, extra_logs, number
from rlhf_core.rl.experience import RolloutSample
from rlhf_core.rl.policy_server import PolicyServer, trace_sample

TOKEN_ENV = "RLHF_POLICY_TOKEN"


class ServedRollouts:
    def __init__(self, executor, tokenizer, max_length: int, max_new_tokens: int, raw_prompts: dict,
                 timeout_s: float = 60.0, model_name: str = "policy", tool_call_parser: str = "auto"):
        token = os.environ.get(TOKEN_ENV, "").strip() or secrets.token_urlsafe(32)
        self.server = PolicyServer(tokenizer, model_name, max_length, token, tool_call_parser=tool_call_parser)
        executor.base_url, executor.api_key, executor.model = self.server.base_url, token, model_name
        self.executor, self.tokenizer, self.raw_prompts = executor, tokenizer, raw_prompts
        self.max_new_tokens, self.timeout_s = max_new_tokens, timeout_s
        self.loops = EventLoops()
        print(f"rlhf: the policy's OpenAI-compatible endpoint for the agent: {self.server.base_url} (tool calls "
              f"read in the {self.server.tool_call_format} format{self.server.tool_call_why})",
              file=sys.stderr, flush=True)

    def run(self, prompt_ids: list[list[int]], indices: list[int], labels: list, n: int, temperature: float,
            seed: int, generate: Callable, top_k: int = -1, top_p: float = 1.0,
            between: Callable[[], int] | None = None) -> list[RolloutSample]:
        version = between() if between is not None else None  # the endpoint serves one policy per batch
        counter = itertools.count()
        self.server.batcher.generate = lambda seqs, budgets: generate(seqs, temperature, budgets,
                                                                     seed + 7919 * next(counter), top_k, top_p)
        episodes = [(ids, index, label, uuid.uuid4().hex) for ids, index, label in
                    zip(prompt_ids, indices, labels, strict=True) for _ in range(n)]
        decode = self.tokenizer.decode
        calls = []
        for slot, (ids, _, label, session) in enumerate(episodes):
            prompt = self.raw_prompts.get(tuple(ids), decode(ids, skip_special_tokens=True))
            calls.append((slot, lambda p=prompt, lb=label, s=session: call_env(self.executor.run_agent, p, lb, s)))
        try:
            answers = self.loops.run(calls, self.timeout_s)
        finally:  # an abandoned episode's request may still be generating: the engines are free after this
            self.server.batcher.stop_serving()
        sessions = [self.server.take(session_id) for *_, session_id in episodes]
        self.server.forget_sessions()  # what abandoned episodes' late calls left
        samples, failures = [], []
        for (ids, index, _, session_id), answer, session in zip(episodes, answers, sessions, strict=True):
            reward = score = 0.0
            logs: dict = {}
            sample = failure = None
            try:
                if session is None:
                    raise EnvFailure(f"run_agent never called the policy with its session_id {session_id}")
                sample = trace_sample(session, index)  # ValueError: calls that do not chain
                if isinstance(answer, EnvFailure):
                    raise answer
                if not isinstance(answer, dict) or "reward" not in answer:
                    raise EnvFailure(f"run_agent must return {{'reward': number}}, got {answer!r:.200}")
                reward = number(answer["reward"], "reward")
                score = reward if answer.get("scores") is None else number(answer["scores"], "scores")
                logs = extra_logs(answer.get("extra_logs"))
            except (EnvFailure, ValueError) as e:  # the episode's sample, if it has one, trains with reward 0
                failure, reward, score = str(e), 0.0, 0.0
                failures.append(failure)
            if sample is None:  # nothing sampled: a completion of its prompt stands for it (its group keeps its size)
                (one,) = generate([ids], temperature, self.max_new_tokens, seed + 104729, top_k, top_p)
                sample = RolloutSample(list(ids), list(one.token_ids), index, torch.tensor(one.logprobs), one.finished)
            turns = len(session.calls) if session is not None else 0
            sample.extra.update({"agent_reward": reward, "agent_score": score, "turns": turns,
                                 "failed": failure is not None, "agent_logs": logs,
                                 "final_text": decode(session.calls[-1].completion_ids, skip_special_tokens=True)
                                 if turns else ""})
            if version is not None:
                sample.extra["versions"] = [version] * sample.response_len
            samples.append(sample)
        if failures and len(failures) == len(samples):
            raise AgentError(f"the agent failed every one of {len(samples)} episodes; the first: {failures[0]}")
        if failures:
            print(f"rlhf: {len(failures)} of {len(samples)} agent episodes failed (first: {failures[0]})",
                  file=sys.stderr, flush=True)
        return samples

    def close(self) -> None:
        self.loops.close()
        self.server.close()
