"""The training-loop client: rollouts with token ids, groups, and one limit per process."""

import asyncio
import json
import logging
import threading

import pytest

from gym_grpc import client as client_module
from gym_grpc.client import GymClient, max_concurrent_rollouts, set_max_concurrent_rollouts
from gym_grpc.registry import Registry
from servers.agents.simple_agent.agent import SimpleAgent
from servers.models.local_policy.server import LocalPolicyModel
from servers.resources.weather.server import WeatherEnv
from tests.support import REPO, Calculator, EchoModel, static_registry

WEATHER_ROW = json.loads((REPO / "servers/resources/weather/data/example.jsonl").read_text().splitlines()[0])


@pytest.fixture(autouse=True)
def fresh_limit(monkeypatch):
    """Each test starts with no limit set, as a new process would."""
    monkeypatch.setattr(client_module, "_LIMIT", client_module._ProcessLimit())


async def _weather_agent(start):
    model = await start(LocalPolicyModel())
    env = await start(WeatherEnv())
    agent = SimpleAgent(
        {"model_server": "model", "resources_server": "weather"},
        name="agent",
        registry=static_registry(model=model, weather=env),
    )
    return static_registry(agent=await start(agent))


async def test_run_returns_the_reward_and_the_token_ids_of_each_turn(start):
    registry = await _weather_agent(start)
    async with GymClient("agent", registry) as gym:
        result = await gym.run(
            {**WEATHER_ROW, "responses_create_params": {**WEATHER_ROW["responses_create_params"], "temperature": 0}}
        )
    assert result.reward == 1.0
    assert len(result.turns) == 2  # the tool call, then the answer
    for turn in result.turns:
        assert len(turn.generation_log_probs) == len(turn.generation_token_ids) > 0
    first, second = result.turns
    assert second.prompt_token_ids[: len(first.prompt_token_ids) + len(first.generation_token_ids)] == (
        first.prompt_token_ids + first.generation_token_ids
    )
    row = result.to_row(WEATHER_ROW)
    assert row["reward"] == 1.0 and row["expected_city"] == "Paris"
    await registry.close()


async def test_run_group_returns_group_size_rollouts_of_the_task(start):
    registry = await _weather_agent(start)
    gym = GymClient("agent", registry)
    group = await gym.run_group(WEATHER_ROW, 6)
    assert len(group) == 6
    assert len({r.response.id for r in group}) == 6
    assert all(r.reward in (0.0, 1.0) for r in group)
    await registry.close()


async def _echo_agent(start):
    model = EchoModel(delay=0.05)
    m = await start(model)
    env = await start(Calculator())
    agent = SimpleAgent(
        {"model_server": "model", "resources_server": "calc"}, name="agent", registry=static_registry(model=m, calc=env)
    )
    return model, (await start(agent)).address


async def test_one_limit_is_shared_by_every_client_in_every_thread_and_loop(start, caplog):
    model, address = await _echo_agent(start)
    caplog.set_level(logging.INFO, logger="gym_grpc.client")
    set_max_concurrent_rollouts(3)
    row = {"responses_create_params": {"input": "hello"}, "expected_answer": "hello"}

    def other_thread():  # periodic evaluation on its own event loop
        async def evaluate():
            async with GymClient("agent", Registry(static={"agent": address})) as evaluation:
                return await asyncio.gather(*(evaluation.run(row) for _ in range(6)))

        results.extend(asyncio.run(evaluate()))

    results = []
    thread = threading.Thread(target=other_thread)
    thread.start()
    training = GymClient("agent", Registry(static={"agent": address}))
    baseline = GymClient("agent", Registry(static={"agent": address}))
    mine = await asyncio.gather(*(c.run(row) for c in [training, baseline] for _ in range(6)))
    while thread.is_alive():
        await asyncio.sleep(0.01)
    assert len(mine) == 12 and len(results) == 6
    assert model.peak == 3  # never more than the limit, although 18 were asked for at once
    logged = [r.getMessage() for r in caplog.records if "[Concurrency]" in r.getMessage()]
    assert logged == ["[Concurrency] Set max concurrent rollouts to 3"]
    await training.close()
    await baseline.close()


async def test_the_default_limit_is_set_and_logged_when_the_first_client_starts(caplog):
    caplog.set_level(logging.INFO, logger="gym_grpc.client")
    GymClient("agent", Registry(static={}))
    GymClient("agent", Registry(static={}))
    assert max_concurrent_rollouts() == client_module.DEFAULT_MAX_CONCURRENT_ROLLOUTS
    logged = [r.getMessage() for r in caplog.records if "[Concurrency]" in r.getMessage()]
    assert logged == [f"[Concurrency] Set max concurrent rollouts to {client_module.DEFAULT_MAX_CONCURRENT_ROLLOUTS}"]


async def test_a_cancelled_waiter_gives_its_place_back(start):
    model, address = await _echo_agent(start)
    set_max_concurrent_rollouts(1)
    gym = GymClient("agent", Registry(static={"agent": address}))
    row = {"responses_create_params": {"input": "x"}}
    first = asyncio.ensure_future(gym.run(row))
    waiting = asyncio.ensure_future(gym.run(row))
    await asyncio.sleep(0.01)
    waiting.cancel()
    await first
    again = await asyncio.wait_for(gym.run(row), 5)  # the slot is free again
    assert again.response.output
    await gym.close()
