"""The verifiers adapter, with the real verifiers package and real gym-grpc servers.

Each test plays one rollout the way verifiers' machinery plays it, calling the
taskset's real hooks in its order: `Taskset` iteration, `Task.setup` on a
fresh `vf.Trace`, the toolset's MCP handlers (`list_tools`, `call_tool`) under
the rollout's state, the model's turns as the trace's message nodes, and
`Task.score`, verifiers' own scoring (rewards, weights, metrics). The model's
turns are written by the test. What is not exercised here: verifiers' harness
program and its MCP transport (both need `uv` to build the harness's own
virtualenv at run time).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import verifiers.v1 as vf
from verifiers.v1.graph import MessageNode
from verifiers.v1.mcp import server as mcp_server

from gym_grpc.adapters.verifiers import (
    GymGrpcState,
    GymGrpcTask,
    GymGrpcTaskset,
    GymGrpcTasksetConfig,
    GymGrpcToolset,
)
from gym_grpc.bundled.servers.resources.session_state.server import ShoppingCartEnv
from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv, forecast
from gym_grpc.launch.runner import RegistryServer
from gym_grpc.resources import Session
from gym_grpc.v1 import registry_service_pb2 as reg

WEATHER = Path(__file__).resolve().parents[1] / "servers" / "resources" / "weather" / "data" / "example.jsonl"
CART = Path(__file__).resolve().parents[1] / "servers" / "resources" / "session_state" / "data" / "example.jsonl"


@pytest.fixture
async def registry(start):
    service = await start(RegistryServer())

    def add(name: str, running) -> str:
        service.app.servicer.add(reg.ServerInfo(name=name, addresses=[running.address]))
        return service.address

    return add


def _taskset(dataset: Path, address: str, server: str) -> GymGrpcTaskset:
    config = GymGrpcTasksetConfig(dataset=dataset, task={"registry": address, "resources_server": server})
    return GymGrpcTaskset(config)


def _trace(task: GymGrpcTask) -> vf.Trace:
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data), agent=vf.AgentInfo(config=vf.AgentConfig())
    )
    trace.state = GymGrpcState()  # as verifiers gives a rollout the task's state type
    for message in task.data.prompt or []:
        _add(trace, message, sampled=False)
    return trace


def _add(trace: vf.Trace, message, sampled: bool = True) -> None:
    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))


async def _tool(toolset: GymGrpcToolset, trace: vf.Trace, name: str, arguments: dict):
    """Call a tool as the MCP server would, under the rollout's state."""
    token = mcp_server._call_state.set(trace.state)
    try:
        return await toolset.call_tool(name, arguments)
    finally:
        mcp_server._call_state.reset(token)


async def _tools(toolset: GymGrpcToolset, trace: vf.Trace):
    token = mcp_server._call_state.set(trace.state)
    try:
        return await toolset.list_tools()
    finally:
        mcp_server._call_state.reset(token)


async def _play_weather(trace, toolset, city: str, answer=None) -> None:
    """The model calls get_weather for `city` and answers (by default with the tool's temperature)."""
    call = vf.ToolCall(id="call_1", name="get_weather", arguments=json.dumps({"city": city}))
    _add(trace, vf.AssistantMessage(content=None, tool_calls=[call]))
    result = await _tool(toolset, trace, "get_weather", {"city": city})
    output = result.content[0].text
    _add(trace, vf.ToolMessage(tool_call_id="call_1", content=output), sampled=False)
    text = answer if answer is not None else f"It is {json.loads(output)['temperature_c']} C."
    _add(trace, vf.AssistantMessage(content=text))
    return output


def test_the_taskset_reads_a_gym_grpc_jsonl_into_verifiers_tasks():
    taskset = _taskset(WEATHER, "127.0.0.1:1", "weather")
    tasks = list(taskset)
    assert len(tasks) == sum(1 for line in WEATHER.read_text().splitlines() if line.strip())
    first = tasks[0]
    assert isinstance(first, GymGrpcTask) and first.data.idx == 0
    assert first.data.prompt_text == "What's the weather like in Paris right now?"
    assert first.data.row["expected_city"] == "Paris"
    assert [type(t).__name__ for t in GymGrpcTaskset.toolsets(taskset.config)] == ["GymGrpcToolset"]


async def test_the_reward_is_the_resources_servers_verify(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    task = next(iter(_taskset(WEATHER, address, "weather")))
    toolset = GymGrpcToolset(vf.SharedToolsetConfig())
    trace = _trace(task)
    await task.setup(trace, None)
    assert [t.name for t in await _tools(toolset, trace)] == ["get_weather"]

    output = await _play_weather(trace, toolset, "Paris")
    assert json.loads(output) == forecast("Paris")  # the tool's output reaches the model

    await task.score(trace)
    assert trace.rewards["gym_grpc"].score == 1.0 and trace.reward == 1.0
    assert trace.metrics["right_city"] == 1.0 and trace.metrics["tool_calls"] == 1.0


async def test_a_wrong_answer_scores_what_the_verifier_says(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    task = next(iter(_taskset(WEATHER, address, "weather")))
    toolset = GymGrpcToolset(vf.SharedToolsetConfig())
    trace = _trace(task)
    await task.setup(trace, None)
    await _play_weather(trace, toolset, "Paris", answer="No idea.")
    await task.score(trace)
    assert trace.reward == 0.0 and trace.metrics["right_city"] == 1.0 and trace.metrics["reported_temperature"] == 0.0


async def test_a_stateful_environments_session_is_verified_then_closed(start, registry):
    cart = await start(ShoppingCartEnv())
    address = registry("cart", cart)
    tasks = list(_taskset(CART, address, "cart"))
    task = tasks[0]
    toolset = GymGrpcToolset(vf.SharedToolsetConfig())
    trace = _trace(task)
    await task.setup(trace, None)
    assert len(cart.app.sessions) == 1
    result = await _tool(toolset, trace, "no_such_tool", {})
    assert result.is_error and "unknown tool" in result.content[0].text  # the model's mistake, for it to read
    _add(trace, vf.AssistantMessage(content="Nothing done."))
    await task.score(trace)
    assert trace.rewards["gym_grpc"] is not None
    assert len(cart.app.sessions) == 0


class BrokenVerifier(ShoppingCartEnv):
    async def verify(self, session: Session, response):
        raise RuntimeError("the grader's database is down")


async def test_a_verifier_that_raises_fails_scoring_with_its_error_and_closes_the_session(start, registry):
    broken = await start(BrokenVerifier())
    address = registry("cart", broken)
    task = next(iter(_taskset(CART, address, "cart")))
    trace = _trace(task)
    await task.setup(trace, None)
    _add(trace, vf.AssistantMessage(content="Done."))
    with pytest.raises(vf.TaskError, match="the grader's database is down"):
        await task.score(trace)
    assert trace.rewards["gym_grpc"] is None  # seeded unscored: verifiers records it did not run
    assert len(broken.app.sessions) == 0


async def test_an_unknown_server_fails_setup_naming_it(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    task = next(iter(_taskset(WEATHER, address, "wether")))
    with pytest.raises(Exception, match="wether"):
        await task.setup(_trace(task), None)
