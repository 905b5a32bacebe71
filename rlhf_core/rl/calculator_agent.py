"""The built-in agentic task's environment: `--agent_func_path calculator` (the `multiply` task).

Written as an OpenRLHF agent file (it imports `openrlhf.utils.agent`, which the loader maps to
`rl/agent_api.py`), so it doubles as an example of the interface. Each turn the policy either
calls the tool, an assistant turn `calc: EXPRESSION`, or answers. A call runs in the tool sandbox
(`rl/tools.py`: its own process, a deadline per call) and its result comes back as a user turn in
the tiny models' chat template (`<|user|>RESULT<|assistant|>`), so the policy continues as in its
SFT demonstrations (`data/synthetic._multiply_conversation`). An answer ends the episode: reward 1
if it is the label, else 0. A tool that raises or runs past its deadline ends the episode with
reward 0, as do more than `MAX_CALLS` calls. `extra_logs` report the calls, so a run logs how
often the policy uses the tool (`rollout/agent/tool_calls`, `rollout/agent/used_tool`).
"""

import asyncio
import atexit
import re

from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from rlhf_core.data.synthetic import TOOL_CALL_PREFIX
from rlhf_core.rl.tools import ToolError, ToolSandbox

MAX_CALLS = 2
SPECIAL = re.compile(r"<\|[a-z]+\|>")  # the tiny tokenizer's special tokens, as decoded action text shows them
RESULT_TURN = "<|user|>{}<|assistant|>"

SANDBOX = ToolSandbox(timeout_s=5.0)
atexit.register(SANDBOX.close)


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.calls = 0

    async def reset(self, states: dict, **kwargs) -> dict:
        return {"observation": states["observation"]}

    def _end(self, reward: float) -> dict:
        return {"rewards": reward, "scores": reward, "environment_feedback": "", "done": True,
                "extra_logs": {"tool_calls": self.calls, "used_tool": float(self.calls > 0)}}

    async def step(self, states: dict, **kwargs) -> dict:
        action = SPECIAL.sub("", states["action_text"]).strip()
        if not action.startswith(TOOL_CALL_PREFIX):
            return self._end(1.0 if action == str(states["label"]).strip() else 0.0)
        self.calls += 1
        if self.calls > MAX_CALLS:
            return self._end(0.0)
        try:
            result = await asyncio.to_thread(SANDBOX.call, "calc", action[len(TOOL_CALL_PREFIX):])
        except ToolError:
            return self._end(0.0)
        return {"rewards": 0.0, "scores": 0.0, "environment_feedback": RESULT_TURN.format(result), "done": False,
                "extra_logs": {"tool_calls": self.calls, "used_tool": 1.0}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
