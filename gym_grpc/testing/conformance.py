"""The conformance suites as pytest classes: subclass one in a test module.

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

Each test serves the server on 127.0.0.1:0 and runs one check of
`gym_grpc.testing.checks` against it over real gRPC: health and reflection,
the handshake, tool descriptions, the session cycle, verification, the status
codes of bad input, and the cap on open sessions. `gym-grpc conformance
HOST:PORT` runs the same checks against a server that is already running.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import pytest_asyncio

from gym_grpc.agent import AgentServer
from gym_grpc.data import jsonl, rows
from gym_grpc.resources import ResourcesServer
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import GymServer, Running
from gym_grpc.testing import checks
from gym_grpc.testing.checks import Check, CheckSkipped, Probe
from gym_grpc.testing.servers import Servers


def example_rows(path: Path, server: type[ResourcesServer]) -> list[dict[str, Any]]:
    """The rows of an environment's example file, each checked to be a task that offers
    exactly the server's tools (`tool_definitions()`; a row may add `strict` to each)."""
    found = [jsonl.parse_line(line) for line in path.read_bytes().split(b"\n") if line.strip()]
    assert found, f"{path} has no rows"
    for number, row in enumerate(found, 1):
        rows.task_from_row(row)
        offered = [{k: v for k, v in t.items() if k != "strict"} for t in row[rows.PARAMS_KEY].get("tools", [])]
        assert offered == server.tool_definitions(), f"{path}:{number}: the tools are not {server.__name__}'s"
    return found


async def _check(check: Check, probe: Probe) -> None:
    try:
        await check(probe)
    except CheckSkipped as e:
        pytest.skip(str(e))


class ResourcesConformance:
    """Conformance tests of a resources server. Set `task_row`; implement `server()`;
    optionally set `answer` (text of a final assistant message to verify)."""

    pytestmark = pytest.mark.asyncio
    task_row: ClassVar[dict[str, Any]]
    answer: ClassVar[str] = checks.DEFAULT_ANSWER

    def server(self) -> ResourcesServer:
        raise NotImplementedError("return the resources server to test")

    @pytest_asyncio.fixture
    async def served(self) -> AsyncIterator[tuple[Running, Probe]]:
        async with Servers() as servers:
            running = await servers.start(self.server())
            async with transport.open_channel(running.address) as channel:
                yield running, Probe(channel, self.task_row, self.answer)

    async def test_it_serves_health_and_reflection(self, served: Any) -> None:
        await _check(checks.resources_health_and_reflection, served[1])

    async def test_it_answers_the_handshake(self, served: Any) -> None:
        await _check(checks.resources_handshake, served[1])

    async def test_its_tools_are_described_with_object_schemas(self, served: Any) -> None:
        await _check(checks.its_tools_are_described_with_object_schemas, served[1])

    async def test_a_session_seeds_verifies_and_closes(self, served: Any) -> None:
        await _check(checks.a_session_seeds_verifies_and_closes, served[1])

    async def test_an_unknown_tool_is_not_found(self, served: Any) -> None:
        await _check(checks.an_unknown_tool_is_not_found, served[1])

    async def test_arguments_that_are_not_json_are_invalid(self, served: Any) -> None:
        running, probe = served
        if running.app.tool_schemas():  # @tool methods, or tools it describes otherwise (MCP, verifiers)
            await _check(checks.arguments_that_are_not_json_are_invalid, probe)

    async def test_a_stateful_server_refuses_a_closed_or_unknown_session(self, served: Any) -> None:
        running, probe = served
        described = await probe.resources.DescribeTools(checks.res_pb.DescribeToolsRequest(), timeout=10)
        assert described.stateless == running.app.stateless
        if not described.stateless and running.app.tool_schemas():  # a stateless one serves any id
            await _check(checks.a_stateful_server_refuses_a_closed_or_unknown_session, probe)

    async def test_seeding_past_the_session_cap_is_resource_exhausted(self) -> None:
        app = self.server()
        app.config = type(app.config).model_validate({**app.config.model_dump(), "max_sessions": 1})
        async with Servers() as servers:
            running = await servers.start(app)
            async with transport.open_channel(running.address) as channel:
                # Not _check: with the cap at 1 there is always something to check, so a skip is an error.
                await checks.seeding_past_the_session_cap_is_resource_exhausted(Probe(channel, self.task_row))

    async def test_bad_requests_get_invalid_argument(self, served: Any) -> None:
        await _check(checks.bad_requests_get_invalid_argument, served[1])

    async def test_metrics_aggregate_its_own_verdicts(self, served: Any) -> None:
        await _check(checks.metrics_aggregate_its_own_verdicts, served[1])

    async def test_verify_returns_only_the_declared_verifier_fields(self, served: Any) -> None:
        """What `verifier_fields` declares (and `gym-grpc envs` shows) is what verify records."""
        running, probe = served
        declared = type(running.app).verifier_fields
        if not declared:
            pytest.skip(f"{type(running.app).__name__} declares no verifier_fields")
        verdict = await checks.verified(probe, "fields")
        undeclared = sorted(set(rows.json_field(verdict, "fields")) - set(declared))
        assert not undeclared, f"verify returned fields its class does not declare in verifier_fields: {undeclared}"


class AgentConformance:
    """Conformance tests of an agent. Set `task_row`; implement `dependencies()` and `agent(registry)`."""

    pytestmark = pytest.mark.asyncio
    task_row: ClassVar[dict[str, Any]]

    def dependencies(self) -> dict[str, GymServer]:
        return {}

    def agent(self, registry: Registry) -> AgentServer:
        raise NotImplementedError("return the agent to test, built with `registry`")

    @pytest_asyncio.fixture
    async def served(self) -> AsyncIterator[Probe]:
        dependencies = self.dependencies()
        async with Servers() as servers:
            running = [await servers.start(server) for server in dependencies.values()]
            registry = Registry(static={name: r.address for name, r in zip(dependencies, running, strict=True)})
            try:
                agent = await servers.start(self.agent(registry))
                async with transport.open_channel(agent.address) as channel:
                    yield Probe(channel, self.task_row)
            finally:
                await servers.stop()
                await registry.close()

    async def test_it_serves_health_and_reflection(self, served: Probe) -> None:
        await _check(checks.agent_health_and_reflection, served)

    async def test_it_answers_the_handshake(self, served: Probe) -> None:
        await _check(checks.agent_handshake, served)

    async def test_a_run_returns_a_verified_rollout(self, served: Probe) -> None:
        await _check(checks.a_run_returns_a_verified_rollout, served)

    async def test_run_stream_ends_with_the_rollout(self, served: Probe) -> None:
        await _check(checks.run_stream_ends_with_the_rollout, served)

    async def test_run_many_answers_each_run_under_its_id(self, served: Probe) -> None:
        await _check(checks.run_many_answers_each_run_under_its_id, served)

    async def test_a_task_without_input_is_invalid(self, served: Probe) -> None:
        await _check(checks.a_task_without_input_is_invalid, served)
