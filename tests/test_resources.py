"""Writing an environment: typed tools, sessions, verify, and the errors a caller sees."""

import asyncio

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import json_input, rows
from gym_grpc.resources import ResourcesServer, Session, Verification, tool
from gym_grpc.responses import assistant_message, final_text
from gym_grpc.rpc.transport import open_channel
from gym_grpc.testing import ResourcesConformance
from gym_grpc.testing.checks import DEFAULT_ANSWER, Probe
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from tests.support import Calculator, eventually, static_registry, task


@pytest.fixture
async def calc(start):
    server = await start(Calculator())
    client = ResourcesClient(static_registry(calc=server), "calc")
    await client.seed_session("s1", task("What is 2 + 3?", expected_answer=5))
    yield client, server
    await client.registry.close()


async def _raw_call(server, name, arguments, session_id="s1"):
    async with open_channel(server.address) as channel:
        stub = res_grpc.ResourcesServiceStub(channel)
        return await stub.CallTool(res_pb.CallToolRequest(session_id=session_id, name=name, arguments=arguments))


async def test_tool_schemas_come_from_the_signatures(calc):
    client, _ = calc
    described = await client.describe_tools()
    assert not described.stateless  # Calculator keeps a count in its sessions
    tools = {t.name: t for t in described.tools}
    assert set(tools) == {"add", "explode"}
    assert tools["add"].description == "Add two integers."
    schema = rows.tool_parameters(tools["add"])
    assert schema == {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }


async def test_a_tool_call_runs_with_the_session_state(calc):
    client, _ = calc
    result = await client.call_tool("s1", r.FunctionCall(name="add", arguments='{"a": 2, "b": 3}'))
    assert result == type(result)(output="5", error=False)
    verdict = await client.verify("s1", task("", expected_answer=5), r.Response(output=[assistant_message("5")]))
    assert verdict.reward == 1.0
    assert rows.json_field(verdict, "fields") == {"tool_calls_seen": 1}


@pytest.mark.parametrize(
    "name, arguments, code, field, message",
    [
        ("subtract", "{}", grpc.StatusCode.NOT_FOUND, "name", "unknown tool 'subtract' (tools: add, explode)"),
        ("add", "{a: 2", grpc.StatusCode.INVALID_ARGUMENT, "arguments", "arguments are not valid JSON"),
        ("add", "[2, 3]", grpc.StatusCode.INVALID_ARGUMENT, "arguments", "must be a JSON object, got list"),
        ("add", '{"a": "two", "b": 3}', grpc.StatusCode.INVALID_ARGUMENT, "arguments", "argument 'a'"),
        ("add", '{"a": 2}', grpc.StatusCode.INVALID_ARGUMENT, "arguments", "argument 'b': Field required"),
        ("add", '{"a": 2, "b": 3, "c": 4}', grpc.StatusCode.INVALID_ARGUMENT, "arguments", "argument 'c'"),
    ],
)
async def test_a_bad_tool_call_gets_a_status_naming_what_is_wrong(calc, name, arguments, code, field, message):
    _, server = calc
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _raw_call(server, name, arguments)
    assert error.value.code() == code
    assert message in error.value.details()
    assert errors.field_of(error.value) == field


async def test_a_tool_that_raises_answers_ok_with_its_error_as_the_output_for_the_model(calc):
    _, server = calc
    reply = await _raw_call(server, "explode", "{}")
    assert reply.is_error
    assert reply.output == "tool 'explode' raised ValueError: the calculator caught fire"


async def test_arguments_nested_too_deep_are_the_callers_mistake_not_an_internal_error(calc):
    _, server = calc
    with pytest.raises(grpc.aio.AioRpcError) as error:  # Python's JSON parser would overflow on it
        await _raw_call(server, "add", '{"a": ' + "[" * 100_000 + "]" * 100_000 + ', "b": 1}')
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"tool 'add': arguments are nested deeper than {json_input.MAX_DEPTH} levels" in error.value.details()
    assert errors.field_of(error.value) == "arguments"


async def test_tool_errors_come_back_to_the_client_as_tool_output(calc):
    client, _ = calc
    result = await client.call_tool("s1", r.FunctionCall(name="add", arguments="not json"))
    assert result.error and "not valid JSON" in result.output
    assert result.reason == "TOOL_ARGUMENTS_INVALID"
    result = await client.call_tool("s1", r.FunctionCall(name="explode", arguments="{}"))
    assert result.error and "the calculator caught fire" in result.output
    assert result.reason == "TOOL_FAILED"


async def test_a_call_in_an_unknown_session_is_failed_precondition(calc):
    _, server = calc
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await _raw_call(server, "add", '{"a": 1, "b": 2}', session_id="nobody")
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "SeedSession first" in error.value.details()


async def test_closing_a_session_frees_it(calc):
    client, server = calc
    await client.close_session("s1")
    await client.close_session("s1")  # closing twice is fine
    with pytest.raises(errors.FailedPrecondition):
        await client.call_tool("s1", r.FunctionCall(name="add", arguments='{"a": 1, "b": 2}'))


class Leaky(Calculator):
    closed: list[str] = []

    async def close_session(self, session: Session) -> None:
        Leaky.closed.append(session.id)


async def test_a_session_nobody_uses_is_closed_after_the_idle_timeout(start):
    Leaky.closed = []
    server = await start(Leaky({"session_idle_timeout_seconds": 0.5}))
    client = ResourcesClient(static_registry(env=server), "env")
    await client.seed_session("abandoned", task("x"))
    await client.seed_session("busy", task("x"))

    async def keep_busy() -> None:  # a call every 20 ms keeps "busy" far inside its 0.5 s
        while True:
            await client.call_tool("busy", r.FunctionCall(name="add", arguments='{"a": 1, "b": 2}'))
            await asyncio.sleep(0.02)

    caller = asyncio.create_task(keep_busy())
    await eventually(lambda: Leaky.closed, "the idle session swept")
    caller.cancel()
    assert Leaky.closed == ["abandoned"]
    assert set(server.app.sessions) == {"busy"}
    with pytest.raises(errors.FailedPrecondition, match="idle sessions are closed"):
        await client.call_tool("abandoned", r.FunctionCall(name="add", arguments='{"a": 1, "b": 2}'))
    await client.registry.close()


class Slow(Leaky):
    @tool
    async def wait(self, seconds: float, session: Session) -> str:
        """Take a while, then say whether the session was closed meanwhile."""
        await asyncio.sleep(seconds)
        return f"closed: {Leaky.closed}" if Leaky.closed or session.id not in self.sessions else "done"


async def test_the_idle_timeout_never_closes_a_session_under_a_running_call(start):
    Leaky.closed = []
    server = await start(Slow({"session_idle_timeout_seconds": 0.1}))
    client = ResourcesClient(static_registry(env=server), "env")
    await client.seed_session("slow", task("x"))
    # Open at the call's end, four idle timeouts after it began. (Asked then, by the tool: from the
    # call's end on, the session is idle, and a loaded machine may take 0.1 s to bring the answer here.)
    result = await client.call_tool("slow", r.FunctionCall(name="wait", arguments='{"seconds": 0.4}'))
    assert result.output == "done"
    await eventually(lambda: Leaky.closed, "the idle session swept")  # idle now: it goes
    assert Leaky.closed == ["slow"]
    await client.registry.close()


async def test_seeding_past_max_sessions_is_resource_exhausted_until_one_closes(start):
    server = await start(Calculator({"max_sessions": 2}))
    client = ResourcesClient(static_registry(calc=server), "calc")
    await client.seed_session("a", task("x"))
    await client.seed_session("b", task("x"))
    with pytest.raises(errors.ResourceExhausted) as error:
        await client.seed_session("c", task("x"))
    assert error.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "2 sessions are open" in error.value.message and "max_sessions: 2" in error.value.message
    assert set(server.app.sessions) == {"a", "b"}  # the refused one holds nothing
    await client.close_session("a")
    await client.seed_session("c", task("x"))
    await client.registry.close()


async def test_sessions_the_idle_timeout_closed_make_room_under_the_cap(start):
    Leaky.closed = []
    server = await start(Leaky({"max_sessions": 1, "session_idle_timeout_seconds": 0.2}))
    client = ResourcesClient(static_registry(env=server), "env")
    await client.seed_session("abandoned", task("x"))
    with pytest.raises(errors.ResourceExhausted):
        await client.seed_session("next", task("x"))
    await eventually(lambda: Leaky.closed == ["abandoned"], "the abandoned session swept")
    await client.seed_session("next", task("x"))
    await client.registry.close()


async def test_stopping_the_server_closes_the_open_sessions(start):
    Leaky.closed = []
    server = await start(Leaky())
    client = ResourcesClient(static_registry(env=server), "env")
    await client.seed_session("left-open", task("x"))
    await client.registry.close()
    await server.stop(grace=0.1)
    assert Leaky.closed == ["left-open"]


class FailsToClose(Leaky):
    async def close_session(self, session: Session) -> None:
        Leaky.closed.append(session.id)
        raise RuntimeError("the cart service is down")


async def test_stopping_closes_every_session_even_when_a_close_fails(start):
    Leaky.closed = []
    server = await start(FailsToClose())
    client = ResourcesClient(static_registry(env=server), "env")
    for session_id in ("first", "second"):
        await client.seed_session(session_id, task("x"))
    await client.registry.close()
    await server.stop(grace=0.1)  # does not raise
    assert Leaky.closed == ["first", "second"] and server.app.sessions == {}


class SlowToSeed(Leaky):
    seeded: list[str] = []

    async def seed_session(self, session: Session) -> None:
        await asyncio.sleep(0.05)
        SlowToSeed.seeded.append(session.id)


async def test_two_seeds_of_one_session_id_at_once_seed_it_once(start):
    SlowToSeed.seeded = []
    server = await start(SlowToSeed())
    client = ResourcesClient(static_registry(env=server), "env")
    results = await asyncio.gather(*(client.seed_session("same", task("x")) for _ in range(2)), return_exceptions=True)
    assert sum(r is None for r in results) == 1
    [refused] = [r for r in results if r is not None]
    assert isinstance(refused, errors.FailedPrecondition) and "already open" in refused.message
    assert SlowToSeed.seeded == ["same"]
    await client.registry.close()


class FailsToSeed(ResourcesServer):
    async def seed_session(self, session: Session) -> None:
        raise KeyError("initial_cart")


async def test_a_seed_that_fails_leaves_no_session_behind(start):
    server = await start(FailsToSeed())
    client = ResourcesClient(static_registry(env=server), "env")
    with pytest.raises(errors.GymError, match="seed_session raised KeyError"):
        await client.seed_session("s", task("x"))
    assert server.app.sessions == {}
    await client.registry.close()


class Graded(ResourcesServer):
    async def verify(self, session: Session, response: r.Response) -> Verification:
        return Verification(reward=0.5, components={"format": 1.0, "correct": 0.0})


class NotANumber(ResourcesServer):
    async def verify(self, session: Session, response: r.Response) -> Verification:
        return Verification(reward=1.0, components={"format": "yes"})  # type: ignore[dict-item]


async def test_a_verifier_may_return_named_reward_components(start):
    server = await start(Graded())
    client = ResourcesClient(static_registry(env=server), "env")
    verdict = await client.verify("s", task("x"), r.Response(output=[assistant_message("hi")]))
    assert verdict.reward == 0.5 and dict(verdict.reward_components) == {"format": 1.0, "correct": 0.0}
    await client.registry.close()


async def test_a_reward_component_that_is_not_a_number_is_the_verifiers_fault(start):
    server = await start(NotANumber())
    client = ResourcesClient(static_registry(env=server), "env")
    with pytest.raises(errors.GymError, match="reward component 'format'"):
        await client.verify("s", task("x"), r.Response(output=[assistant_message("hi")]))
    await client.registry.close()


class TestCalculatorConformance(ResourcesConformance):
    task_row = {"responses_create_params": {"input": "What is 2 + 3?"}, "expected_answer": 5}

    def server(self) -> ResourcesServer:
        return Calculator()


class _MisdeclaredCalculator(Calculator):
    verifier_fields = {"sum_seen": "a field this verify never returns"}  # it returns tool_calls_seen


async def test_the_conformance_kit_fails_a_server_whose_verify_returns_a_field_it_does_not_declare(start):
    running = await start(_MisdeclaredCalculator())
    async with open_channel(running.address) as channel:
        served = (running, Probe(channel, TestCalculatorConformance.task_row, DEFAULT_ANSWER))
        with pytest.raises(AssertionError, match=r"does not declare in verifier_fields: \['tool_calls_seen'\]"):
            await TestCalculatorConformance().test_verify_returns_only_the_declared_verifier_fields(served)


async def test_verify_needs_no_session(calc):
    client, _ = calc
    verdict = await client.verify(
        "never-seeded", task("", expected_answer=7), r.Response(output=[assistant_message("7")])
    )
    assert verdict.reward == 1.0


class Broken(ResourcesServer):
    async def verify(self, session: Session, response: r.Response) -> float:
        raise KeyError("expected_answer")


class BadReward(ResourcesServer):
    async def verify(self, session: Session, response: r.Response) -> float:
        return float("nan")


@pytest.mark.parametrize("env, message", [(Broken, "verify raised KeyError"), (BadReward, "reward nan")])
async def test_a_failing_verifier_is_internal_with_its_reason(start, env, message):
    server = await start(env())
    client = ResourcesClient(static_registry(env=server), "env")
    with pytest.raises(errors.GymError) as error:
        await client.verify("s", task("x"), r.Response())
    assert error.value.code == grpc.StatusCode.INTERNAL
    assert message in error.value.message
    await client.registry.close()


async def test_aggregate_metrics_default_to_means(calc):
    client, _ = calc
    results = []
    for i, (reward, correct) in enumerate([(1.0, True), (0.0, False), (1.0, True), (1.0, False)]):
        result = task_pb2.VerificationResult(task_index=i // 2, reward=reward)
        rows.set_json_field(result, "fields", {"correct": correct, "label": "x"})
        result.reward_components["format"] = 1.0 if i < 2 else 0.0
        results.append(result)
    metrics = rows.struct_to_dict(await client.aggregate_metrics(results))
    assert metrics == {"num_rollouts": 4, "reward": 0.75, "correct": 0.5, "reward_components.format": 0.5}


def test_a_tool_must_be_async():
    with pytest.raises(TypeError, match="must be an async def"):

        class Sync(ResourcesServer):
            @tool
            def blocking(self) -> str:
                return "no"


class Lifecycle(ResourcesServer):
    """Tools named like the base class's own methods: stop, verify, start, seed_session."""

    stopped = 0

    @tool
    async def stop(self, reason: str) -> str:
        """Stop the simulated machine."""
        return f"machine stopped: {reason}"

    @tool(name="verify")
    async def verify_tool(self, claim: str) -> str:
        """Check a claim."""
        return f"checked {claim}"

    @tool
    async def seed_session(self, seed: int) -> str:
        """Seed the random generator."""
        return f"seeded {seed}"

    @tool
    async def start(self) -> str:
        """Start the simulated machine."""
        return "machine started"

    async def verify(self, session: Session, response: r.Response) -> float:
        return 1.0 if "done" in final_text(response) else 0.0

    async def close_session(self, session: Session) -> None:
        Lifecycle.stopped += 1


async def test_tools_named_like_lifecycle_methods_do_not_replace_them(start):
    assert set(Lifecycle.tools) == {"stop", "verify", "seed_session", "start"}
    assert Lifecycle.stop is ResourcesServer.stop and Lifecycle.start is ResourcesServer.start
    assert Lifecycle.seed_session is ResourcesServer.seed_session
    Lifecycle.stopped = 0
    server = await start(Lifecycle(name="machine"))
    client = ResourcesClient(static_registry(machine=server), "machine")
    try:
        await client.seed_session("s1", task("x"))
        outputs = {}
        for name, arguments in [
            ("stop", '{"reason": "overheating"}'),
            ("verify", '{"claim": "2 + 2 = 4"}'),
            ("seed_session", '{"seed": 7}'),
            ("start", "{}"),
        ]:
            result = await client.call_tool("s1", r.FunctionCall(name=name, arguments=arguments))
            assert not result.error, result
            outputs[name] = result.output
        assert outputs == {
            "stop": "machine stopped: overheating",
            "verify": "checked 2 + 2 = 4",
            "seed_session": "seeded 7",
            "start": "machine started",
        }
        verdict = await client.verify("s1", task("x"), r.Response(output=[assistant_message("done")]))
        assert verdict.reward == 1.0  # the environment's verify, not the tool
    finally:
        await client.registry.close()
    await server.stop()  # the base class's stop: it closes the open session and returns
    assert Lifecycle.stopped == 1
