"""The tool loop's budget of tokens for a whole trajectory (ToolLoopConfig.max_rollout_tokens): real agent,
model and resources servers on loopback; the model is the embedded local policy, or vllm_model in front of
the fake engine, both reporting usage as an engine does. Each model server here records the
max_output_tokens it was asked for and the usage it answered with."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from gym_grpc import errors
from gym_grpc.agent import ToolLoopAgent
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv
from gym_grpc.client.stubs import AgentClient
from gym_grpc.data import record, rows
from gym_grpc.report import stats, text
from gym_grpc.responses import assistant_message
from gym_grpc.testing import Calculator, ScriptedModel, call, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.testing.fake_engine import Turn
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

WEATHER_ROW = {
    "responses_create_params": {
        "input": [{"role": "user", "content": "What's the weather like in Paris right now?"}],
        "tools": [
            {
                "type": "function",
                "name": "get_weather",
                "description": "Get the current weather in a city.",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "description": "Name of the city."}},
                    "required": ["city"],
                },
            }
        ],
    },
    "expected_city": "Paris",
}


class _Calls:
    """What a model server was asked and answered, per call: (max_output_tokens or None, input, output tokens)."""

    calls: list[tuple[int | None, int, int]]

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        response = await super().create_response(params, session_id)  # type: ignore[misc]
        asked = params.max_output_tokens if params.HasField("max_output_tokens") else None
        self.calls.append((asked, response.usage.input_tokens, response.usage.output_tokens))
        return response


class RecordingPolicy(_Calls, LocalPolicyModel):
    calls: list[tuple[int | None, int, int]]


class RecordingVLLM(_Calls, VLLMModel):
    calls: list[tuple[int | None, int, int]]


def _recording(model):
    model.calls = []
    return model


async def _agent(start, model, env, *, name="agent", **config):
    agent = ToolLoopAgent(
        {"model_server": "model", "resources_server": "env", **config},
        name=name,
        registry=static_registry(model=model, env=env),
    )
    return await start(agent)


async def _collect(agent, path: Path, tasks: Path) -> dict:
    registry = static_registry(agent=agent)
    options = CollectOptions(input=tasks, output=path, agent="agent", max_in_flight=1, progress=False)
    try:
        summary = await collect(registry, options, log=io.StringIO())
    finally:
        await registry.close()
    assert summary.failed == 0
    [row] = rows_of(path)
    return row


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_the_budget_caps_the_last_turn_and_ends_the_rollout_verified_with_its_own_stop_reason(start, tmp_path):
    """Unbudgeted, the policy calls get_weather and then answers (2 calls). With a budget of the first turn's
    tokens + 5, the second call may generate 5 tokens: it is cut there, and the rollout ends `token_budget`,
    verified, its row written by the collector and counted by `report`."""
    policy = _recording(RecordingPolicy({"error_rate": 0.0}, name="model"))
    model, env = await start(policy), await start(WeatherEnv())
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps(WEATHER_ROW) + "\n")

    free = await _collect(await _agent(start, model, env), tmp_path / "free.jsonl", tasks)
    assert free["stop_reason"] == "final_message" and free["model_calls"] == 2
    [(first_asked, _, first_out), (second_asked, _, second_out)] = policy.calls
    assert first_asked is None and second_asked is None and second_out > 5

    policy.calls.clear()
    budget = first_out + 5
    capped = await _collect(
        await _agent(start, model, env, max_rollout_tokens=budget), tmp_path / "capped.jsonl", tasks
    )
    assert [asked for asked, _, _ in policy.calls] == [budget, 5]  # all of it, then what it has left
    assert policy.calls[1][2] == 5
    assert capped["stop_reason"] == "token_budget" and capped["model_calls"] == 2
    assert capped["response"]["status"] == "incomplete"
    assert capped["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert "verification_skipped" not in capped and capped["verifier_fields"]  # verified, as it stands
    assert capped["reward"] == 0.0 and free["reward"] == 1.0
    task_row, _, response = record.parse(capped)  # the row reads back: its task row as given, its response whole
    assert {k: v for k, v in task_row.items() if k != "agent_ref"} == WEATHER_ROW
    assert response.status == r.RESPONSE_STATUS_INCOMPLETE and rows.response_to_json(response) == capped["response"]

    report = stats.read(tmp_path / "capped.jsonl")
    assert report.agents["agent"].metrics(1.0)["stopped.token_budget"] == 1
    assert "stopped: token_budget" in text.render([stats.read(tmp_path / "free.jsonl"), report], 1.0)


async def test_a_turn_cut_by_its_own_max_output_tokens_stays_incomplete(start):
    policy = _recording(RecordingPolicy({"error_rate": 0.0}, name="model"))
    model, env = await start(policy), await start(WeatherEnv())
    agent = await _agent(start, model, env, max_rollout_tokens=1000)
    the_task = rows.task_from_row(WEATHER_ROW)
    the_task.responses_create_params.max_output_tokens = 3
    client = AgentClient(static_registry(agent=agent), "agent")
    try:
        rollout = await client.run(the_task, timeout=30)
    finally:
        await client.registry.close()
    assert rollout.stop_reason == task_pb2.STOP_REASON_INCOMPLETE
    assert [asked for asked, _, _ in policy.calls] == [3]  # the smaller limit is kept


async def _always_adding(start, fake_engine, **config):
    """An agent whose model (vllm_model before the fake engine) writes a long text and calls `add` every turn."""
    turn = Turn(content="Let me add these up. " * 4, tool_calls=[("add", '{"a": 1, "b": 1}')])
    fake = await fake_engine([turn])
    vllm = _recording(RecordingVLLM({"base_url": fake.base_url, "model": "policy"}, name="model"))
    model, env = await start(vllm), await start(Calculator())
    agent = await _agent(start, model, env, max_steps=6, **config)
    return vllm, AgentClient(static_registry(agent=agent), "agent")


async def test_tool_calls_that_would_go_past_the_budget_are_not_run(start, fake_engine):
    """The budget is exactly what two turns use (their generations and the first turn's tool output): the
    second turn is not cut, but its call would only add to a trajectory at its budget, so it is not run."""
    vllm, client = await _always_adding(start, fake_engine)
    try:
        free = await client.run(task("Add forever"), timeout=30)
    finally:
        await client.registry.close()
    assert free.stop_reason == task_pb2.STOP_REASON_MAX_STEPS and free.model_calls == 6
    assert all(asked is None for asked, _, _ in vllm.calls)  # off by default: no limit is sent
    (_, first_in, out), (_, second_in, _) = vllm.calls[:2]
    two_turns = second_in + out - first_in

    vllm, client = await _always_adding(start, fake_engine, max_rollout_tokens=two_turns)
    try:
        rollout = await client.run(task("Add forever"), timeout=30)
    finally:
        await client.registry.close()
    assert [asked for asked, _, _ in vllm.calls] == [two_turns, two_turns - out]
    assert rollout.stop_reason == task_pb2.STOP_REASON_TOKEN_BUDGET and rollout.model_calls == 2
    assert rollout.response.status == r.RESPONSE_STATUS_COMPLETED  # no turn was cut
    assert rows.json_field(rollout, "verifier_fields")["tool_calls_seen"] == 1  # the second turn's add never ran
    kinds = [item.WhichOneof("item") for item in rollout.response.output]
    assert kinds == ["message", "function_call", "function_call_output", "message", "function_call"]


async def test_off_by_default_the_loop_is_unchanged(start):
    """No budget: no max_output_tokens is added to any call, and a rollout ends as it did."""
    policy = _recording(RecordingPolicy({"error_rate": 0.0}, name="model"))
    model, env = await start(policy), await start(WeatherEnv())
    agent = await _agent(start, model, env)
    assert agent.app.config.max_rollout_tokens is None  # type: ignore[attr-defined]
    client = AgentClient(static_registry(agent=agent), "agent")
    try:
        rollout = await client.run(rows.task_from_row(WEATHER_ROW), timeout=30)
    finally:
        await client.registry.close()
    assert rollout.stop_reason == task_pb2.STOP_REASON_FINAL_MESSAGE and rollout.model_calls == 2
    assert [asked for asked, _, _ in policy.calls] == [None, None]


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"max_rollout_tokens": 0}, "config.max_rollout_tokens: Input should be greater than or equal to 1"),
        ({"max_rollout_tokens": -100}, "config.max_rollout_tokens: Input should be greater than or equal to 1"),
        ({"max_rollout_tokens": "lots"}, "config.max_rollout_tokens: Input should be a valid integer"),
        ({"max_rollout_token": 4096}, "config.max_rollout_token: Extra inputs are not permitted (did you mean"),
    ],
)
def test_a_bad_budget_in_the_config_is_a_clear_error(setting, message):
    with pytest.raises(errors.ConfigError) as error:
        ToolLoopAgent({"model_server": "m", "resources_server": "r", **setting}, name="agent")
    assert message in str(error.value)


async def test_a_model_server_without_usage_cannot_be_budgeted(start):
    def no_usage(params):
        return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=[])

    model, env = await start(ScriptedModel([no_usage])), await start(Calculator())
    agent = await _agent(start, model, env, max_rollout_tokens=100)
    client = AgentClient(static_registry(agent=agent), "agent")
    try:
        with pytest.raises(errors.GymError) as error:
            await client.run(task("2 + 3?"), timeout=30)
    finally:
        await client.registry.close()
    assert "max_rollout_tokens: model server 'model' reports no usage" in error.value.message


def _resumed(turns: list[tuple[r.Response, str | None]]) -> task_pb2.RolloutState:
    """A rollout parked after `turns`: each a model response and the output of its get_weather call, if any."""
    state = task_pb2.RolloutState()
    for response, output in turns:
        turn = state.turns.add(response=response)
        if output is not None:
            turn.tool_outputs.add(call_id=response.output[0].function_call.call_id, output=output)
    state.attempts.add(agent="gone", ended="parked")
    return state


async def test_a_resumed_rollout_counts_its_earlier_turns_against_the_budget(start):
    """The weather environment is stateless: a parked rollout resumes on any agent. Its first turn (40 tokens
    generated, as the usage it carried says) leaves 5 of a budget of 45 for the next call, which is cut there;
    a rollout parked just after a turn cut at its cap ends at once, with no model call."""
    first = r.Response(
        status=r.RESPONSE_STATUS_COMPLETED,
        output=[call("get_weather", '{"city": "Paris"}')],
        usage=r.Usage(input_tokens=100, output_tokens=40, total_tokens=140),
    )
    policy = _recording(RecordingPolicy({"error_rate": 0.0}, name="model"))
    model, env = await start(policy), await start(WeatherEnv())
    agent = await _agent(start, model, env, max_rollout_tokens=45)
    client = AgentClient(static_registry(agent=agent), "agent")
    the_task = rows.task_from_row(WEATHER_ROW)
    try:
        rollout = await client.run(the_task, 30, rollout_id="a", resume=_resumed([(first, "Sunny, 21 C")]))
        assert [asked for asked, _, _ in policy.calls] == [5]
        assert rollout.stop_reason == task_pb2.STOP_REASON_TOKEN_BUDGET and rollout.model_calls == 2

        cut = r.Response(
            status=r.RESPONSE_STATUS_INCOMPLETE,
            incomplete_details=r.IncompleteDetails(reason=r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS),
            output=[assistant_message("The weather", r.ITEM_STATUS_INCOMPLETE)],
            usage=r.Usage(input_tokens=160, output_tokens=5, total_tokens=165),
        )
        policy.calls.clear()
        state = _resumed([(first, "Sunny, 21 C"), (cut, None)])
        rollout = await client.run(the_task, 30, rollout_id="b", resume=state)
        assert policy.calls == [] and rollout.stop_reason == task_pb2.STOP_REASON_TOKEN_BUDGET
    finally:
        await client.registry.close()
