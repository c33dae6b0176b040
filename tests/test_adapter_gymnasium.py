"""A gym-grpc environment as a `gymnasium.Env`, with the real gymnasium package and real gym-grpc servers.

The environments are made through Gymnasium's own registry (`gymnasium.make`,
with the wrappers it adds), find their resources server through a real
registry service (as `gym-grpc run` serves it) or by address, and are driven
from a worker thread: the servers live on the test's event loop, which must
stay free to answer. The actions are what a model would write; the
observations are what it would read next.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import re
import warnings
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import gym_grpc.adapters.gymnasium_env as adapter
from gym_grpc.adapters import text_episode
from gym_grpc.bundled.servers.resources.session_state.server import ShoppingCartEnv
from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv, forecast
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.launch.runner import RegistryServer
from gym_grpc.responses import assistant_message
from gym_grpc.testing.servers import static_registry
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r

WEATHER_TASKS = Path(__file__).parent.parent / "servers/resources/weather/data/example.jsonl"
PARIS = {
    "responses_create_params": {"input": [{"role": "user", "content": "What's the weather like in Paris right now?"}]},
    "expected_city": "Paris",
}


def _call(name: str, **arguments: object) -> str:
    return f"Let me look.\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.fixture
async def registry(start):
    """A real registry service; `add(name, running)` lists a started server in it."""
    service = await start(RegistryServer())

    def add(name: str, running) -> str:
        service.app.servicer.add(reg.ServerInfo(name=name, addresses=[running.address]))
        return service.address

    return add


def _make(registry_address: str, server: str, **config: object) -> gymnasium.Env:
    return gymnasium.make(
        "gym_grpc/Env-v0", registry=registry_address, resources_server=server, timeout_seconds=60, **config
    )


def _play(env: gymnasium.Env, actions: list[str], **reset: object) -> list[tuple]:
    """reset, then each action in turn: [(observation, info), (observation, reward, terminated, truncated, info)...]."""
    out: list[tuple] = [env.reset(**reset)]
    out.extend(env.step(action) for action in actions)
    return out


def test_the_env_is_registered_with_gymnasium_and_made_without_calling_its_server():
    assert adapter.ENV_ID in gymnasium.registry
    env = gymnasium.make("gym_grpc/Env-v0", address="127.0.0.1:1", tasks=[PARIS])  # nothing listens there
    assert isinstance(env.unwrapped, adapter.GymGrpcEnv)
    assert isinstance(env.observation_space, gymnasium.spaces.Text)
    assert isinstance(env.action_space, gymnasium.spaces.Text)
    assert "Paris, 21 °C, ça va" in env.observation_space  # the default charset holds more than ASCII
    env.close()


def test_a_mistyped_key_is_an_error_naming_it():
    with pytest.raises(ValueError, match="timeout_second"):
        gymnasium.make("gym_grpc/Env-v0", resources_server="weather", timeout_second=3)
    with pytest.raises(ValueError, match="not both"):
        gymnasium.make("gym_grpc/Env-v0", resources_server="weather", registry="h:1", address="h:2")
    with pytest.raises(ValueError, match="resources_server"):
        gymnasium.make("gym_grpc/Env-v0", tasks=[PARIS])
    with pytest.raises(ValueError, match="nowhere.jsonl"):
        gymnasium.make("gym_grpc/Env-v0", resources_server="weather", tasks="nowhere.jsonl")


async def test_check_env_passes_without_a_warning(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "weather", tasks=str(WEATHER_TASKS))

    def check() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_env(env.unwrapped)
        return [str(w.message) for w in caught]

    assert await asyncio.to_thread(check) == []
    await asyncio.to_thread(env.close)


async def test_a_tool_call_then_the_right_answer_earns_the_reward_the_servers_verify_gives(start, registry):
    weather = await start(WeatherEnv())
    address = registry("weather", weather)
    env = _make(address, "weather")
    temperature = forecast("Paris")["temperature_c"]
    answer = f"It is {temperature} C in Paris."

    (prompt, info), tool, final = await asyncio.to_thread(
        _play, env, [_call("get_weather", city="Paris"), answer], options={"task": PARIS}
    )
    assert prompt.endswith("What's the weather like in Paris right now?")
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt  # the tools, Hermes layout
    assert [m["role"] for m in info["messages"]] == ["system", "user"]
    assert [t["function"]["name"] for t in info["tools"]] == ["get_weather"]

    observation, reward, terminated, truncated, step_info = tool
    assert json.loads(observation) == forecast("Paris")  # the tool's output is the next observation
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert step_info["tool_calls"] == ["get_weather"]
    assert step_info["observations"] == [{"role": "tool", "content": observation}]

    observation, reward, terminated, truncated, step_info = final
    assert (observation, reward, terminated, truncated) == ("", 1.0, True, False)
    assert step_info["verifier_fields"] == {"tool_calls": 1, "right_city": True, "reported_temperature": True}

    # The same trajectory, built by hand and verified through the plain client.
    call = r.FunctionCall(name="get_weather", arguments=json.dumps({"city": "Paris"}), call_id="call_1")
    output = r.FunctionCallOutput(call_id="call_1", output=json.dumps(forecast("Paris")))
    trajectory = r.Response(
        output=[
            assistant_message("Let me look."),
            r.Item(function_call=call),
            r.Item(function_call_output=output),
            assistant_message(answer),
        ]
    )
    client = ResourcesClient(static_registry(weather=weather), "weather")
    verdict = await client.verify("by-hand", rows.task_from_row(PARIS), trajectory)
    assert verdict.reward == reward == 1.0


async def test_several_tool_calls_in_one_turn_come_back_each_in_its_tool_response_tags(start):
    weather = await start(WeatherEnv())
    env = gymnasium.make("gym_grpc/Env-v0", address=weather.address)
    both = _call("get_weather", city="Paris") + "\n" + _call("get_weather", city="Lyon")
    _, (observation, reward, terminated, truncated, info) = await asyncio.to_thread(
        _play, env, [both], options={"task": PARIS}
    )
    blocks = re.findall(r"<tool_response>\n(.*?)\n</tool_response>", observation, re.S)
    assert [json.loads(b) for b in blocks] == [forecast("Paris"), forecast("Lyon")]
    assert info["tool_calls"] == ["get_weather", "get_weather"] and not (terminated or truncated)


async def test_a_wrong_answer_gets_the_verifiers_zero(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "weather")
    *_, final = await asyncio.to_thread(
        _play, env, [_call("get_weather", city="Lyon"), "It is 99 C."], options={"task": PARIS}
    )
    observation, reward, terminated, truncated, info = final
    assert (reward, terminated, truncated) == (0.0, True, False)
    assert info["verifier_fields"]["right_city"] is False


async def test_a_tool_call_at_max_turns_truncates_the_episode(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "weather", max_turns=2)
    call = _call("get_weather", city="Paris")
    _, first, second = await asyncio.to_thread(_play, env, [call, call], options={"task": PARIS})
    assert first[2:4] == (False, False)
    observation, reward, terminated, truncated, info = second
    assert (terminated, truncated) == (False, True)
    assert info["stop_reason"] == "tool_call_at_max_turns" and info["turns"] == 2
    assert reward == 0.0  # verified as it stands: no answer given


async def test_reset_draws_the_task_from_the_seed_and_options_pick_one(start):
    weather = await start(WeatherEnv())
    tasks = [json.loads(line) for line in WEATHER_TASKS.read_text().splitlines()]
    env = gymnasium.make("gym_grpc/Env-v0", address=weather.address, tasks=tasks)

    def prompts() -> dict[str, object]:
        return {
            "seed_7": env.reset(seed=7)[1]["task_index"],
            "seed_7_again": env.reset(seed=7)[1]["task_index"],
            "over_seeds": {env.reset(seed=s)[1]["task_index"] for s in range(40)},
            "index_1": env.reset(options={"task_index": 1})[0],
        }

    seen = await asyncio.to_thread(prompts)
    assert seen["seed_7"] == seen["seed_7_again"]
    assert seen["over_seeds"] == set(range(len(tasks)))
    user = tasks[1]["responses_create_params"]["input"][0]["content"]
    assert isinstance(seen["index_1"], str) and seen["index_1"].endswith(user)
    with pytest.raises(ValueError, match="task_idx"):
        await asyncio.to_thread(env.reset, options={"task_idx": 1})
    with pytest.raises(ValueError, match="task_index 99"):
        await asyncio.to_thread(env.reset, options={"task_index": 99})
    without = gymnasium.make("gym_grpc/Env-v0", address=weather.address)
    with pytest.raises(ValueError, match="no task to play"):
        await asyncio.to_thread(without.reset)


async def test_sessions_are_closed_at_the_end_on_reset_and_on_close(start, registry):
    cart = await start(ShoppingCartEnv())
    address = registry("cart", cart)
    task = {
        "responses_create_params": {"input": [{"role": "user", "content": "Add one litre of whole milk."}]},
        "expected_cart": {"MILK-1L": 1},
        "initial_cart": {},
    }
    env = _make(address, "cart", tasks=[task])
    await asyncio.to_thread(env.reset, seed=0)
    assert len(cart.app.sessions) == 1
    await asyncio.to_thread(env.reset, seed=1)  # the first episode's session closes
    assert len(cart.app.sessions) == 1
    observation, *_ = await asyncio.to_thread(env.step, _call("add_item", sku="MILK-1L", quantity=1))
    assert "MILK-1L" in observation
    _, reward, terminated, _, _ = await asyncio.to_thread(env.step, "Done: the milk is in your cart.")
    assert (reward, terminated) == (1.0, True)  # the cart as the server held it
    assert len(cart.app.sessions) == 0

    await asyncio.to_thread(env.reset, seed=2)
    assert len(cart.app.sessions) == 1
    await asyncio.to_thread(env.close)
    assert len(cart.app.sessions) == 0
    await asyncio.to_thread(env.close)  # twice is fine


async def test_a_server_that_stops_mid_episode_ends_it_with_the_error_in_info(start):
    weather = await start(WeatherEnv())
    env = gymnasium.make("gym_grpc/Env-v0", address=weather.address, timeout_seconds=5)
    await asyncio.to_thread(env.reset, options={"task": PARIS})
    await weather.stop(grace=0)
    observation, reward, terminated, truncated, info = await asyncio.to_thread(
        env.step, _call("get_weather", city="Paris")
    )
    assert (observation, reward, terminated, truncated) == ("", 0.0, False, True)
    assert info["error"]["code"] in {"UNAVAILABLE", "DEADLINE_EXCEEDED"}
    assert info["error"]["resources_server"] == "resources"
    again = await asyncio.to_thread(env.step, "hello?")
    assert again[3] is True and again[4]["error"] == info["error"]


async def test_a_server_that_is_not_there_at_reset_ends_the_episode_at_its_first_step(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "wether")
    observation, info = await asyncio.to_thread(env.reset, options={"task": PARIS})
    assert observation == "What's the weather like in Paris right now?"  # the prompt, without tools
    assert "wether" in info["error"]["message"] and "weather" in info["error"]["message"]
    _, reward, terminated, truncated, step_info = await asyncio.to_thread(env.step, "It is 20 C.")
    assert (reward, terminated, truncated) == (0.0, False, True)
    assert step_info["error"] == info["error"]


async def test_a_row_that_does_not_load_ends_the_episode_with_the_field_at_fault(start):
    weather = await start(WeatherEnv())
    env = gymnasium.make("gym_grpc/Env-v0", address=weather.address)
    bad = {"responses_create_params": {"input": "Paris?", "temperature": "hot"}}
    observation, info = await asyncio.to_thread(env.reset, options={"task": bad})
    assert observation == "" and "temperature" in info["error"]["message"]


def _policy(observation: str, task: dict) -> str:
    """What a model that knows the task would write: call the tool for the task's city, then
    report the temperature it read."""
    if observation.startswith("{"):
        return f"It is {json.loads(observation)['temperature_c']} C."
    return _call("get_weather", city=task["expected_city"])


async def test_gymnasiums_episode_statistics_wrapper_records_the_rewards(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    tasks = [json.loads(line) for line in WEATHER_TASKS.read_text().splitlines()]

    def episodes() -> list[dict]:
        env = gymnasium.wrappers.RecordEpisodeStatistics(_make(address, "weather", tasks=tasks))
        finished = []
        for seed in range(3):
            observation, info = env.reset(seed=seed)
            task, done = tasks[info["task_index"]], False
            while not done:
                observation, reward, terminated, truncated, info = env.step(_policy(observation, task))
                done = terminated or truncated
            finished.append(info["episode"])
        env.close()
        return finished

    finished = await asyncio.to_thread(episodes)
    assert [float(e["r"]) for e in finished] == [1.0, 1.0, 1.0]
    assert [int(e["l"]) for e in finished] == [2, 2, 2]  # a tool call, then the answer


async def test_a_vector_env_plays_episodes_side_by_side_and_resets_them_itself(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    tasks = [json.loads(line) for line in WEATHER_TASKS.read_text().splitlines()]

    def play() -> dict[str, object]:
        vector = gymnasium.vector.SyncVectorEnv([lambda: _make(address, "weather", tasks=tasks)] * 2)
        observations, infos = vector.reset(seed=10)
        picked = [int(i) for i in infos["task_index"]]
        seen: dict[str, object] = {"picked": picked, "spaces": type(vector.single_observation_space)}
        for _ in range(2):
            actions = tuple(_policy(o, tasks[i]) for o, i in zip(observations, picked, strict=True))
            observations, rewards, terminated, truncated, infos = vector.step(actions)
        seen["end"] = (observations, rewards.tolist(), terminated.tolist(), truncated.tolist())
        # The next step resets the finished envs (Gymnasium's next-step autoreset): new prompts.
        observations, rewards, terminated, _, infos = vector.step(("", ""))
        seen["autoreset"] = ([o.startswith("# Tools") for o in observations], infos["_task_index"].tolist())
        vector.close()
        return seen

    seen = await asyncio.to_thread(play)
    assert seen["spaces"] is gymnasium.spaces.Text
    assert len(seen["picked"]) == 2 and seen["picked"][0] != seen["picked"][1]  # seeds 10 and 11
    assert seen["end"] == (("", ""), [1.0, 1.0], [True, True], [False, False])
    assert seen["autoreset"] == ([True, True], [True, True])


@pytest.mark.slow
async def test_an_async_vector_env_plays_it_in_spawned_worker_processes(start):
    weather = await start(WeatherEnv())
    tasks = [json.loads(line) for line in WEATHER_TASKS.read_text().splitlines()]
    # The module:id form imports the adapter in each worker; gRPC needs spawned (not forked)
    # workers, and text observations pass through the pipe rather than shared memory.
    make = functools.partial(
        gymnasium.make, "gym_grpc.adapters.gymnasium_env:gym_grpc/Env-v0", address=weather.address, tasks=tasks
    )

    def play() -> tuple[list[float], list[bool]]:
        vector = gymnasium.vector.AsyncVectorEnv([make, make], context="spawn", shared_memory=False)
        try:
            observations, infos = vector.reset(seed=3)
            picked = [int(i) for i in infos["task_index"]]
            for _ in range(2):
                actions = tuple(_policy(o, tasks[i]) for o, i in zip(observations, picked, strict=True))
                observations, rewards, terminated, truncated, infos = vector.step(actions)
        finally:
            vector.close()
        return rewards.tolist(), terminated.tolist()

    assert await asyncio.to_thread(play) == ([1.0, 1.0], [True, True])


def test_a_forked_child_is_told_to_spawn_instead_of_waiting_out_its_deadlines():
    loop = text_episode.SyncLoop()
    assert loop.run(asyncio.sleep(0, "parent"), 5) == "parent"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what the loop says, and leave at once
        try:
            loop.run(asyncio.sleep(0, "child"), 5)
            message = b"ran"
        except Exception as e:
            message = f"{type(e).__name__}: {e}".encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as child:
        said = child.read().decode()
    os.waitpid(pid, 0)
    assert said.startswith("FailedPrecondition") and "spawn" in said
