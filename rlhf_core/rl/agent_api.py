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
    """What an environment sees as `states["sampling_params"]` and may hand back changed: vLLM's
    attribute names for the knobs the episode loop honours (temperature, top_p, top_k per
    episode; `max_tokens` is the episode's remaining budget, set before each turn)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 1
    logprobs: int | None = 1
