"""The built-in agentic task driven over HTTP: `--agent_func_path calculator-http`.

The same episodes as `calculator_agent.py` (the `multiply` task: call the tool with `calc:
EXPRESSION`, read its result, answer), written as an agent that talks to the policy through its
OpenAI-compatible endpoint (`rl/policy_server.py`) with chat messages, as an agent framework
would: an example of `OpenAIAgentExecutor`, and the proof that rollouts driven that way train.
"""

import asyncio
import atexit

from rlhf_core.data.synthetic import TOOL_CALL_PREFIX
from rlhf_core.rl.agent_api import OpenAIAgentExecutor
from rlhf_core.rl.tools import ToolError, ToolSandbox

MAX_CALLS = 2

SANDBOX = ToolSandbox(timeout_s=5.0)
atexit.register(SANDBOX.close)


class AgentExecutor(OpenAIAgentExecutor):
    async def run_agent(self, prompt, label, session_id: str) -> dict:
        messages = [{"role": "user", "content": prompt}]
        calls = 0

        def end(reward: float) -> dict:
            return {"reward": reward, "extra_logs": {"tool_calls": calls, "used_tool": float(calls > 0)}}

        while True:
            reply = await self.chat(messages, session_id)
            action = reply.strip()
            if not action.startswith(TOOL_CALL_PREFIX):
                return end(1.0 if action == str(label).strip() else 0.0)
            calls += 1
            if calls > MAX_CALLS:
                return end(0.0)
            try:
                result = await asyncio.to_thread(SANDBOX.call, "calc", action[len(TOOL_CALL_PREFIX):])
            except ToolError:
                return end(0.0)
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": result}]
