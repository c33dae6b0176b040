"""The conformance checks, over the wire only: what any resources server or agent must do.

Each check is an async function of a `Probe` (a channel to the server, the
task row to use, the answer to verify) that raises `CheckFailed` naming what
went wrong, or `CheckSkipped` when the server gives it nothing to check. The
pytest classes of `gym_grpc.testing` run them against a server they start;
`run_checks` (and `gym-grpc conformance HOST:PORT`) against any address, so a
server written in another language is held to the same checks. Nothing here
needs pytest.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gym_grpc import errors
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.rpc import protocol, transport
from gym_grpc.rpc.security import Security
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

RESOURCES_SERVICE = res_pb.DESCRIPTOR.services_by_name["ResourcesService"].full_name
AGENT_SERVICE = agent_pb.DESCRIPTOR.services_by_name["AgentService"].full_name
HEALTH_SERVICE = "grpc.health.v1.Health"

#: The session cap the session-cap check fills to reach it; a larger cap is skipped.
MAX_SESSIONS_TO_FILL = 64

#: The answer a check verifies when none is given.
DEFAULT_ANSWER = "I do not know."


class CheckFailed(AssertionError):
    """A conformance check found the server at fault; the message says how."""


class CheckSkipped(Exception):
    """A check that has nothing to check on this server (the reason is the message)."""


def expect(condition: Any, message: str) -> None:
    """Fail the check with `message` unless `condition` holds (an assert that -O keeps)."""
    if not condition:
        raise CheckFailed(message)


@dataclass
class Probe:
    """What the checks talk to: a channel to the server, and the task and answer they use."""

    channel: grpc.aio.Channel
    task_row: dict[str, Any]
    answer: str = DEFAULT_ANSWER

    @property
    def task(self) -> task_pb2.Task:
        return rows.task_from_row(self.task_row)

    @property
    def resources(self) -> res_grpc.ResourcesServiceStub:
        return res_grpc.ResourcesServiceStub(self.channel)

    @property
    def agent(self) -> agent_grpc.AgentServiceStub:
        return agent_grpc.AgentServiceStub(self.channel)

    async def info(self) -> admin_pb.GetServerInfoResponse:
        return await admin_grpc.AdminServiceStub(self.channel).GetServerInfo(
            admin_pb.GetServerInfoRequest(), timeout=10
        )


async def _fails_with(
    call: Awaitable[Any], code: grpc.StatusCode, what: str, field_name: str | None = None
) -> grpc.aio.AioRpcError:
    """Await `call`, which must fail with `code` (and name `field_name` in its BadRequest detail)."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        expect(
            error.code() == code, f"{what}: answered {error.code().name} ({error.details()!r}), expected {code.name}"
        )
        if field_name is not None:
            named = errors.field_of(error)
            expect(
                named == field_name,
                f"{what}: {code.name} names field {named!r} in its google.rpc.BadRequest detail, "
                f"expected {field_name!r}",
            )
        return error
    raise CheckFailed(f"{what}: answered OK, expected {code.name}")


async def services(channel: grpc.aio.Channel) -> set[str]:
    """The services the server lists through reflection."""
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    names: set[str] = set()
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    async for reply in stub.ServerReflectionInfo(iter([request]), timeout=10):
        names |= {s.name for s in reply.list_services_response.service}
    return names


async def serving(channel: grpc.aio.Channel) -> bool:
    reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# --- both roles ----------------------------------------------------------------------


def _health_and_reflection(service: str) -> Callable[[Probe], Awaitable[None]]:
    async def it_serves_health_and_reflection(probe: Probe) -> None:
        expect(await serving(probe.channel), "grpc.health.v1.Health/Check does not answer SERVING")
        listed = await services(probe.channel)
        missing = {service, HEALTH_SERVICE} - listed
        expect(not missing, f"reflection does not list {sorted(missing)} (it lists {sorted(listed)})")

    return it_serves_health_and_reflection


def _handshake(role: reg.ServerRole.ValueType) -> Callable[[Probe], Awaitable[None]]:
    async def it_answers_the_handshake(probe: Probe) -> None:
        info = await probe.info()
        expect(
            info.role == role,
            f"GetServerInfo says role {reg.ServerRole.Name(info.role)}, expected {reg.ServerRole.Name(role)}",
        )
        major = info.protocol.major or 1
        expect(
            major == protocol.VERSION[0],
            f"GetServerInfo says gym protocol {major}.{info.protocol.minor}, expected {protocol.VERSION[0]}.x",
        )

    return it_answers_the_handshake


# --- resources servers --------------------------------------------------------------


async def its_tools_are_described_with_object_schemas(probe: Probe) -> None:
    reply = await probe.resources.DescribeTools(res_pb.DescribeToolsRequest(), timeout=10)
    names = [tool.name for tool in reply.tools]
    expect(len(names) == len(set(names)), f"DescribeTools: tool names repeat: {names}")
    for tool in reply.tools:
        expect(tool.name and tool.description, f"DescribeTools: tool {tool.name!r} needs a name and a description")
        schema = rows.tool_parameters(tool) or {}
        expect(
            schema.get("type") == "object", f"DescribeTools: tool {tool.name!r}: parameters must be an object schema"
        )


async def verified(probe: Probe, session_id: str) -> res_pb.VerifyResponse:
    """The verdict on the probe's answer in a session of its own: seeded, verified, closed."""
    stub, task = probe.resources, probe.task
    await stub.SeedSession(res_pb.SeedSessionRequest(session_id=session_id, task=task), timeout=10)
    response = r.Response(output=[assistant_message(probe.answer)])
    verdict = await stub.Verify(res_pb.VerifyRequest(session_id=session_id, task=task, response=response), timeout=60)
    await stub.CloseSession(res_pb.CloseSessionRequest(session_id=session_id), timeout=10)
    return verdict


async def a_session_seeds_verifies_and_closes(probe: Probe) -> None:
    session_id = "conformance"
    verdict = await verified(probe, session_id)
    expect(math.isfinite(verdict.reward), f"Verify: reward {verdict.reward} is not a finite number")
    bad = {k: v for k, v in verdict.reward_components.items() if not math.isfinite(v)}
    expect(not bad, f"Verify: reward components {bad} are not finite numbers")
    await probe.resources.CloseSession(res_pb.CloseSessionRequest(session_id=session_id), timeout=10)  # twice is OK


async def an_unknown_tool_is_not_found(probe: Probe) -> None:
    stub = probe.resources
    await stub.SeedSession(res_pb.SeedSessionRequest(session_id="unknown-tool", task=probe.task), timeout=10)
    request = res_pb.CallToolRequest(session_id="unknown-tool", name="no_such_tool_here", arguments="{}")
    await _fails_with(
        stub.CallTool(request, timeout=10), grpc.StatusCode.NOT_FOUND, "CallTool of an unknown tool", "name"
    )
    await stub.CloseSession(res_pb.CloseSessionRequest(session_id="unknown-tool"), timeout=10)


async def arguments_that_are_not_json_are_invalid(probe: Probe) -> None:
    stub = probe.resources
    described = await stub.DescribeTools(res_pb.DescribeToolsRequest(), timeout=10)
    if not described.tools:
        raise CheckSkipped("the server has no tools")
    await stub.SeedSession(res_pb.SeedSessionRequest(session_id="not-json", task=probe.task), timeout=10)
    for tool in described.tools:
        request = res_pb.CallToolRequest(session_id="not-json", name=tool.name, arguments="{oops")
        what = f"CallTool {tool.name!r} with arguments that are not JSON"
        await _fails_with(stub.CallTool(request, timeout=10), grpc.StatusCode.INVALID_ARGUMENT, what, "arguments")
    await stub.CloseSession(res_pb.CloseSessionRequest(session_id="not-json"), timeout=10)


async def a_stateful_server_refuses_a_closed_or_unknown_session(probe: Probe) -> None:
    stub = probe.resources
    described = await stub.DescribeTools(res_pb.DescribeToolsRequest(), timeout=10)
    if described.stateless:
        raise CheckSkipped("the server says it is stateless: it serves any session id, by design")
    if not described.tools:
        raise CheckSkipped("the server has no tools")
    name = described.tools[0].name
    await stub.SeedSession(res_pb.SeedSessionRequest(session_id="closing", task=probe.task), timeout=10)
    await stub.CloseSession(res_pb.CloseSessionRequest(session_id="closing"), timeout=10)
    for session_id, what in (("closing", "a closed session"), ("never-seeded", "a session never seeded")):
        request = res_pb.CallToolRequest(session_id=session_id, name=name, arguments="{}")
        await _fails_with(
            stub.CallTool(request, timeout=10),
            grpc.StatusCode.FAILED_PRECONDITION,
            f"CallTool {name!r} in {what}",
            "session_id",
        )


async def seeding_past_the_session_cap_is_resource_exhausted(probe: Probe) -> None:
    cap = (await probe.info()).capabilities.max_sessions
    if not cap:
        raise CheckSkipped("the server reports no session cap (capabilities.max_sessions 0)")
    if cap > MAX_SESSIONS_TO_FILL:
        raise CheckSkipped(
            f"the server's session cap {cap} is more than the {MAX_SESSIONS_TO_FILL} sessions this check opens; "
            "serve it with a small max_sessions to check it"
        )
    stub, task = probe.resources, probe.task
    opened = [f"cap-{n}" for n in range(cap)]
    try:
        for session_id in opened:
            await stub.SeedSession(res_pb.SeedSessionRequest(session_id=session_id, task=task), timeout=10)
        one_more = res_pb.SeedSessionRequest(session_id="cap-one-more", task=task)
        what = f"SeedSession with {cap} sessions open, the cap it reports"
        error = await _fails_with(stub.SeedSession(one_more, timeout=10), grpc.StatusCode.RESOURCE_EXHAUSTED, what)
        expect("max_sessions" in (error.details() or ""), f"{what}: the message does not name max_sessions")
        await stub.CloseSession(res_pb.CloseSessionRequest(session_id=opened.pop()), timeout=10)
        await stub.SeedSession(one_more, timeout=10)  # closing one made room
        opened.append("cap-one-more")
    finally:
        for session_id in opened:
            await stub.CloseSession(res_pb.CloseSessionRequest(session_id=session_id), timeout=10)


async def bad_requests_get_invalid_argument(probe: Probe) -> None:
    stub = probe.resources
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    await _fails_with(stub.SeedSession(res_pb.SeedSessionRequest(), timeout=10), invalid, "SeedSession with no task")
    empty_item = res_pb.VerifyRequest(response=r.Response(output=[r.Item()]))
    await _fails_with(stub.Verify(empty_item, timeout=10), invalid, "Verify of a response with an empty item")
    corrupt = probe.channel.unary_unary(f"/{RESOURCES_SERVICE}/Verify")
    await _fails_with(corrupt(b"\xff\xff\xff", timeout=10), invalid, "Verify of bytes that are not a message")
    expect(await serving(probe.channel), "after the bad requests the server no longer answers SERVING")


async def metrics_aggregate_its_own_verdicts(probe: Probe) -> None:
    stub, task = probe.resources, probe.task
    response = r.Response(output=[assistant_message(probe.answer)])
    verdict = await stub.Verify(res_pb.VerifyRequest(session_id="metrics", task=task, response=response), timeout=60)
    result = task_pb2.VerificationResult(
        reward=verdict.reward, fields_json=verdict.fields_json, reward_components=verdict.reward_components
    )
    await stub.AggregateMetrics(res_pb.AggregateMetricsRequest(results=[result, result]), timeout=10)


# --- agents -------------------------------------------------------------------------


async def a_run_returns_a_verified_rollout(probe: Probe) -> None:
    reply = await probe.agent.Run(agent_pb.RunRequest(task=probe.task), timeout=120)
    rollout = reply.rollout
    expect(rollout.response.output, "Run: the rollout has no output")
    expect(math.isfinite(rollout.reward), f"Run: reward {rollout.reward} is not a finite number")
    expect(rollout.model_calls >= 1, "Run: the rollout counts no model call")
    expect(rollout.timings.total_seconds > 0, "Run: the rollout's timings.total_seconds is not set")
    rows.response_to_json(rollout.response)  # it dumps as a Responses object


async def run_stream_ends_with_the_rollout(probe: Probe) -> None:
    request = agent_pb.RunStreamRequest(task=probe.task)
    events = [e async for e in probe.agent.RunStream(request, timeout=120)]
    expect(events and events[-1].WhichOneof("event") == "rollout", "RunStream: the last event is not the rollout")
    sequence = [e.sequence for e in events]
    expect(sequence == list(range(len(events))), f"RunStream: event sequence numbers are {sequence}, not 0, 1, ...")


async def run_many_answers_each_run_under_its_id(probe: Probe) -> None:
    """Two runs on one RunMany call, one of them malformed: each result under its id (the
    malformed one failed as Run would fail it), then the call ends OK (protocol 1.5)."""
    info = await probe.info()
    if "RunMany" not in protocol.methods(info, AGENT_SERVICE):
        expect(
            (info.protocol.major or 1, info.protocol.minor) < (1, 5),
            f"RunMany: the agent speaks protocol {info.protocol.major}.{info.protocol.minor} and does not serve it",
        )
        raise CheckSkipped(f"the agent speaks protocol {info.protocol.major}.{info.protocol.minor}, before RunMany")
    runs = [
        agent_pb.RunManyItem(id=7, run=agent_pb.RunRequest(task=probe.task), timeout_seconds=120),
        agent_pb.RunManyItem(id=9, run=agent_pb.RunRequest(), timeout_seconds=120),
    ]
    call = probe.agent.RunMany(iter([agent_pb.RunManyRequest(runs=runs)]), timeout=150)
    results = {result.id: result async for reply in call for result in reply.results}
    code = await call.code()
    expect(code == grpc.StatusCode.OK, f"RunMany: the call ended with {code.name}, not OK")
    expect(sorted(results) == [7, 9], f"RunMany: results for ids {sorted(results)}, expected [7, 9]")
    expect(results[7].WhichOneof("outcome") == "rollout", f"RunMany: run 7 failed: {results[7].error.message!r}")
    expect(results[7].rollout.response.output, "RunMany: the rollout of run 7 has no output")
    error = results[9].error
    expect(
        results[9].WhichOneof("outcome") == "error" and error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0],
        f"RunMany: run 9 (a task with no input) ended with code {error.code}, expected INVALID_ARGUMENT",
    )


async def a_task_without_input_is_invalid(probe: Probe) -> None:
    await _fails_with(
        probe.agent.Run(agent_pb.RunRequest(), timeout=10),
        grpc.StatusCode.INVALID_ARGUMENT,
        "Run of a task with no input",
        "task.responses_create_params.input",
    )


Check = Callable[[Probe], Awaitable[None]]

resources_health_and_reflection = _health_and_reflection(RESOURCES_SERVICE)
resources_handshake = _handshake(reg.SERVER_ROLE_RESOURCES)
agent_health_and_reflection = _health_and_reflection(AGENT_SERVICE)
agent_handshake = _handshake(reg.SERVER_ROLE_AGENT)

RESOURCES_CHECKS: list[Check] = [
    resources_health_and_reflection,
    resources_handshake,
    its_tools_are_described_with_object_schemas,
    a_session_seeds_verifies_and_closes,
    an_unknown_tool_is_not_found,
    arguments_that_are_not_json_are_invalid,
    a_stateful_server_refuses_a_closed_or_unknown_session,
    seeding_past_the_session_cap_is_resource_exhausted,
    bad_requests_get_invalid_argument,
    metrics_aggregate_its_own_verdicts,
]

AGENT_CHECKS: list[Check] = [
    agent_health_and_reflection,
    agent_handshake,
    a_run_returns_a_verified_rollout,
    run_stream_ends_with_the_rollout,
    run_many_answers_each_run_under_its_id,
    a_task_without_input_is_invalid,
]


def name_of(check: Check) -> str:
    """A check's name as reports print it: "an unknown tool is not found"."""
    return check.__name__.replace("_", " ")


# --- against an address --------------------------------------------------------------


@dataclass
class Outcome:
    """One check's result: passed, failed (with why) or skipped (with why)."""

    check: str
    status: str  # "passed", "failed" or "skipped"
    message: str = ""


@dataclass
class Report:
    address: str
    role: str  # "resources" or "agent"
    server: str = ""
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "failed"]


async def run_check(check: Check, probe: Probe) -> Outcome:
    """Run one check; any error the server causes (a status it should not have sent) is its failure."""
    try:
        await check(probe)
    except CheckSkipped as e:
        return Outcome(name_of(check), "skipped", str(e))
    except CheckFailed as e:
        return Outcome(name_of(check), "failed", str(e))
    except grpc.aio.AioRpcError as e:
        return Outcome(name_of(check), "failed", f"a call failed: {e.code().name}: {e.details()}")
    except errors.GymError as e:  # a task row the server answered with something rows cannot read
        return Outcome(name_of(check), "failed", e.message)
    return Outcome(name_of(check), "passed")


async def role_of(channel: grpc.aio.Channel) -> tuple[str, str]:
    """("resources" or "agent", the server's name) from its handshake, or from reflection when it has none."""
    try:
        info = await admin_grpc.AdminServiceStub(channel).GetServerInfo(admin_pb.GetServerInfoRequest(), timeout=10)
    except grpc.aio.AioRpcError as e:
        if e.code() != grpc.StatusCode.UNIMPLEMENTED:
            raise
    else:
        if info.role == reg.SERVER_ROLE_RESOURCES:
            return "resources", info.name
        if info.role == reg.SERVER_ROLE_AGENT:
            return "agent", info.name
        role = reg.ServerRole.Name(info.role)
        raise errors.InvalidArgument(f"the server says it is a {role}: conformance checks are for resources and agents")
    listed = await services(channel)
    if RESOURCES_SERVICE in listed:
        return "resources", ""
    if AGENT_SERVICE in listed:
        return "agent", ""
    raise errors.InvalidArgument(f"the server serves neither {RESOURCES_SERVICE} nor {AGENT_SERVICE}")


async def default_row(channel: grpc.aio.Channel, role: str) -> dict[str, Any]:
    """A task to check with when none is given: one user message, and the resources server's tools."""
    params: dict[str, Any] = {"input": [{"role": "user", "content": "Conformance check: answer in one sentence."}]}
    if role == "resources":
        stub = res_grpc.ResourcesServiceStub(channel)
        try:
            described = await stub.DescribeTools(res_pb.DescribeToolsRequest(), timeout=10)
        except grpc.aio.AioRpcError:
            return {"responses_create_params": params}  # the checks will say what is wrong
        if described.tools:
            offered = r.CreateParams(tools=[r.Tool(function=t) for t in described.tools])
            params["tools"] = rows.params_to_json(offered)["tools"]
    return {"responses_create_params": params}


async def run_checks(
    address: str,
    task_row: dict[str, Any] | None = None,
    *,
    answer: str = DEFAULT_ANSWER,
    role: str | None = None,
    security: Security | None = None,
    on_outcome: Callable[[Outcome], None] | None = None,
) -> Report:
    """Run the conformance checks of the server at `address` (its role from its handshake unless
    given), each to its end; `on_outcome` hears of each as it finishes."""
    async with transport.open_channel(address, security=security) as channel:
        server = ""
        if role is None:
            role, server = await role_of(channel)
        row = task_row if task_row is not None else await default_row(channel, role)
        probe = Probe(channel, row, answer)
        report = Report(address, role, server)
        for check in RESOURCES_CHECKS if role == "resources" else AGENT_CHECKS:
            outcome = await run_check(check, probe)
            report.outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome)
        return report
