"""The training-loop client: rollouts with token ids, groups, failures marked, and one limit per process."""

import asyncio
import io
import json
import logging
import threading

import pytest

from gym_grpc import errors
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv
from gym_grpc.client import training as client_module
from gym_grpc.client.training import GymClient, max_concurrent_rollouts, set_max_concurrent_rollouts
from gym_grpc.data.jsonl import failures_path
from gym_grpc.rpc.registry import Registry
from tests.support import REPO, Calculator, EchoModel, eventually, static_registry

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


async def _echo_agent(start, model=None):
    model = model or EchoModel(delay=0.05)
    m = await start(model)
    env = await start(Calculator())
    agent = SimpleAgent(
        {"model_server": "model", "resources_server": "calc"}, name="agent", registry=static_registry(model=m, calc=env)
    )
    return model, (await start(agent)).address


async def test_one_limit_is_shared_by_every_client_in_every_thread_and_loop(start, caplog):
    model, address = await _echo_agent(start)
    caplog.set_level(logging.INFO, logger="gym_grpc.client.training")
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
    caplog.set_level(logging.INFO, logger="gym_grpc.client.training")
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


async def test_a_rollout_slot_draws_from_the_clients_limit_and_gives_it_back_once(start):
    """A trainer's own rollout loop (the tinker-cookbook adapter) holds slots of the same limit."""
    model, address = await _echo_agent(start)
    set_max_concurrent_rollouts(2)
    held = [await client_module.acquire_rollout_slot(), await client_module.acquire_rollout_slot()]
    assert client_module.rollouts_in_flight() == 2
    gym = GymClient("agent", Registry(static={"agent": address}))
    waiting = asyncio.ensure_future(gym.run({"responses_create_params": {"input": "x"}}))
    await asyncio.sleep(0.05)
    assert not waiting.done() and model.requests == []  # no slot left for the client
    held[0].release()
    held[0].release()  # a second release gives nothing back
    assert (await waiting).ok
    assert client_module.rollouts_in_flight() == 1 and not held[0].held and held[1].held
    held[1].release()
    assert client_module.rollouts_in_flight() == 0
    await gym.close()


class FailsTheSecondCall(EchoModel):
    """Fails its second call at once, while the other calls of a group are still running."""

    async def create_response(self, params, session_id):
        if len(self.requests) == 1:
            self.requests.append(params)
            raise RuntimeError("engine exploded")
        return await super().create_response(params, session_id)


async def test_a_failed_rollout_is_returned_marked_and_has_no_reward(start):
    _, address = await _echo_agent(start)
    async with GymClient("agent", Registry(static={"agent": address})) as gym:
        result = await gym.run({"responses_create_params": {"input": "please fail"}})
    assert not result.ok and result.rollout is None
    assert (result.failure.error_class, result.failure.code) == ("GymError", "INTERNAL")
    assert "RuntimeError" in result.failure.message
    with pytest.raises(errors.RolloutFailed, match="INTERNAL") as raised:
        result.reward  # noqa: B018 - a failed rollout must not pass for a reward of 0
    assert raised.value.failure is result.failure
    with pytest.raises(errors.RolloutFailed):
        result.turns  # noqa: B018


async def test_run_group_returns_every_member_with_the_failed_one_marked(start):
    _, address = await _echo_agent(start, FailsTheSecondCall(delay=0.5))
    async with GymClient("agent", Registry(static={"agent": address})) as gym:
        group = await gym.run_group({"responses_create_params": {"input": "hi"}, "expected_answer": "hi"}, 4)
    assert len(group) == 4
    failed = [result for result in group if not result.ok]
    assert len(failed) == 1 and failed[0].failure.code == "INTERNAL"
    assert [result.reward for result in group if result.ok] == [1.0, 1.0, 1.0]


async def test_cancelling_a_group_ends_every_members_call_at_the_model(start):
    model, address = await _echo_agent(start, EchoModel(delay=30))
    gym = GymClient("agent", Registry(static={"agent": address}))
    group = asyncio.ensure_future(gym.run_group({"responses_create_params": {"input": "hi"}}, 4))
    await eventually(lambda: model.active == 4, "the group at the model")
    assert model.active == 4
    group.cancel()
    with pytest.raises(asyncio.CancelledError):
        await group
    await eventually(lambda: model.cancelled == 4, "the group cancelled at the model")
    assert (model.cancelled, model.active) == (4, 0)
    await gym.close()


async def test_a_member_that_raises_leaves_no_other_member_running(start):
    model, address = await _echo_agent(start, EchoModel(delay=30))
    gym = GymClient("agent", Registry(static={"agent": address}))
    agent_run = gym._agent.run
    calls = 0

    async def one_member_hits_a_bug(task, **kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            await eventually(lambda: model.active == 3, "the other members at the model")
            raise RuntimeError("a bug in the caller's code")
        return await agent_run(task, **kwargs)

    gym._agent.run = one_member_hits_a_bug
    with pytest.raises(RuntimeError, match="a bug"):
        await gym.run_group({"responses_create_params": {"input": "hi"}}, 4)
    await eventually(lambda: model.cancelled == 3, "the other members cancelled")
    assert (model.cancelled, model.active) == (3, 0)
    await gym.close()


async def test_the_client_and_the_failures_sidecar_describe_a_failure_alike(start, tmp_path):
    _, address = await _echo_agent(start)
    row = {"responses_create_params": {"input": "please fail"}}
    (tmp_path / "tasks.jsonl").write_text(json.dumps(row) + "\n")
    options = CollectOptions(
        input=tmp_path / "tasks.jsonl", output=tmp_path / "out.jsonl", agent="agent", progress=False
    )
    registry = Registry(static={"agent": address})
    async with GymClient("agent", registry) as gym:
        result = await gym.run(row)
        await collect(registry, options, log=io.StringIO())
    (record,) = [json.loads(line) for line in failures_path(options.output).read_text().splitlines()]
    assert record["error"] == result.failure.to_json()
