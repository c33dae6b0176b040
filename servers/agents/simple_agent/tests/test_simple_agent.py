"""The simple agent's multi-turn loop, against a scripted model and a real environment."""

import asyncio
import time

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.data import rows
from gym_grpc.resources import ResourcesServer, tool
from gym_grpc.responses import assistant_message, final_text, new_id
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import GymServer
from gym_grpc.testing import AgentConformance, Calculator, ScriptedModel, call, say, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2


async def _rollout(start, model, *, max_steps=10, the_task=None):
    m = await start(model)
    env = await start(Calculator())
    agent = SimpleAgent(
        {"model_server": "model", "resources_server": "calc", "max_steps": max_steps},
        name="agent",
        registry=static_registry(model=m, calc=env),
    )
    a = await start(agent)
    client = AgentClient(static_registry(agent=a), "agent")
    try:
        return await client.run(the_task or task("What is (2 + 3) + 4?", expected_answer=9), timeout=30)
    finally:
        await client.registry.close()


def _kinds(rollout):
    return [i.WhichOneof("item") for i in rollout.response.output]


async def test_multi_turn_tool_rollout(start):
    model = ScriptedModel(
        [
            [call("add", '{"a": 2, "b": 3}')],
            [call("add", '{"a": 5, "b": 4}')],
            say("The answer is 9."),
        ]
    )
    rollout = await _rollout(start, model)
    assert _kinds(rollout) == ["function_call", "function_call_output"] * 2 + ["message"]
    outputs = [i.function_call_output.output for i in rollout.response.output if i.HasField("function_call_output")]
    assert outputs == ["5", "9"]
    assert rollout.reward == 1.0
    assert rows.json_field(rollout, "verifier_fields")["tool_calls_seen"] == 2  # session state lived across the calls
    assert rollout.stop_reason == task_pb2.STOP_REASON_FINAL_MESSAGE
    assert rollout.model_calls == 3
    assert rollout.response.usage.total_tokens == 45  # summed over the three calls
    # Each turn the model saw everything so far: the task, its calls, the tools' outputs.
    seen = [len(p.input_items.items) for p in model.requests]
    assert seen == [1, 3, 5]
    last_input = model.requests[2].input_items.items
    assert last_input[-1].function_call_output.call_id == last_input[-2].function_call.call_id


async def test_a_tool_that_raises_goes_back_to_the_model(start):
    model = ScriptedModel([[call("explode", "{}")], say("Sorry, the calculator failed.")])
    rollout = await _rollout(start, model)
    output = rollout.response.output[1].function_call_output.output
    assert output.startswith("Error:") and "the calculator caught fire" in output
    assert rollout.stop_reason == task_pb2.STOP_REASON_FINAL_MESSAGE
    assert model.requests[1].input_items.items[-1].function_call_output.output == output


async def test_a_non_json_argument_goes_back_to_the_model(start):
    model = ScriptedModel([[call("add", "{'a': 2, 'b': 3")], [call("add", '{"a": 2, "b": 3}')], say("5")])
    rollout = await _rollout(start, model, the_task=task("2 + 3?", expected_answer=5))
    first = rollout.response.output[1].function_call_output.output
    assert first.startswith("Error:") and "not valid JSON" in first
    assert rollout.response.output[3].function_call_output.output == "5"
    assert rollout.reward == 1.0


async def test_an_unknown_tool_goes_back_to_the_model(start):
    model = ScriptedModel([[call("multiply", '{"a": 2, "b": 3}')], say("I cannot multiply.")])
    rollout = await _rollout(start, model)
    assert "unknown tool 'multiply'" in rollout.response.output[1].function_call_output.output
    assert rollout.reward == 0.0


async def test_max_steps_ends_a_model_that_never_stops_calling_tools(start):
    model = ScriptedModel([[call("add", '{"a": 1, "b": 1}')]])
    rollout = await _rollout(start, model, max_steps=3)
    assert rollout.model_calls == 3 and len(model.requests) == 3
    assert rollout.stop_reason == task_pb2.STOP_REASON_MAX_STEPS
    assert _kinds(rollout) == ["function_call", "function_call_output"] * 3


async def test_incomplete_output_ends_the_rollout(start):
    def cut_short(params):
        return r.Response(
            status=r.RESPONSE_STATUS_INCOMPLETE,
            incomplete_details=r.IncompleteDetails(reason=r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS),
            output=[assistant_message("The answer is", r.ITEM_STATUS_INCOMPLETE)],
        )

    model = ScriptedModel([cut_short, say("never reached")])
    rollout = await _rollout(start, model)
    assert rollout.stop_reason == task_pb2.STOP_REASON_INCOMPLETE
    assert rollout.response.status == r.RESPONSE_STATUS_INCOMPLETE
    assert rollout.response.incomplete_details.reason == r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
    assert len(model.requests) == 1


async def test_token_ids_sent_by_the_model_come_back_on_the_next_turn(start):
    first = call("add", '{"a": 2, "b": 3}')
    first.function_call.prompt_token_ids.extend([1, 2, 3])
    first.function_call.generation_token_ids.extend([40, 41, 42])
    first.function_call.generation_log_probs.extend([-0.5, -0.25, 0.0])
    model = ScriptedModel([[first], say("5")])
    rollout = await _rollout(start, model)
    echoed = model.requests[1].input_items.items[1].function_call
    assert list(echoed.generation_token_ids) == [40, 41, 42]
    assert list(echoed.generation_log_probs) == [-0.5, -0.25, 0.0]
    assert list(rollout.response.output[0].function_call.prompt_token_ids) == [1, 2, 3]


async def test_a_model_server_that_is_down_fails_the_rollout_quickly(start):
    env = await start(Calculator())
    dead = Registry(static={"model": "127.0.0.1:1", "calc": env.address})
    agent = await start(SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="agent", registry=dead))
    # Resumed twice (docs/durable-rollouts.md), each attempt failing as fast as the first.
    client = AgentClient(static_registry(agent=agent), "agent", resume_attempts=2)
    began = time.monotonic()
    with pytest.raises(errors.Unavailable) as error:
        await client.run(task("1 + 1?"), timeout=20)
    assert "model server 'model'" in error.value.message
    assert time.monotonic() - began < 20
    assert env.app.sessions == {}  # the session was closed although the rollout failed
    assert env.app.counters.methods["ResumeSession"].by_status["OK"] == 2  # one session, taken over twice
    await client.registry.close()


async def test_the_callers_deadline_reaches_the_model_server(start):
    cancelled = asyncio.Event()
    seen_timeouts = []

    class Slow(ScriptedModel):
        async def create_response(self, params, session_id):
            seen_timeouts.append(transport.timeout_for(None))  # what is left of this call's deadline
            try:
                await asyncio.sleep(600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

    m = await start(Slow([]))
    env = await start(Calculator())
    registry = static_registry(model=m, calc=env)
    agent = await start(
        SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="agent", registry=registry)
    )
    async with transport.open_channel(agent.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            # 10 s: on a loaded machine the rollout takes seconds to reach the model at all
            await agent_grpc.AgentServiceStub(channel).Run(agent_pb.RunRequest(task=task("1 + 1?")), timeout=10.0)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Not the 600 s default. gRPC's C core rounds a timeout up when it writes the grpc-timeout
    # header (10.0 s reaches a server as 10.099 s), so each hop may add up to about 1%.
    assert seen_timeouts and seen_timeouts[0] is not None and seen_timeouts[0] < 11.0
    # The model's work was cancelled, not left running for its 600 s (the bound only guards a hang).
    await asyncio.wait_for(cancelled.wait(), 120)
    # The agent closes the session after the caller gave up, within its close time-out (5 s);
    # waited for well past it: on a loaded machine the close itself can take seconds.
    deadline = time.monotonic() + 30
    while env.app.sessions and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert env.app.sessions == {}


async def _timeout_the_model_sees(start, rollout_timeout: float, **config) -> float:
    """What is left of the model call's deadline as the model server sees it, in a rollout asked with
    `rollout_timeout` of an agent with `config`."""
    seen = []

    class Recording(ScriptedModel):
        async def create_response(self, params, session_id):
            seen.append(transport.timeout_for(None))
            return await super().create_response(params, session_id)

    model = await start(Recording([say("2")]))
    env = await start(Calculator())
    registry = static_registry(model=model, calc=env)
    config = {"model_server": "model", "resources_server": "calc", **config}
    agent = await start(SimpleAgent(config, name="agent", registry=registry))
    client = AgentClient(static_registry(agent=agent), "agent")
    await client.run(task("1 + 1?", expected_answer=2), timeout=rollout_timeout)
    await client.registry.close()
    (left,) = seen
    assert left is not None
    return left


async def test_a_model_call_may_take_what_is_left_of_a_long_rollouts_deadline(start):
    """Not the clients' 600 s default: a rollout of an hour against a slow engine may wait on it for the
    hour (each model call of a collect against a CPU vLLM failed at 600 s while the rollouts had 3,600)."""
    assert 3000 < await _timeout_the_model_sees(start, 3600)


async def test_an_agents_model_call_timeout_caps_each_model_call(start):
    assert await _timeout_the_model_sees(start, 3600, model_call_timeout_seconds=30) < 31


def test_a_rollout_has_an_id_and_text_helpers_find_the_answer():
    response = r.Response(id=new_id("resp"), output=[*say("first"), *say("final")])
    assert response.id.startswith("resp_") and final_text(response) == "final"


async def test_run_stream_reports_each_step_then_the_rollout(start):
    model = ScriptedModel([[call("add", '{"a": 2, "b": 3}')], [call("explode", "{}")], say("The answer is 9.")])
    m = await start(model)
    env = await start(Calculator())
    registry = static_registry(model=m, calc=env)
    agent = await start(SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="a", registry=registry))
    async with transport.open_channel(agent.address) as channel:
        stream = agent_grpc.AgentServiceStub(channel).RunStream(
            agent_pb.RunStreamRequest(task=task("(2 + 3) + 4?", expected_answer=9)), timeout=30
        )
        events = [event async for event in stream]
    kinds = [e.WhichOneof("event") for e in events]
    assert kinds == ["model_call", "tool_call", "model_call", "tool_call", "model_call", "verification", "rollout"]
    assert [e.sequence for e in events] == list(range(7))
    assert [e.model_call.step for e in events if e.HasField("model_call")] == [0, 1, 2]
    assert events[1].tool_call.output.output == "5" and not events[1].tool_call.error
    assert events[3].tool_call.error and "caught fire" in events[3].tool_call.output.output
    rollout = events[-1].rollout
    assert rollout.reward == events[5].verification.reward == 1.0
    assert len(rollout.response.output) == 5
    timings = rollout.timings
    assert timings.total_seconds >= timings.model_seconds + timings.tools_seconds + timings.verify_seconds > 0
    assert events[-1].elapsed_seconds >= events[0].elapsed_seconds


async def test_run_stream_of_a_failing_rollout_ends_with_its_status(start):
    env = await start(Calculator())
    dead = Registry(static={"model": "127.0.0.1:1", "calc": env.address})
    agent = await start(SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="a", registry=dead))
    async with transport.open_channel(agent.address) as channel:
        stream = agent_grpc.AgentServiceStub(channel).RunStream(agent_pb.RunStreamRequest(task=task("1?")), timeout=20)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            [event async for event in stream]
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "model server 'model'" in error.value.details()


class StatelessCalculator(ResourcesServer):
    @tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    async def verify(self, session, response) -> float:
        return float("5" in final_text(response))


async def test_a_stateless_environment_gets_no_seed_or_close(start, monkeypatch):
    calls = []
    for method in ("seed_session", "close_session"):
        original = getattr(ResourcesClient, method)

        async def counted(self, *args, _original=original, _name=method, **kwargs):
            calls.append(_name)
            return await _original(self, *args, **kwargs)

        monkeypatch.setattr(ResourcesClient, method, counted)
    assert StatelessCalculator.stateless and not Calculator.stateless

    def turn(params):  # call the tool, then answer from its output
        last = params.input_items.items[-1]
        output = say("5") if last.HasField("function_call_output") else [call("add", '{"a": 2, "b": 3}')]
        return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=output)

    m, env = await start(ScriptedModel([turn])), await start(StatelessCalculator())
    registry = static_registry(model=m, calc=env)
    agent = await start(SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="a", registry=registry))
    client = AgentClient(static_registry(agent=agent), "agent")
    for _ in range(3):
        rollout = await client.run(task("2 + 3?"), timeout=30)
        assert rollout.reward == 1.0 and rollout.response.output[1].function_call_output.output == "5"
    assert calls == []
    await client.registry.close()


class TestSimpleAgentConformance(AgentConformance):
    task_row = {"responses_create_params": {"input": "What is the weather in Oslo?"}, "expected_city": "Oslo"}

    def dependencies(self) -> dict[str, GymServer]:
        return {"policy_model": LocalPolicyModel({"seed": 1}), "weather": WeatherEnv()}

    def agent(self, registry: Registry) -> SimpleAgent:
        return SimpleAgent({"model_server": "policy_model", "resources_server": "weather"}, registry=registry)
