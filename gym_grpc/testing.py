"""A conformance kit: the tests every resources server and agent must pass.

Subclass in a test module (pytest and pytest-asyncio are needed):

    class TestWeatherConformance(ResourcesConformance):
        task_row = {"responses_create_params": {"input": "Weather in Paris?"}, "expected_city": "Paris"}

        def server(self):
            return WeatherEnv(name="weather")

    class TestSimpleAgentConformance(AgentConformance):
        task_row = {...}

        def dependencies(self):                 # served first, reachable by these names
            return {"policy_model": LocalPolicyModel(), "weather": WeatherEnv()}

        def agent(self, registry):
            return SimpleAgent({"model_server": "policy_model", "resources_server": "weather"}, registry=registry)

The tests serve the server on 127.0.0.1:0 and check, over real gRPC: health
and reflection, tool descriptions, the session cycle, verification, the
status codes of bad input, and the cap on open sessions.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gym_grpc import errors
from gym_grpc.agent import AgentServer
from gym_grpc.data import jsonl, rows
from gym_grpc.resources import ResourcesServer
from gym_grpc.responses import assistant_message
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import GymServer, Running, serve
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2


async def _services(channel: grpc.aio.Channel) -> set[str]:
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    names: set[str] = set()
    async for reply in stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
        names |= {s.name for s in reply.list_services_response.service}
    return names


async def _serving(channel: grpc.aio.Channel) -> bool:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def example_rows(path: Path, server: type[ResourcesServer]) -> list[dict[str, Any]]:
    """The rows of an environment's example file, each checked to be a task that offers
    exactly the server's tools (`tool_definitions()`; a row may add `strict` to each)."""
    found = [jsonl.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    assert found, f"{path} has no rows"
    for number, row in enumerate(found, 1):
        rows.task_from_row(row)
        offered = [{k: v for k, v in t.items() if k != "strict"} for t in row[rows.PARAMS_KEY].get("tools", [])]
        assert offered == server.tool_definitions(), f"{path}:{number}: the tools are not {server.__name__}'s"
    return found


class ResourcesConformance:
    """Conformance tests of a resources server. Set `task_row`; implement `server()`;
    optionally set `answer` (text of a final assistant message to verify)."""

    pytestmark = pytest.mark.asyncio
    task_row: ClassVar[dict[str, Any]]
    answer: ClassVar[str] = "I do not know."

    def server(self) -> ResourcesServer:
        raise NotImplementedError("return the resources server to test")

    @pytest_asyncio.fixture
    async def served(self) -> AsyncIterator[tuple[Running, res_grpc.ResourcesServiceStub, grpc.aio.Channel]]:
        running = await serve(self.server(), "127.0.0.1", 0)
        channel = transport.open_channel(running.address)
        try:
            yield running, res_grpc.ResourcesServiceStub(channel), channel
        finally:
            await channel.close()
            await running.stop(grace=0.5)

    def _task(self) -> Any:
        return rows.task_from_row(self.task_row)

    async def test_it_serves_health_and_reflection(self, served: Any) -> None:
        _, _, channel = served
        assert await _serving(channel)
        assert {"gym.v1.ResourcesService", "grpc.health.v1.Health"} <= await _services(channel)

    async def test_its_tools_are_described_with_object_schemas(self, served: Any) -> None:
        _, stub, _ = served
        reply = await stub.DescribeTools(res_pb.DescribeToolsRequest(), timeout=10)
        names = [tool.name for tool in reply.tools]
        assert len(names) == len(set(names)), f"tool names repeat: {names}"
        for tool in reply.tools:
            assert tool.name and tool.description, f"tool {tool.name!r} needs a name and a description"
            schema = rows.tool_parameters(tool) or {}
            assert schema.get("type") == "object", f"tool {tool.name!r}: parameters must be an object schema"

    async def test_a_session_seeds_verifies_and_closes(self, served: Any) -> None:
        _, stub, _ = served
        task = self._task()
        await stub.SeedSession(res_pb.SeedSessionRequest(session_id="conformance", task=task), timeout=10)
        response = r.Response(output=[assistant_message(self.answer)])
        verdict = await stub.Verify(
            res_pb.VerifyRequest(session_id="conformance", task=task, response=response), timeout=60
        )
        assert math.isfinite(verdict.reward)
        assert all(math.isfinite(v) for v in verdict.reward_components.values())
        await stub.CloseSession(res_pb.CloseSessionRequest(session_id="conformance"), timeout=10)
        await stub.CloseSession(res_pb.CloseSessionRequest(session_id="conformance"), timeout=10)

    async def test_an_unknown_tool_is_not_found(self, served: Any) -> None:
        _, stub, _ = served
        await stub.SeedSession(res_pb.SeedSessionRequest(session_id="s", task=self._task()), timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            request = res_pb.CallToolRequest(session_id="s", name="no_such_tool_here", arguments="{}")
            await stub.CallTool(request, timeout=10)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert errors.field_of(error.value) == "name"

    async def test_arguments_that_are_not_json_are_invalid(self, served: Any) -> None:
        running, stub, _ = served
        await stub.SeedSession(res_pb.SeedSessionRequest(session_id="s", task=self._task()), timeout=10)
        for name in running.app.tools:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.CallTool(res_pb.CallToolRequest(session_id="s", name=name, arguments="{oops"), timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, f"tool {name!r}"
            assert errors.field_of(error.value) == "arguments", f"tool {name!r}"

    async def test_a_stateful_server_refuses_a_closed_or_unknown_session(self, served: Any) -> None:
        running, stub, _ = served
        described = await stub.DescribeTools(res_pb.DescribeToolsRequest(), timeout=10)
        assert described.stateless == running.app.stateless
        if described.stateless or not running.app.tools:
            return  # a stateless server serves any session id, by design
        name = next(iter(running.app.tools))
        await stub.SeedSession(res_pb.SeedSessionRequest(session_id="closing", task=self._task()), timeout=10)
        await stub.CloseSession(res_pb.CloseSessionRequest(session_id="closing"), timeout=10)
        for session_id in ("closing", "never-seeded"):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.CallTool(
                    res_pb.CallToolRequest(session_id=session_id, name=name, arguments="{}"), timeout=10
                )
            assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION, session_id
            assert errors.field_of(error.value) == "session_id"

    async def test_seeding_past_the_session_cap_is_resource_exhausted(self) -> None:
        app = self.server()
        app.config = type(app.config).model_validate({**app.config.model_dump(), "max_sessions": 1})
        running = await serve(app, "127.0.0.1", 0)
        try:
            async with transport.open_channel(running.address) as channel:
                stub = res_grpc.ResourcesServiceStub(channel)
                await stub.SeedSession(res_pb.SeedSessionRequest(session_id="first", task=self._task()), timeout=10)
                second = res_pb.SeedSessionRequest(session_id="second", task=self._task())
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await stub.SeedSession(second, timeout=10)
                assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "max_sessions" in (error.value.details() or "")
                await stub.CloseSession(res_pb.CloseSessionRequest(session_id="first"), timeout=10)
                await stub.SeedSession(second, timeout=10)  # closing one made room
        finally:
            await running.stop(grace=0.5)

    async def test_bad_requests_get_invalid_argument(self, served: Any) -> None:
        _, stub, channel = served
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.SeedSession(res_pb.SeedSessionRequest(), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Verify(res_pb.VerifyRequest(response=r.Response(output=[r.Item()])), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        corrupt = channel.unary_unary("/gym.v1.ResourcesService/Verify")
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await corrupt(b"\xff\xff\xff", timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert await _serving(channel)

    async def test_metrics_aggregate_its_own_verdicts(self, served: Any) -> None:
        _, stub, _ = served
        response = r.Response(output=[assistant_message(self.answer)])
        verdict = await stub.Verify(
            res_pb.VerifyRequest(session_id="m", task=self._task(), response=response), timeout=60
        )
        result = task_pb2.VerificationResult(
            reward=verdict.reward, fields_json=verdict.fields_json, reward_components=verdict.reward_components
        )
        await stub.AggregateMetrics(res_pb.AggregateMetricsRequest(results=[result, result]), timeout=10)


class AgentConformance:
    """Conformance tests of an agent. Set `task_row`; implement `dependencies()` and `agent(registry)`."""

    pytestmark = pytest.mark.asyncio
    task_row: ClassVar[dict[str, Any]]

    def dependencies(self) -> dict[str, GymServer]:
        return {}

    def agent(self, registry: Registry) -> AgentServer:
        raise NotImplementedError("return the agent to test, built with `registry`")

    @pytest_asyncio.fixture
    async def served(self) -> AsyncIterator[tuple[agent_grpc.AgentServiceStub, grpc.aio.Channel]]:
        dependencies = self.dependencies()
        running = [await serve(server, "127.0.0.1", 0) for server in dependencies.values()]
        registry = Registry(static={name: r.address for name, r in zip(dependencies, running, strict=True)})
        agent = await serve(self.agent(registry), "127.0.0.1", 0)
        running.append(agent)
        channel = transport.open_channel(agent.address)
        try:
            yield agent_grpc.AgentServiceStub(channel), channel
        finally:
            await channel.close()
            for server in reversed(running):
                await server.stop(grace=0.5)
            await registry.close()

    async def test_it_serves_health_and_reflection(self, served: Any) -> None:
        _, channel = served
        assert await _serving(channel)
        assert "gym.v1.AgentService" in await _services(channel)

    async def test_a_run_returns_a_verified_rollout(self, served: Any) -> None:
        stub, _ = served
        reply = await stub.Run(agent_pb.RunRequest(task=rows.task_from_row(self.task_row)), timeout=120)
        rollout = reply.rollout
        assert rollout.response.output, "the rollout has no output"
        assert math.isfinite(rollout.reward) and rollout.model_calls >= 1
        assert rollout.timings.total_seconds > 0
        rows.response_to_json(rollout.response)  # it dumps as a Responses object

    async def test_run_stream_ends_with_the_rollout(self, served: Any) -> None:
        stub, _ = served
        events = [
            e
            async for e in stub.RunStream(
                agent_pb.RunStreamRequest(task=rows.task_from_row(self.task_row)), timeout=120
            )
        ]
        assert events and events[-1].WhichOneof("event") == "rollout"
        assert [e.sequence for e in events] == list(range(len(events)))

    async def test_a_task_without_input_is_invalid(self, served: Any) -> None:
        stub, _ = served
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.Run(agent_pb.RunRequest(), timeout=10)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert errors.field_of(error.value) == "task.responses_create_params.input"
