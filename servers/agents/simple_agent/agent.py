"""The simple agent: the multi-turn tool loop, as `gym_grpc.agent.ToolLoopAgent` runs it.

Call the model; run every function call it made against the resources
server, in order, and feed the outputs back; repeat until the model answers
without calling a tool, its output is cut short, or `max_steps` model calls
were made. Then verify and close the session. (A stateless environment,
as DescribeTools says, gets no SeedSession and CloseSession.) A tool's failure (unknown tool,
arguments that are not JSON, an exception in the tool) goes back to the
model as the tool's output; only a failing server fails the rollout.

Configs name it `servers/agents/simple_agent/agent.py:SimpleAgent`; a custom
agent subclasses ToolLoopAgent and overrides one of its hooks.
"""

from __future__ import annotations

from gym_grpc.agent import ToolLoopAgent, ToolLoopConfig

SimpleAgentConfig = ToolLoopConfig


class SimpleAgent(ToolLoopAgent):
    Config = SimpleAgentConfig
    config: SimpleAgentConfig
