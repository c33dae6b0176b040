"""The SkyRL-Gym adapter, with the real skyrl-gym package and real gym-grpc servers.

The environments are built through skyrl_gym's own registry (`skyrl_gym.make`),
find their resources server through a real registry service (as `gym-grpc
run` serves it), and are driven from a worker thread, as skyrl-train drives
them (its generator runs `init`/`step` in a thread pool): the servers live on
the test's event loop, which must stay free to answer. The actions are what a
model would write; the observations are what it would read next.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import skyrl_gym

import gym_grpc.adapters.skyrl as adapter
from gym_grpc.bundled.servers.resources.session_state.server import ShoppingCartEnv
from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv, forecast
from gym_grpc.launch.runner import RegistryServer
from gym_grpc.resources import Session
from gym_grpc.v1 import registry_service_pb2 as reg

PROMPT = [{"role": "user", "content": "What's the weather like in Paris right now?"}]


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


def _make(registry_address: str, server: str, task: dict, **config: object):
    return skyrl_gym.make(
        "gym-grpc",
        env_config={"registry": registry_address, "resources_server": server, "timeout_seconds": 60, **config},
        extras={"task": task, "env_class": "gym-grpc"},
    )


def test_the_adapter_registers_in_skyrl_gyms_registry():
    assert "gym-grpc" in skyrl_gym.registry
    env = skyrl_gym.make("gym-grpc", env_config={"resources_server": "weather"}, extras={"task": {}})
    assert isinstance(env, adapter.GymGrpcTextEnv)
    assert isinstance(env, skyrl_gym.Env)


def test_a_mistyped_config_key_is_an_error():
    with pytest.raises(ValueError, match="timeout_second"):
        skyrl_gym.make("gym-grpc", env_config={"resources_server": "w", "timeout_second": 3}, extras={})


async def test_a_tool_call_is_run_and_a_final_answer_is_verified(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "weather", {"expected_city": "Paris"})

    prompt, info = await asyncio.to_thread(env.init, PROMPT)
    assert prompt[0]["role"] == "system" and '"name": "get_weather"' in prompt[0]["content"]
    assert prompt[1:] == PROMPT
    assert [t["function"]["name"] for t in info["tools"]] == ["get_weather"]

    out = await asyncio.to_thread(env.step, _call("get_weather", city="Paris"))
    assert out["done"] is False and out["reward"] == 0.0
    [observation] = out["observations"]
    assert observation["role"] == "tool"
    assert json.loads(observation["content"]) == forecast("Paris")  # the tool's output reaches the model

    temperature = json.loads(observation["content"])["temperature_c"]
    out = await asyncio.to_thread(env.step, f"It is {temperature} C in Paris.")
    assert out["done"] is True and out["reward"] == 1.0
    assert out["metadata"]["verifier_fields"] == {"tool_calls": 1, "right_city": True, "reported_temperature": True}
    assert env.get_metrics()["tool_calls"] == 1


async def test_the_reward_is_the_verifiers_even_when_it_is_zero(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "weather", {"expected_city": "Paris"})
    await asyncio.to_thread(env.init, PROMPT)
    await asyncio.to_thread(env.step, _call("get_weather", city="Lyon"))
    out = await asyncio.to_thread(env.step, "It is 99 C.")
    assert out["done"] is True and out["reward"] == 0.0
    assert out["metadata"]["verifier_fields"]["right_city"] is False


async def test_user_observations_carry_the_tool_response_tags(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "weather", {"expected_city": "Paris"}, observation_role="user")
    await asyncio.to_thread(env.init, PROMPT)
    out = await asyncio.to_thread(env.step, _call("get_weather", city="Paris"))
    [observation] = out["observations"]
    assert observation["role"] == "user"
    assert re.fullmatch(r"<tool_response>\n(.*)\n</tool_response>", observation["content"], re.S)


async def test_sessions_are_closed_when_the_episode_ends_and_on_close(start, registry):
    cart = await start(ShoppingCartEnv())
    address = registry("cart", cart)
    task = {"expected_cart": {"MILK-1L": 1}, "initial_cart": {}}
    prompt = [{"role": "user", "content": "Add one litre of whole milk."}]

    finished = _make(address, "cart", task)
    await asyncio.to_thread(finished.init, prompt)
    unfinished = _make(address, "cart", task)
    await asyncio.to_thread(unfinished.init, prompt)
    assert len(cart.app.sessions) == 2

    out = await asyncio.to_thread(finished.step, _call("add_item", sku="MILK-1L", quantity=1))
    assert "MILK-1L" in out["observations"][0]["content"]
    out = await asyncio.to_thread(finished.step, "Done: one litre of whole milk is in your cart.")
    assert out["done"] and out["reward"] == 1.0  # the cart as the server held it
    assert len(cart.app.sessions) == 1

    await asyncio.to_thread(unfinished.close)
    assert len(cart.app.sessions) == 0


async def test_max_turns_ends_the_episode_and_verifies_it_as_it_stands(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "weather", {"expected_city": "Paris"}, max_turns=1)
    await asyncio.to_thread(env.init, PROMPT)
    out = await asyncio.to_thread(env.step, _call("get_weather", city="Paris"))
    assert out["done"] is True and out["reward"] == 0.0
    assert out["metadata"]["stop_reason"] == "tool_call_at_max_turns"


class BrokenVerifier(ShoppingCartEnv):
    async def verify(self, session: Session, response):
        raise RuntimeError("the grader's database is down")


async def test_a_verifier_that_raises_ends_the_episode_with_its_error(start, registry):
    broken = await start(BrokenVerifier())
    address = registry("cart", broken)
    env = _make(address, "cart", {"expected_cart": {}})
    await asyncio.to_thread(env.init, [{"role": "user", "content": "Nothing, thanks."}])
    out = await asyncio.to_thread(env.step, "Nothing to do.")
    assert out["done"] is True and out["reward"] == 0.0
    error = out["metadata"]["error"]
    assert error["reason"] == "VERIFIER_FAILED" and error["resources_server"] == "cart"
    assert error["code"] == "INTERNAL"
    assert "the grader's database is down" in error["message"]
    assert len(broken.app.sessions) == 0  # closed all the same
    again = await asyncio.to_thread(env.step, "hello?")
    assert again["done"] is True and again["metadata"]["error"] == error


async def test_a_server_the_registry_does_not_know_ends_the_episode_at_its_first_step(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "wether", {"expected_city": "Paris"})
    prompt, info = await asyncio.to_thread(env.init, PROMPT)
    assert prompt == PROMPT
    assert "wether" in info["error"]["message"] and "weather" in info["error"]["message"]
    out = await asyncio.to_thread(env.step, "It is 20 C.")
    assert out["done"] is True and out["reward"] == 0.0 and out["metadata"]["error"] == info["error"]


async def test_a_server_that_stops_mid_episode_ends_it_within_the_timeout(start, registry):
    weather = await start(WeatherEnv())
    address = registry("weather", weather)
    env = _make(address, "weather", {"expected_city": "Paris"}, timeout_seconds=5)
    await asyncio.to_thread(env.init, PROMPT)
    await weather.stop(grace=0)
    out = await asyncio.to_thread(env.step, _call("get_weather", city="Paris"))
    assert out["done"] is True and out["reward"] == 0.0
    assert out["metadata"]["error"]["code"] in {"UNAVAILABLE", "DEADLINE_EXCEEDED"}


async def test_a_row_that_does_not_load_ends_the_episode_with_the_field_at_fault(start, registry):
    address = registry("weather", await start(WeatherEnv()))
    env = _make(address, "weather", {"responses_create_params": {"input": PROMPT, "temperature": "hot"}})
    _, info = await asyncio.to_thread(env.init, PROMPT)
    assert "temperature" in info["error"]["message"]
