"""The classes an agent file subclasses, under OpenRLHF's names (`openrlhf.utils.agent`).

An OpenRLHF agent file (`--agent_func_path`, the same interface in v0.9.10 and v0.11.0) imports
`AgentInstanceBase` and `MultiTurnAgentExecutor` from `openrlhf.utils.agent`, defines an
environment `AgentInstance(AgentInstanceBase)` (`async reset(states)`, `async step(states)`) and
`AgentExecutor(MultiTurnAgentExecutor)` whose `__init__` passes it the instance class. While such
a file is imported (`rl/agents.load_agent`), that module name resolves to this one, so the file
runs here unchanged, with or without OpenRLHF installed.

The episode loop itself is `rl/agents.py`: it batches every episode's turn into one engine call,
puts a deadline on each environment call and masks the environment's tokens from the loss.
`MultiTurnAgentExecutor.execute` (the per-episode loop OpenRLHF runs inside its vLLM actor) is
therefore not called; an executor that overrides `execute` with a loop of its own is refused at
load time with that reason.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from dataclasses import dataclass


class AgentExecutorBase(ABC):
    """OpenRLHF's base of executors (`execute(prompt, label, sampling_params, max_length, hf_tokenizer,
    llm_engine)`): kept so that files subclassing it import."""

    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        """One episode (OpenRLHF's own loop); see the module docstring."""


class AgentInstanceBase(ABC):
    """One episode's environment: a fresh instance per sampled response."""

    @abstractmethod
    def __init__(self, *args, **kwargs):
        """Set up the episode's state (OpenRLHF's v0.9.10 example declares it `async`; both work here)."""

    async def reset(self, states: dict, **kwargs) -> dict:
        """`states`: `{"observation": prompt text, "label": label}` -> `{"observation": text}`."""
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs) -> dict:
        """`states`: `observation_text`, `action_text`, `label`, `sampling_params` -> `rewards`
        (a number or one-element tensor, summed over the turns), `environment_feedback` (text appended
        after the action), `done`; optionally `scores`, `sampling_params`, `extra_logs`."""


class MultiTurnAgentExecutor(AgentExecutorBase):
    """The executor of an `AgentInstance` class; the loop that runs it is `rl/agents.py`."""

    def __init__(self, agent_instance_cls):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError(f"MultiTurnAgentExecutor takes a subclass of AgentInstanceBase, got {agent_instance_cls!r}")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        raise NotImplementedError("rlhf runs MultiTurnAgentExecutor's episodes in rlhf_core.rl.agents, batched "
                                  "over the engines")


@dataclass
class SamplingParams:
    """What an environment sees as `states["sampling_params"]`: vLLM's attribute names for the RL
    stage's sampling (`max_tokens` is the episode's remaining budget, set before each turn). One
    handed back changed is not applied (said once): the trainer's log-probs must match the engine's."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1
    logprobs: int | None = 1


class OpenAIAgentExecutor(AgentExecutorBase):
    """rlhf's executor for agents that talk to the policy over HTTP, as to any OpenAI-compatible server
    (`rl/policy_server.py`): subclass it as `AgentExecutor` and write `run_agent`.

    Before the first episode the RL stage sets `base_url` (`http://127.0.0.1:PORT/v1`), `api_key`
    (the endpoint's bearer token) and `model`. `run_agent` runs one episode: it sends its requests
    with the `session_id` it is given (OpenAI clients: `extra_body={"session_id": session_id}`; or
    `await self.chat(messages, session_id)`), may hand `base_url`/`api_key` to another process or
    framework, and returns `{"reward": number}` (optionally `scores`, `extra_logs`). The session's
    completions are trained, everything else in the conversation is not."""

    base_url: str = ""
    api_key: str = ""
    model: str = ""

    async def run_agent(self, prompt, label, session_id: str) -> dict:
        raise NotImplementedError("AgentExecutor.run_agent(prompt, label, session_id) -> {'reward': ...}")

    async def chat(self, messages: list[dict], session_id: str, max_tokens: int | None = None) -> str:
        """One chat completion of the session (no client library needed); its text."""
        body = {"model": self.model, "messages": messages, "session_id": session_id}
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
        request = urllib.request.Request(f"{self.base_url}/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json",
                                                  "Authorization": f"Bearer {self.api_key}"})

        def send() -> str:
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    return json.loads(response.read())["choices"][0]["message"]["content"]
            except urllib.error.HTTPError as e:  # the endpoint's reason, not only its status
                raise RuntimeError(f"the policy endpoint answered {e.code}: {e.read().decode(errors='replace')}") from None

        return await asyncio.to_thread(send)

    async def execute(self, prompt, label, sampling_params, max_length: int, hf_tokenizer, llm_engine,
                      images=None):
        raise NotImplementedError("rlhf runs OpenAIAgentExecutor's episodes in rlhf_core.rl.agents")
