"""gym-grpc environments served to OpenEnv clients (gym_grpc.adapters.openenv_server): OpenEnv 0.10's own
client code, in OpenEnv's own interpreter (tests/openenv_support.py), plays the bundled weather and math
environments and gets the rewards their verifiers give the same conversation."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest

from gym_grpc import errors
from gym_grpc.adapters import openenv_server
from gym_grpc.adapters.openenv_server import OpenEnvFront
from gym_grpc.bundled.servers.resources.math.server import MathEnv
from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv, forecast
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.resources import Session
from gym_grpc.responses import assistant_message
from gym_grpc.testing import call, static_registry
from gym_grpc.v1 import responses_pb2 as r
from tests.support import QUICKSTART, REPO, read_rows, start_run

WEATHER_ROWS = read_rows(REPO / "servers" / "resources" / "weather" / "data" / "example.jsonl")
MATH_ROWS = read_rows(REPO / "servers" / "resources" / "math" / "data" / "example.jsonl")

#: OpenEnv's GenericEnvClient, used synchronously as its docs show: a weather episode answered right,
#: one answered wrong, the state, and what a malformed action gets.
GENERIC_CLIENT = """
import json, sys
from openenv.core import GenericEnvClient

city, right, wrong = sys.argv[2], sys.argv[3], sys.argv[4]
out = {}
with GenericEnvClient(base_url=sys.argv[1]).sync() as env:
    first = env.reset(task_index=0)
    out["reset"] = {"observation": first.observation, "reward": first.reward, "done": first.done}
    looked = env.step({"tool_name": "get_weather", "arguments": {"city": city}})
    out["tool"] = {"observation": looked.observation, "reward": looked.reward, "done": looked.done}
    out["state"] = env.state()
    end = env.step({"answer": right})
    out["right"] = {"observation": end.observation, "reward": end.reward, "done": end.done}
    env.reset(task_index=0)
    env.step({"tool_name": "get_weather", "arguments": {"city": city}})
    out["wrong"] = env.step({"answer": wrong}).reward
    try:
        env.step({"move": "north"})
    except RuntimeError as e:
        out["malformed"] = str(e)
print(json.dumps(out))
"""

#: A typed client as an environment's own package writes one (OpenEnv's `openenv init` template's shape,
#: as TRL's examples use them): an Action and Observation model and an EnvClient subclass, used with
#: asyncio. Plays math rows by seed, answering each with argv's answers.
TYPED_CLIENT = """
import asyncio, json, sys
from typing import Any, Dict, Optional
from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import Action, Observation, State


class GymAction(Action):
    tool_name: Optional[str] = None
    arguments: Dict[str, Any] = {}
    answer: Optional[str] = None


class GymObservation(Observation):
    prompt: Any = None
    answer: Optional[str] = None
    fields: Dict[str, Any] = {}


class GymEnv(EnvClient[GymAction, GymObservation, State]):
    def _step_payload(self, action: GymAction) -> Dict:
        return {"answer": action.answer}

    def _parse_result(self, payload: Dict) -> StepResult[GymObservation]:
        observation = payload.get("observation", {})
        parsed = GymObservation(
            prompt=observation.get("prompt"),
            answer=observation.get("answer"),
            fields=observation.get("fields") or {},
            done=payload.get("done", False),
            reward=payload.get("reward"),
        )
        return StepResult(observation=parsed, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload: Dict) -> State:
        return State(episode_id=payload.get("episode_id"), step_count=payload.get("step_count", 0))


async def main() -> None:
    played = []
    async with GymEnv(base_url=sys.argv[1]) as env:
        for seed, answer in enumerate(json.loads(sys.argv[2])):
            first = await env.reset(seed=seed)
            end = await env.step(GymAction(answer=answer))
            played.append({"prompt": first.observation.prompt, "reward": end.reward, "done": end.done,
                           "fields": end.observation.fields})
    print(json.dumps(played))


asyncio.run(main())
"""


@pytest.fixture
async def front(start):
    """An OpenEnv server in front of a resources server of this process, for the given rows."""
    made: list[tuple[OpenEnvFront, ResourcesClient]] = []

    async def make(app, task_rows):
        running = await start(app)
        client = ResourcesClient(static_registry(env=running), "env")
        served = OpenEnvFront(client, task_rows)
        await served.start()
        made.append((served, client))
        return served, running.app

    yield make
    for served, client in made:
        await served.stop()
        await client.registry.close()


async def _openenv(openenv, script: str, *args: str) -> dict | list:
    done = await asyncio.to_thread(openenv.run, script, *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


async def _direct(app, row: dict, output: list[r.Item]):
    """What the environment's own verifier gives a response, called directly (no session, no OpenEnv)."""
    return await app.verify(Session("direct", rows.task_from_row(row)), r.Response(output=output))


async def _weather_reward(app: WeatherEnv, city: str, answer: str) -> float:
    """What the weather env's own verifier gives the conversation the OpenEnv client had."""
    get = call("get_weather", json.dumps({"city": city}))
    output = r.Item(
        function_call_output=r.FunctionCallOutput(call_id=get.function_call.call_id, output=json.dumps(forecast(city)))
    )
    return (await _direct(app, WEATHER_ROWS[0], [get, output, assistant_message(answer)])).reward


async def test_openenvs_own_client_plays_weather_and_gets_the_reward_its_verifier_gives(front, openenv):
    served, app = await front(WeatherEnv(name="env"), WEATHER_ROWS)
    city = WEATHER_ROWS[0]["expected_city"]
    degrees = forecast(city)["temperature_c"]
    right, wrong = f"It is {degrees} C in {city}.", f"It is {degrees + 7} C in {city}."
    got = await _openenv(openenv, GENERIC_CLIENT, served.url, city, right, wrong)
    reset = got["reset"]
    assert reset["observation"]["prompt"] == WEATHER_ROWS[0]["responses_create_params"]["input"]
    assert [t["name"] for t in reset["observation"]["tools"]] == ["get_weather"] and not reset["done"]
    assert json.loads(got["tool"]["observation"]["output"]) == forecast(city)
    assert got["tool"]["observation"]["error"] is False and got["tool"]["reward"] is None
    assert got["state"]["step_count"] == 1 and got["state"]["task_index"] == 0
    assert got["right"]["done"] and got["right"]["reward"] == await _weather_reward(app, city, right) == 1.0
    assert got["right"]["observation"]["fields"] == {"tool_calls": 1, "right_city": True, "reported_temperature": True}
    assert got["wrong"] == await _weather_reward(app, city, wrong) == 0.0
    assert "VALIDATION_ERROR" in got["malformed"] and "unknown action field(s) 'move'" in got["malformed"]
    await asyncio.wait_for(served.drained(), 30)  # the client has gone: its connection's end is being served
    assert app.sessions == {}  # each episode's session closed: at its answer, and the last at the close


async def test_a_typed_envclient_plays_math_by_seed_with_asyncio_and_gets_each_verdict(front, openenv):
    served, app = await front(MathEnv(name="env"), MATH_ROWS)
    answers = [f"\\boxed{{{MATH_ROWS[0]['expected_answer']}}}", "\\boxed{54}"]
    played = await _openenv(openenv, TYPED_CLIENT, served.url, json.dumps(answers))
    assert [p["prompt"] for p in played] == [row["responses_create_params"]["input"] for row in MATH_ROWS[:2]]
    assert [p["reward"] for p in played] == [1.0, 0.0] and all(p["done"] for p in played)
    direct = [await _direct(app, row, [assistant_message(a)]) for row, a in zip(MATH_ROWS, answers, strict=False)]
    assert [p["reward"] for p in played] == [d.reward for d in direct]
    assert [p["fields"] for p in played] == [d.fields for d in direct]


async def _frames(url: str, *messages: dict) -> list[dict]:
    async with aiohttp.ClientSession() as http, http.ws_connect(url.replace("http://", "ws://") + "/ws") as ws:
        answers = []
        for message in messages:
            await ws.send_json(message)
            answers.append(await ws.receive_json(timeout=30))
        return answers


async def test_what_the_protocol_refuses_comes_back_as_openenvs_error_frames(front):
    served, app = await front(WeatherEnv(name="env"), WEATHER_ROWS)
    before, bad_index, first, unknown_tool, both, over_the_end = await _frames(
        served.url,
        {"type": "step", "data": {"answer": "x"}},
        {"type": "reset", "data": {"task_index": len(WEATHER_ROWS)}},
        {"type": "reset", "data": {"seed": len(WEATHER_ROWS) + 1}},
        {"type": "step", "data": {"tool_name": "get_forecast", "arguments": {}}},
        {"type": "step", "data": {"tool_name": "get_weather", "answer": "x"}},
        {"type": "bogus"},
    )
    assert before["data"] == {"message": "step before reset: reset first", "code": "VALIDATION_ERROR"}
    assert (
        bad_index["type"] == "error"
        and "task_index 5 is out of range (there are 5 tasks)" in bad_index["data"]["message"]
    )
    assert first["data"]["observation"]["task_index"] == 1  # the seed modulo the rows
    assert (
        unknown_tool["data"]["observation"]["error"] and "get_forecast" in unknown_tool["data"]["observation"]["output"]
    )
    assert both["data"]["code"] == "VALIDATION_ERROR"
    assert over_the_end["data"] == {"message": "Unknown message type: bogus", "code": "UNKNOWN_TYPE"}
    await asyncio.wait_for(served.drained(), 30)
    assert app.sessions == {}


async def test_the_schema_health_and_metadata_answer_as_openenvs_do(front):
    served, _ = await front(WeatherEnv(name="env"), WEATHER_ROWS)
    async with aiohttp.ClientSession() as http:
        async with http.get(served.url + "/health") as health:
            assert await health.json() == {"status": "healthy"}
        async with http.get(served.url + "/schema") as schema:
            assert set(await schema.json()) == {"action", "observation", "state"}
        async with http.get(served.url + "/metadata") as metadata:
            assert (await metadata.json())["name"] == "env"


def test_the_tasks_file_is_read_a_row_a_line_even_with_unicode_line_separators_inside_a_string(tmp_path):
    """U+2028 and U+0085 end a line for str.splitlines, not for JSONL: a row holding one raw (as
    orjson writes it) is one row, and a bad line is named by its number."""
    tasks = tmp_path / "tasks.jsonl"
    prompts = ["north\u2028south", "next\x85line"]
    tasks.write_bytes(b"".join(json.dumps({"prompt": p}, ensure_ascii=False).encode() + b"\n\n" for p in prompts))
    assert [row["prompt"] for row in openenv_server.read_rows(tasks)] == prompts
    tasks.write_bytes(tasks.read_bytes() + b"[1]\n")
    with pytest.raises(errors.ConfigError, match=r"tasks.jsonl line 5: not a JSON object"):
        openenv_server.read_rows(tasks)
    tasks.write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(errors.ConfigError, match=r"tasks.jsonl line 1: not UTF-8"):
        openenv_server.read_rows(tasks)


@pytest.mark.slow
def test_the_module_serves_a_resources_server_of_a_gym_grpc_run_to_openenvs_client(openenv, tmp_path):
    with start_run(configs=(QUICKSTART,)) as run:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gym_grpc.adapters.openenv_server",
                "--registry",
                run.registry,
                "--resources",
                "math",
                "--tasks",
                str(REPO / "servers" / "resources" / "math" / "data" / "example.jsonl"),
                "--port",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            line = server.stdout.readline()
            assert "running on http://127.0.0.1:" in line, server.stderr.read() if server.poll() is not None else line
            url = line.split("running on ")[1].split()[0]
            answer = f"\\boxed{{{MATH_ROWS[0]['expected_answer']}}}"
            done = openenv.run(TYPED_CLIENT, url, json.dumps([answer]))
            assert done.returncode == 0, done.stderr
            [played] = json.loads(done.stdout.strip().splitlines()[-1])
            assert played["reward"] == 1.0 and played["done"]
        finally:
            server.terminate()
            server.wait(10)
