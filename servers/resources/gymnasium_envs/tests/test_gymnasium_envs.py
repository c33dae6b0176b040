"""Gymnasium's own registered environments (the real gymnasium package) played through sessions: an episode
per rollout, actions through the `step` tool, the episode's return from Verify, the same returns as the env
gives when stepped directly."""

import json
from pathlib import Path

import gymnasium
import pytest
import yaml

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.gymnasium_envs.server import GymnasiumEnv
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.testing import ResourcesConformance, call, static_registry
from gym_grpc.v1 import responses_pb2 as r

HERE = Path(__file__).resolve().parent.parent
CONFIG = yaml.safe_load((HERE / "config.yaml").read_text())["servers"]["gymnasium"]["config"]
EXAMPLES = [json.loads(line) for line in (HERE / "data" / "example.jsonl").read_text().splitlines()]
LEFT, DOWN, RIGHT, UP = range(4)  # FrozenLake's actions
TO_THE_GOAL = [RIGHT, RIGHT, DOWN, DOWN, DOWN, RIGHT]  # on the 4x4 map, not slippery


def _task(env_id: str = "FrozenLake-v1", seed: int = 0):
    return rows.task_from_row(
        {"responses_create_params": {"input": "Act."}, "gymnasium_env": env_id, "gymnasium_seed": seed}
    )


def _direct_return(env_id: str, actions: list[int], **kwargs) -> float:
    """The return Gymnasium itself gives for `actions` from seed 0, stepped in this process."""
    env = gymnasium.make(env_id, **kwargs)
    env.reset(seed=0)
    total = 0.0
    for action in actions:
        _, reward, terminated, truncated, _ = env.step(action)
        total += float(reward)
        if terminated or truncated:
            break
    return total


@pytest.fixture
async def client(start):
    running = await start(GymnasiumEnv(CONFIG, name="gymnasium"))
    client = ResourcesClient(static_registry(gymnasium=running), "gymnasium")
    yield client
    await client.registry.close()


async def _play(client, session: str, task, actions: list[int]) -> list:
    await client.seed_session(session, task)
    return [
        await client.call_tool(session, r.FunctionCall(name="step", arguments=json.dumps({"action": a})))
        for a in actions
    ]


def test_the_example_rows_are_what_task_rows_writes():
    assert EXAMPLES == GymnasiumEnv(CONFIG, name="gymnasium").task_rows(4)
    assert "0: left, 1: down, 2: right, 3: up" in EXAMPLES[0]["responses_create_params"]["input"][0]["content"]


async def test_an_episode_to_the_goal_scores_its_return_as_gymnasium_gives_it(client):
    outputs = await _play(client, "goal", _task(), TO_THE_GOAL)
    assert not any(o.error for o in outputs)
    assert "(Right)\nS[F]FF\n" in outputs[0].output and "observation: 1" in outputs[0].output
    assert outputs[-1].output.endswith("[episode over] terminated; return 1")
    verdict = await client.verify("goal", _task(), r.Response())
    assert verdict.reward == _direct_return("FrozenLake-v1", TO_THE_GOAL, is_slippery=False) == 1.0
    fields = rows.json_field(verdict, "fields")
    assert (fields["steps"], fields["terminated"], fields["replayed"]) == (6, True, False)
    after = await client.call_tool("goal", r.FunctionCall(name="step", arguments='{"action": 0}'))
    assert after.error and "the episode is over" in after.output
    await client.close_session("goal")


async def test_a_fall_into_a_hole_scores_0_and_a_cliff_costs_what_gymnasium_says(client):
    await _play(client, "hole", _task(), [DOWN, RIGHT])  # (1, 1) is a hole
    assert (await client.verify("hole", _task(), r.Response())).reward == 0.0
    cliff = [1]  # right from the start: into the cliff, back to the start
    outputs = await _play(client, "cliff", _task("CliffWalking-v1"), cliff)
    assert "reward: -100" in outputs[0].output
    verdict = await client.verify("cliff", _task("CliffWalking-v1"), r.Response())
    assert verdict.reward == _direct_return("CliffWalking-v1", cliff) == -100.0


async def test_an_action_out_of_the_space_is_the_models_error(client):
    [out] = await _play(client, "bad", _task(), [4])
    assert out.error and "action 4 is not in the action space Discrete(4)" in out.output


async def test_without_a_session_verify_replays_the_responses_steps_from_the_seed(client):
    response = r.Response(output=[call("step", json.dumps({"action": a})) for a in TO_THE_GOAL])
    verdict = await client.verify("never-seeded", _task(), response)
    fields = rows.json_field(verdict, "fields")
    assert verdict.reward == 1.0 and fields["replayed"] and fields["steps"] == 6


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"envs": ["FrozenLake-v2"]}, "did you mean 'FrozenLake-v1'?"),
        ({"envs": ["FrozenLake-v1"], "env_kwargs": {"Taxi-v4": {}}}, "env_kwargs for 'Taxi-v4', which is not in envs"),
        ({"envs": ["MountainCarContinuous-v0"]}, "action space is Box"),
    ],
)
def test_a_config_gymnasium_cannot_serve_is_refused_naming_why(config, says):
    with pytest.raises(errors.ConfigError, match=says.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        GymnasiumEnv(config, name="gymnasium")


class TestGymnasiumConformance(ResourcesConformance):
    task_row = EXAMPLES[0]
    answer = "Done."

    def server(self):
        return GymnasiumEnv(CONFIG, name="gymnasium")
