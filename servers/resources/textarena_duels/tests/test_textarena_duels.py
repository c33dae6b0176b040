"""TextArena's two-player games as episodes with two roles (the real textarena package): whose turn it
is comes from the game, each player's reward is the game's, and a user's `gym-grpc run` + `collect` with
two model servers writes rows that hold both trajectories, both rewards, and give samples per role."""

import asyncio
import json
import re
from pathlib import Path

import pytest
import textarena as ta
import yaml

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.textarena_games.server import TextArenaDuelEnv
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.testing import static_registry
from gym_grpc.testing.fake_engine import FakeEngine, Turn
from gym_grpc.testing.processes import GymRun
from gym_grpc.training import assign_advantages, build, read_rollouts
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, collect_args, grpcurl, gym, one_server_config, start_run

HERE = Path(__file__).resolve().parent.parent
CONFIG = HERE / "config.yaml"
EXAMPLES = HERE / "data" / "example.jsonl"


def _task(seed: int = 0) -> object:
    return rows.task_from_row(
        {"responses_create_params": {"input": "Play."}, "textarena_game": "TicTacToe-v0", "textarena_seed": seed}
    )


def _said(text: str) -> r.Response:
    return r.Response(output=[assistant_message(text)])


@pytest.fixture
async def duel(start):
    server = await start(TextArenaDuelEnv({"games": ["TicTacToe-v0"], "seeds": 2}, name="duel"))
    client = ResourcesClient(static_registry(duel=server), "duel")
    yield client
    await client.registry.close()


async def test_the_game_says_whose_turn_it_is_and_each_player_gets_the_games_reward(duel):
    episode = await duel.seed_session("s", _task())
    assert [role.name for role in episode.roles] == ["player_0", "player_1"]
    assert episode.turn.role == "player_0" and "Available Moves" in episode.turn.input[0].message.text
    # player_0 takes the top row while player_1 plays the middle one badly.
    turn = episode.turn
    for move in ["[0]", "[3]", "[1]", "[4]", "[2]"]:
        assert turn is not None
        turn = await duel.end_turn("s", turn.role, _said(move))
        if turn is not None:  # the other player now, shown the move it has not seen
            assert f"[{move.strip('[]')}]" in turn.input[0].message.text or "cell" in turn.input[0].message.text
    assert turn is None  # three in a row: the episode is over
    verdict = await duel.verify("s", _task(), r.Response())
    assert dict(verdict.role_rewards) == {"player_0": 1.0, "player_1": -1.0}
    assert verdict.reward == 1.0 and json.loads(verdict.fields_json)["moves"] == 5


async def test_an_invalid_move_is_the_games_to_judge_and_the_same_player_tries_again(duel):
    await duel.seed_session("s", _task())
    again = await duel.end_turn("s", "player_0", _said("I will take the corner"))
    assert again is not None and again.role == "player_0"  # TextArena's allowance: one more try
    assert "invalid" in again.input[0].message.text.lower()


async def test_ending_the_turn_of_a_player_whose_turn_it_is_not_is_refused(duel):
    await duel.seed_session("s", _task())
    with pytest.raises(errors.GymError) as caught:
        await duel.end_turn("s", "player_1", _said("[4]"))
    assert caught.value.reason == errors.Reason.EPISODE_TURN_INVALID and "player_0" in caught.value.message


async def test_a_game_not_over_gives_both_players_the_unfinished_reward(start):
    server = await start(TextArenaDuelEnv({"games": ["TicTacToe-v0"], "unfinished_reward": -0.5}, name="duel"))
    client = ResourcesClient(static_registry(duel=server), "duel")
    try:
        await client.seed_session("s", _task())
        await client.end_turn("s", "player_0", _said("[4]"))
        verdict = await client.verify("s", _task(), r.Response())
        assert dict(verdict.role_rewards) == {"player_0": -0.5, "player_1": -0.5}
    finally:
        await client.registry.close()


def test_the_duel_example_rows_are_what_the_configured_server_writes():
    config = yaml.safe_load(CONFIG.read_text())["servers"]["textarena_duel"]["config"]
    written = TextArenaDuelEnv(config, name="textarena_duel").task_rows(3)
    assert [json.loads(line) for line in EXAMPLES.read_text().splitlines()] == written


# --- a user's run: gym-grpc run + gym-grpc collect, two model servers ---------------------

_MOVES = re.compile(r"Available Moves:((?:\s*'\[\d\]',?)+)")


def _lowest_move_player(body: dict) -> Turn:
    """A scripted engine behind the second model server: always the lowest cell the last board offers."""
    seen = "\n".join(str(item.get("content")) for item in body["input"] if item.get("role") == "user")
    cells = re.findall(r"\[(\d)\]", _MOVES.findall(seen)[-1])
    return Turn(content=f"[{min(cells)}]")


def tictactoe_rewards(seed: int, moves: list[str]) -> dict[int, float]:
    """The rewards TextArena itself gives for a TicTacToe game of these moves (played alone, in order)."""
    env = ta.make("TicTacToe-v0")
    env.reset(num_players=2, seed=seed)
    done = False
    for move in moves:
        done, _ = env.step(move)
        if done:
            break
    assert done, "the recorded moves do not end the game"
    rewards, _ = env.close()
    return dict(rewards)


@pytest.mark.slow
async def test_collect_with_two_model_servers_writes_both_trajectories_zero_sum_rewards_and_samples_per_role(
    tmp_path,
):
    engine = FakeEngine(_lowest_move_player)
    base_url = await engine.start()
    opponent = one_server_config(
        tmp_path,
        "opponent_model",
        "servers/models/openai_model/server.py:OpenAIModel",
        {"base_url": base_url, "api_key": "none", "model": "lowest-move"},
    )
    tasks = tmp_path / "duels.jsonl"
    tasks.write_text(EXAMPLES.read_text())
    output = tmp_path / "rollouts.jsonl"
    try:
        with start_run(
            "servers.textarena_duel_agent.config.role_model_servers={player_1: opponent_model}",
            configs=(REPO / "configs" / "local_policy.yaml", opponent, CONFIG),
        ) as run:
            args = [*collect_args(run.registry, "textarena_duel_agent", tasks, output), "--num-repeats", "4"]
            collected = await asyncio.to_thread(gym, *args)
            assert collected.returncode == 0, collected.stderr
            report = await asyncio.to_thread(gym, "report", str(output))
            assert report.returncode == 0, report.stderr
    finally:
        await engine.stop()
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(written) == 12
    for row in written:
        assert row["stop_reason"] == "episode_over" and row["finished"]
        roles = {role["name"]: role for role in row["roles"]}
        assert {name: role["model_server"] for name, role in roles.items()} == {
            "player_0": "policy_model",
            "player_1": "opponent_model",
        }
        output_items = row["response"]["output"]
        positions = sorted(roles["player_0"]["items"] + roles["player_1"]["items"])
        assert positions == list(range(len(output_items)))  # every item is exactly one role's
        moves = []
        for position, item in enumerate(output_items):
            if item["type"] == "message" and item["role"] == "assistant":
                player = "player_0" if position in roles["player_0"]["items"] else "player_1"
                moves.append((player, item["content"][0]["text"]))
        # player_1 is the scripted engine's (lowest cell), player_0 the embedded policy's (with token ids).
        assert all(
            ("generation_token_ids" in output_items[p]) == (name == "player_0")
            for name in roles
            for p in roles[name]["items"]
            if output_items[p]["type"] == "message" and output_items[p]["role"] == "assistant"
        )
        assert len(moves) == row["moves"] == row["model_calls"]
        assert sum(role["model_calls"] for role in roles.values()) == row["model_calls"]
        # The rewards are the game's, for the moves the row attributes to each player, and zero-sum.
        expected = tictactoe_rewards(row["textarena_seed"], [move for _, move in moves])
        assert roles["player_0"]["reward"] == expected[0] and roles["player_1"]["reward"] == expected[1]
        assert roles["player_0"]["reward"] + roles["player_1"]["reward"] == 0
        assert row["reward"] == roles["player_0"]["reward"]
    assert "player_0: reward mean" in report.stdout and "player_1: reward mean" in report.stdout
    # Training samples per role: player_0's trajectories (token ids), grouped per task and role.
    samples, stats = build(read_rollouts(output))
    assert {sample.role for sample in samples} == {"player_0"}  # the scripted engine sends no token ids
    assert stats.without_ids == 12  # player_1's trajectories
    by_row = {(row["textarena_seed"], row["repeat_index"]): row for row in written}
    for sample in samples:
        row = by_row[(sample.task_index, sample.repeat_index)]
        assert sample.reward == {role["name"]: role["reward"] for role in row["roles"]}["player_0"]
        assert sample.num_turns == next(r["model_calls"] for r in row["roles"] if r["name"] == "player_0")
    groups = assign_advantages(samples)
    assert sorted(group.group for group in groups) == [f"textarena_duel_agent/{t}/player_0" for t in range(3)]


def _create_responses(run: GymRun, name: str) -> int:
    """CreateResponse calls a model server answered OK, by its own counters (AdminService.GetCounters
    of each of its worker processes)."""
    answered = 0
    for address in run.worker_addresses(name):
        counters = json.loads(grpcurl(address, "gym.v1.AdminService/GetCounters"))
        # A worker that answered no call has no methods (grpcurl leaves an empty list out): the client fills
        # a group's workers in turn, so a light load may never reach the second.
        methods = counters.get("methods", [])
        method = next((m for m in methods if m["method"] == "CreateResponse"), {"calls_by_status": {}})
        answered += int(method["calls_by_status"].get("OK", 0))
    return answered


@pytest.mark.slow
async def test_two_embedded_policies_each_play_their_own_role_and_the_samples_split_per_role(tmp_path):
    second = one_server_config(
        tmp_path, "second_policy", "servers/models/local_policy/server.py:LocalPolicyModel", {"seed": 7}
    )
    output = tmp_path / "rollouts.jsonl"
    with start_run(
        "servers.textarena_duel_agent.config.role_model_servers={player_1: second_policy}",
        configs=(REPO / "configs" / "local_policy.yaml", second, CONFIG),
    ) as run:
        args = [*collect_args(run.registry, "textarena_duel_agent", EXAMPLES, output), "--num-repeats", "3"]
        collected = await asyncio.to_thread(gym, *args)
        assert collected.returncode == 0, collected.stderr
        served = {name: _create_responses(run, name) for name in ("policy_model", "second_policy")}
    written = [json.loads(line) for line in output.read_text().splitlines()]
    calls = {"player_0": 0, "player_1": 0}
    for row in written:
        rewards = {role["name"]: role["reward"] for role in row["roles"]}
        assert sum(rewards.values()) == 0 and row["reward"] == rewards["player_0"]
        for role in row["roles"]:
            calls[role["name"]] += role["model_calls"]
    # Each model server answered exactly its role's turns, by its own count.
    assert served == {"policy_model": calls["player_0"], "second_policy": calls["player_1"]}
    samples, stats = build(read_rollouts(output))
    assert stats.non_monotonic_turns == 0 and len(samples) == 2 * len(written)
    for sample in samples:
        row = next(
            r for r in written if (r["task_index"], r["repeat_index"]) == (sample.task_index, sample.repeat_index)
        )
        role = next(role for role in row["roles"] if role["name"] == sample.role)
        assert (sample.reward, sample.num_turns) == (role["reward"], role["model_calls"])
    groups = assign_advantages(samples)
    assert sorted(g.group for g in groups) == sorted(
        f"textarena_duel_agent/{t}/{p}" for t in range(3) for p in ("player_0", "player_1")
    )
