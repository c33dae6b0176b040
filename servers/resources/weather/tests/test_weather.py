"""The weather environment: its tool, and what its verifier rewards."""

import json
from pathlib import Path

import pytest

from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv, forecast
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.testing import ResourcesConformance, call, example_rows, static_registry
from gym_grpc.v1 import responses_pb2 as r

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "example.jsonl"


@pytest.fixture
async def weather(start):
    server = await start(WeatherEnv())
    client = ResourcesClient(static_registry(weather=server), "weather")
    yield client
    await client.registry.close()


def _task(city: str):
    return rows.task_from_row({"responses_create_params": {"input": f"Weather in {city}?"}, "expected_city": city})


async def _rollout(client, session: str, city_asked: str, answer: str | None = None) -> r.Response:
    """A response that called get_weather for city_asked and then said `answer`
    (by default, the tool's output read back)."""
    fc = call("get_weather", json.dumps({"city": city_asked}))
    result = await client.call_tool(session, fc.function_call)
    output = r.Item(function_call_output=r.FunctionCallOutput(call_id=fc.function_call.call_id, output=result.output))
    text = answer if answer is not None else f"It is {json.loads(result.output)['temperature_c']} C."
    return r.Response(output=[fc, output, assistant_message(text)])


async def test_the_forecast_is_a_function_of_the_city(weather):
    await weather.seed_session("s", _task("Paris"))
    first = await weather.call_tool("s", r.FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))
    again = await weather.call_tool("s", r.FunctionCall(name="get_weather", arguments='{"city": " paris "}'))
    assert json.loads(first.output)["temperature_c"] == json.loads(again.output)["temperature_c"]
    assert json.loads(first.output) == forecast("Paris")


async def test_reporting_the_right_citys_temperature_earns_the_reward(weather):
    await weather.seed_session("s", _task("Paris"))
    verdict = await weather.verify("s", _task("Paris"), await _rollout(weather, "s", "Paris"))
    assert verdict.reward == 1.0
    assert rows.json_field(verdict, "fields") == {"tool_calls": 1, "right_city": True, "reported_temperature": True}


@pytest.mark.parametrize(
    "asked, answer, fields",
    [
        ("Lyon", None, {"right_city": False, "reported_temperature": False}),
        ("Paris", "I do not know.", {"right_city": True, "reported_temperature": False}),
    ],
)
async def test_the_wrong_city_or_an_unreported_temperature_earns_nothing(weather, asked, answer, fields):
    await weather.seed_session("s", _task("Paris"))
    verdict = await weather.verify("s", _task("Paris"), await _rollout(weather, "s", asked, answer))
    assert verdict.reward == 0.0
    assert {k: v for k, v in rows.json_field(verdict, "fields").items() if k in fields} == fields


async def test_no_tool_call_earns_nothing(weather):
    verdict = await weather.verify("s", _task("Paris"), r.Response(output=[assistant_message("Sunny, 20 C.")]))
    assert verdict.reward == 0.0 and rows.json_field(verdict, "fields")["tool_calls"] == 0


async def test_an_empty_city_is_a_tool_error_for_the_model(weather):
    await weather.seed_session("s", _task("Paris"))
    result = await weather.call_tool("s", r.FunctionCall(name="get_weather", arguments='{"city": " "}'))
    assert result.error and "city must not be empty" in result.output


async def test_a_tool_call_that_failed_earns_nothing_and_does_not_break_the_verifier(weather):
    await weather.seed_session("s", _task("Paris"))
    fc = call("get_weather", json.dumps({"city": "Paris", "unit": "C"}))  # an argument the tool does not take
    result = await weather.call_tool("s", fc.function_call)
    assert result.error
    output = r.Item(function_call_output=r.FunctionCallOutput(call_id=fc.function_call.call_id, output=result.output))
    verdict = await weather.verify(
        "s", _task("Paris"), r.Response(output=[fc, output, assistant_message("It is 12 C.")])
    )
    assert verdict.reward == 0.0
    assert rows.json_field(verdict, "fields") == {"tool_calls": 1, "right_city": False, "reported_temperature": False}


async def test_arguments_too_deep_to_parse_earn_nothing_and_do_not_break_the_verifier(weather):
    fc = call("get_weather", '{"city": ' + "[" * 100_000 + "]" * 100_000 + "}")  # Python's JSON parser overflows
    verdict = await weather.verify("s", _task("Paris"), r.Response(output=[fc, assistant_message("It is 12 C.")]))
    assert verdict.reward == 0.0
    assert rows.json_field(verdict, "fields") == {"tool_calls": 1, "right_city": False, "reported_temperature": False}


def test_the_example_rows_are_tasks_with_the_servers_tools():
    assert len(example_rows(EXAMPLES, WeatherEnv)) == 5


class TestWeatherConformance(ResourcesConformance):
    task_row = {"responses_create_params": {"input": "Weather in Paris?"}, "expected_city": "Paris"}

    def server(self) -> WeatherEnv:
        return WeatherEnv()
