"""The built-in agentic task's environment: `--agent_func_path calculator` (the `multiply` task).

Written as an OpenRLHF agent file (it imports `openrlhf.utils.agent`, which the loader maps to
`rl/agent_api.py`), so it doubles as an example of the interface. The rules are
`rl/calculator.py`'s; a call's result comes back as a user turn in the tiny models' chat
template (`<|user|>RESULT<|assistant|>`), so the policy continues as in its SFT demonstrations
(`data/synthetic._multiply_conversation`).
"""

import re

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from rlhf_core.rl.calculator import CalculatorEpisode

SPECIAL = re.compile(r"<\|[a-z]+\|>")  # the tiny tokenizer's special tokens, as decoded action text shows them
RESULT_TURN = "<|user|>{}<|assistant|>"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.episode = CalculatorEpisode()

    async def reset(self, states: dict, **kwargs) -> dict:
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict:
        reward, result = await self.episode.act(SPECIAL.sub("", states["action_text"]), states["label"])
        done = reward is not None
        return {"rewards": reward or 0.0, "scores": reward or 0.0, "done": done,
                "environment_feedback": "" if done else RESULT_TURN.format(result), "extra_logs": self.episode.logs}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
