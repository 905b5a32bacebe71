"""The built-in agentic task driven over HTTP: `--agent_func_path calculator-http`.

The same episodes as `calculator_agent.py` (the rules: `rl/calculator.py`), written as an agent
that talks to the policy through its OpenAI-compatible endpoint (`rl/policy_server.py`) with chat
messages, as an agent framework would: an example of `OpenAIAgentExecutor`, and the proof that
rollouts driven that way train.
"""

from rlhf_core.rl.agent_api import OpenAIAgentExecutor
from rlhf_core.rl.calculator import CalculatorEpisode


class AgentExecutor(OpenAIAgentExecutor):
    async def run_agent(self, prompt, label, session_id: str) -> dict:
        messages = [{"role": "user", "content": prompt}]
        episode = CalculatorEpisode()
        while True:
            reply = await self.chat(messages, session_id)  # the reply goes back unchanged: the session extends
            reward, result = await episode.act(reply, label)
            if reward is not None:
                return {"reward": reward, "extra_logs": episode.logs}
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": result}]
