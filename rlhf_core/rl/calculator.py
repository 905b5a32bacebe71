"""The built-in tool task's rules (the `multiply` task), shared by its two agents: the environment
`calculator_agent.py` (`--agent_func_path calculator`) and the HTTP-driven `calculator_http_agent.py`
(`calculator-http`).

Each action is either a call of the calculator, `calc: EXPRESSION`, run in the tool sandbox
(`rl/tools.py`: its own process, a 5 s deadline per call), or the answer. The answer ends the
episode with reward 1 if it is the label, else 0; a call that fails (the tool raised or hung) or a
call past `MAX_CALLS` ends it with 0. `logs` report the calls, so a run logs how often the policy
uses the tool (`rollout/agent/tool_calls`, `rollout/agent/used_tool`).
"""

from __future__ import annotations

import asyncio
import atexit

from rlhf_core.data.synthetic import TOOL_CALL_PREFIX
from rlhf_core.rl.tools import ToolError, ToolSandbox

MAX_CALLS = 2

SANDBOX = ToolSandbox(timeout_s=5.0)  # one worker process for the whole run, started at the first call
atexit.register(SANDBOX.close)


class CalculatorEpisode:
    def __init__(self):
        self.calls = 0

    async def act(self, action: str, label) -> tuple[float | None, str]:
        """`(None, result)` after a call, the episode going on; `(reward, "")` when it ends."""
        action = action.strip()
        if not action.startswith(TOOL_CALL_PREFIX):
            return (1.0 if action == str(label).strip() else 0.0), ""
        self.calls += 1
        if self.calls > MAX_CALLS:
            return 0.0, ""
        try:
            return None, await asyncio.to_thread(SANDBOX.call, "calc", action[len(TOOL_CALL_PREFIX):])
        except ToolError:
            return 0.0, ""

    @property
    def logs(self) -> dict[str, float]:
        return {"tool_calls": self.calls, "used_tool": float(self.calls > 0)}
