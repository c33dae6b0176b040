"""A gym-grpc environment as a verifiers taskset (verifiers 0.4, its `verifiers.v1` stack).

    import verifiers.v1 as vf
    from gym_grpc.adapters.verifiers import GymGrpcTaskset, GymGrpcTasksetConfig

    taskset = GymGrpcTaskset(GymGrpcTasksetConfig(
        dataset="servers/resources/weather/data/example.jsonl",
        task={"registry": "127.0.0.1:50050", "resources_server": "weather"}))

Why this shape: verifiers 0.4 has no MultiTurnEnv/ToolEnv/Rubric any more. An
environment there is a `Taskset` (rows in, typed `Task`s out) played by a
harness (the agent loop, a program verifiers launches); a task's `setup`
prepares the rollout, its `@vf.reward` methods score the finished `Trace`,
and tools are `Toolset`s, MCP servers verifiers starts and the harness calls.
verifiers' own NeMo Gym bridge (`verifiers.v1.tasksets.nemo_gym`) drives NeMo
Gym's HTTP resources servers exactly so; this is the same over gRPC:

- `GymGrpcTaskset.load` reads a gym-grpc (NeMo Gym) JSONL: each row is a task
  whose prompt is its `responses_create_params.input` (parsed by verifiers'
  own Responses dialect) and which keeps the row to seed and verify with;
- `GymGrpcTask.setup` opens the rollout's session (SeedSession, when the
  environment is stateful) and puts the environment's tools (DescribeTools)
  and the session in the rollout's state;
- `GymGrpcToolset` is the MCP server the harness sees: its tools are the
  session's, each call a CallTool on it (a tool's error is an MCP error result,
  for the model to read);
- the `gym_grpc` reward turns the trace into a Responses object with
  verifiers' own converter (`trace_to_nemo_response`, which gym-grpc reads as
  it reads NeMo Gym's), calls Verify, records the verifier's numeric fields
  as metrics and closes the session. Verify needs the session still open
  (a stateful environment checks its state), so the session closes there,
  after scoring, not in `finalize` (which runs before scoring). A rollout that
  fails before scoring leaves its session to the server's idle time-out.

A gym-grpc error in setup or scoring raises out of the hook, and verifiers
records it on the trace (a TaskError naming the hook) instead of a reward.

verifiers finds a taskset by id only in a top-level module (its loader looks
up `verifiers.v1.tasksets.<id>` first, which fails for a dotted id), and
gym-grpc claims no top-level name but its own: construct the taskset in
Python (as above), or re-export `GymGrpcTaskset` from a module of your own.

The reverse direction (a verifiers taskset served as a gym-grpc resources
server) is `gym_grpc.adapters.verifiers_server`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from pydantic import Field

from gym_grpc.adapters import missing_extra
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import new_id
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r

try:
    import verifiers.v1 as vf
    from mcp.server.mcpserver import Context, MCPServer
    from mcp.types import CallToolResult, TextContent, Tool
    from verifiers.v1.dialects.responses import ResponsesDialect
    from verifiers.v1.runtimes import Runtime
    from verifiers.v1.tasksets.nemo_gym.response import trace_to_nemo_response
except ImportError as e:  # pragma: no cover - the extra's own message
    raise missing_extra("verifiers", "verifiers", e) from e

__all__ = [
    "GymGrpcData",
    "GymGrpcState",
    "GymGrpcTask",
    "GymGrpcTaskConfig",
    "GymGrpcTaskset",
    "GymGrpcTasksetConfig",
    "GymGrpcToolset",
]

#: One Registry per address in a process (the toolset's MCP server, the evaluation's).
_registries: dict[str, Registry] = {}


def _client(registry: str, server: str, timeout: float) -> ResourcesClient:
    if registry not in _registries:
        _registries[registry] = Registry(registry)
    return ResourcesClient(_registries[registry], server, timeout=timeout)


class GymGrpcState(vf.State):
    """What the rollout's task setup tells its tool server: where the session is, and its tools."""

    registry: str = ""
    resources_server: str = ""
    session_id: str = ""
    timeout_seconds: float = 600.0
    #: The environment's tools as function schemas (name, description, parameters).
    tools: list[dict[str, Any]] = Field(default_factory=list)
    #: Whether the session is open (a stateless environment has none to open).
    session_open: bool = False

    def client(self) -> ResourcesClient:
        return _client(self.registry, self.resources_server, self.timeout_seconds)


class GymGrpcToolset(vf.Toolset[vf.SharedToolsetConfig, GymGrpcState]):
    """The session's tools as an MCP server: the catalogue is the rollout's, so the
    handlers are replaced (as verifiers' NeMo Gym toolset does) rather than declared."""

    TOOL_PREFIX = None  # the model sees the environment's own tool names

    def register(self, mcp: MCPServer) -> None:
        server = cast(Any, mcp)
        server.list_tools = self._with_state(self.list_tools)
        server.call_tool = self._with_state(self.call_tool)

    async def list_tools(self) -> list[Tool]:
        return [
            Tool(name=t["name"], description=t.get("description") or None, input_schema=t.get("parameters") or {})
            for t in self.state.tools
        ]

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Context | None = None) -> CallToolResult:
        call = r.FunctionCall(name=name, arguments=json.dumps(arguments or {}), call_id=new_id("call"))
        result = await self.state.client().call_tool(self.state.session_id, call)
        return CallToolResult(content=[TextContent(type="text", text=result.output)], is_error=result.error)


class GymGrpcTaskConfig(vf.TaskConfig):
    """Where the environment is (`--env.taskset.task.*`)."""

    registry: str = "127.0.0.1:50050"
    """Address of the registry `gym-grpc run` serves."""
    resources_server: str = ""
    """The resources server's name in the registry."""
    timeout_seconds: float = Field(600.0, gt=0)
    """The longest one call (seed, tool, verify, close) may take."""


class GymGrpcTasksetConfig(vf.TasksetConfig):
    dataset: Path
    """A gym-grpc (NeMo Gym) JSONL of task rows."""
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    task: GymGrpcTaskConfig = GymGrpcTaskConfig()


class GymGrpcData(vf.TaskData):
    row: dict[str, Any]
    """The task row as the file holds it: what SeedSession and Verify get."""


class GymGrpcTask(vf.Task[GymGrpcData, GymGrpcState, GymGrpcTaskConfig]):
    async def setup(self, trace: vf.Trace, runtime: Runtime | None = None) -> None:
        if not self.config.resources_server:
            raise ValueError("set the task's resources_server (--env.taskset.task.resources-server)")
        state = trace.state
        state.registry = self.config.registry
        state.resources_server = self.config.resources_server
        state.timeout_seconds = self.config.timeout_seconds
        state.session_id = f"verifiers-{trace.id or uuid.uuid4().hex}"
        client = state.client()
        described = await client.describe_tools()
        state.tools = [
            {"name": t.name, "description": t.description, "parameters": json.loads(t.parameters_json or "{}")}
            for t in described.tools
        ]
        if not described.stateless:
            await client.seed_session(state.session_id, rows.task_from_row(self.data.row))
            state.session_open = True

    @vf.reward(weight=1.0)
    async def gym_grpc(self, trace: vf.Trace) -> float:
        """The resources server's Verify of the trace; its numeric fields become metrics."""
        state = trace.state
        params = self.data.row.get("responses_create_params") or {}
        names = [t["name"] for t in state.tools]
        response = rows.response_from_json(trace_to_nemo_response(trace, params, names))
        client = state.client()
        try:
            verdict = await client.verify(state.session_id, rows.task_from_row(self.data.row), response)
        finally:
            if state.session_open:
                state.session_open = False
                await client.close_session(state.session_id)
        fields = rows.json_field(verdict, "fields")
        trace.info["gym_grpc"] = {"fields": fields, "reward_components": dict(verdict.reward_components)}
        for key, value in fields.items():
            if isinstance(value, (bool, int, float)):
                trace.record_metric(key, float(value))
        return float(verdict.reward)


class GymGrpcTaskset(vf.Taskset[GymGrpcTask, GymGrpcTasksetConfig]):
    """The rows of a gym-grpc JSONL as verifiers tasks on a running resources server."""

    @classmethod
    def toolsets(cls, config: GymGrpcTasksetConfig) -> list[vf.Toolset]:
        return [GymGrpcToolset(config.tools)]

    def load(self) -> Iterator[GymGrpcTask]:
        path = self.config.dataset.expanduser().resolve()
        dialect = ResponsesDialect()
        with path.open(encoding="utf-8") as lines:
            for index, line in enumerate(filter(str.strip, lines)):
                row = json.loads(line)
                request = dialect.parse_request(row["responses_create_params"])
                yield GymGrpcTask(
                    GymGrpcData(name=f"{path.stem}:{index}", prompt=request.messages, row=row), self.config.task
                )


if __name__ == "__main__":  # verifiers starts a toolset as `python -m <its module>`
    GymGrpcToolset.run()
