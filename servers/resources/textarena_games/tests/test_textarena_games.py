"""TextArena's games played through sessions (the real textarena package): a game per rollout, moves
through the `move` tool, the game's reward from Verify, the game released on close and on the idle time-out."""

import asyncio
import json
import re
import time
from pathlib import Path

import pytest
import textarena as ta
import yaml

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.textarena_games.server import TextArenaEnv
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.testing import ResourcesConformance, call, example_rows, static_registry
from gym_grpc.testing.fake_engine import FakeEngine, Turn
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, collect_args, gym, start_run

HERE = Path(__file__).resolve().parent.parent
CONFIG = HERE / "config.yaml"
EXAMPLES = HERE / "data" / "example.jsonl"
GAMES = {"games": ["GuessTheNumber-v0", "TowerOfHanoi-v0"], "seeds": 3}


def _task(game: str = "GuessTheNumber-v0", seed: int = 0):
    return rows.task_from_row(
        {"responses_create_params": {"input": "Play."}, "textarena_game": game, "textarena_seed": seed}
    )


def _target(seed: int) -> int:
    """The number TextArena itself picks for GuessTheNumber-v0 with `seed`, played alone in this process."""
    env = ta.make("GuessTheNumber-v0")
    env.reset(num_players=1, seed=seed)
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env.game_number


@pytest.fixture
async def arena(start):
    server = await start(TextArenaEnv(GAMES, name="arena"))
    client = ResourcesClient(static_registry(arena=server), "arena")
    yield client, server.app
    await client.registry.close()


async def _move(client: ResourcesClient, session: str, action: str) -> str:
    result = await client.call_tool(session, r.FunctionCall(name="move", arguments=json.dumps({"action": action})))
    assert not result.error, result.output
    return result.output


async def _guess(client: ResourcesClient, session: str) -> list[int]:
    """Play GuessTheNumber by halving, through the tool; the guesses made."""
    low, high, guesses = 1, 20, []
    while True:
        guess = (low + high) // 2
        guesses.append(guess)
        said = await _move(client, session, f"[{guess}]")
        if "higher" in said:
            low = guess + 1
        elif "lower" in said:
            high = guess - 1
        else:
            assert "[game over]" in said, said
            return guesses


async def test_a_won_game_earns_the_games_reward_and_a_move_after_it_is_the_models_error(arena):
    client, env = arena
    await client.seed_session("s", _task(seed=5))
    assert not (await client.describe_tools()).stateless
    guesses = await _guess(client, "s")
    assert guesses[-1] == _target(5)
    late = await client.call_tool("s", r.FunctionCall(name="move", arguments='{"action": "[3]"}'))
    assert late.error and "the game is over" in late.output
    verdict = await client.verify("s", _task(seed=5), r.Response(output=[assistant_message("Won.")]))
    assert verdict.reward == 1.0
    fields = rows.json_field(verdict, "fields")
    assert fields["finished"] and fields["moves"] == len(guesses) and not fields["replayed"]
    assert fields["game"] == "GuessTheNumber-v0" and fields["seed"] == 5
    assert "Congratulations" in fields["reason"]


async def test_an_unfinished_game_gets_the_unfinished_reward(start):
    server = await start(TextArenaEnv({**GAMES, "unfinished_reward": -0.5}, name="arena"))
    client = ResourcesClient(static_registry(arena=server), "arena")
    await client.seed_session("s", _task("TowerOfHanoi-v0"))
    said = await _move(client, "s", "[A C]")
    assert "[game over]" not in said and "C" in said
    verdict = await client.verify("s", _task("TowerOfHanoi-v0"), r.Response(output=[assistant_message("Bye.")]))
    assert verdict.reward == -0.5 and rows.json_field(verdict, "fields")["finished"] is False
    await client.registry.close()


async def test_each_session_has_its_own_game_and_its_seed_plays_the_same_game_whatever_runs_beside(arena):
    client, env = arena
    seeds = {"a": 1, "b": 2, "c": 1}
    await asyncio.gather(*(client.seed_session(s, _task(seed=seed)) for s, seed in seeds.items()))
    assert set(env.games.live) == {"a", "b", "c"}
    played = await asyncio.gather(*(_guess(client, s) for s in seeds))  # interleaved moves
    targets = {s: guesses[-1] for s, guesses in zip(seeds, played, strict=True)}
    assert targets == {s: _target(seed) for s, seed in seeds.items()}
    assert played[0] == played[2]  # the same seed, the same game, move for move
    assert all(env.games.live[s].done for s in seeds)


async def test_a_game_that_draws_while_it_is_played_draws_the_same_cards_beside_other_games(start):
    """Blackjack deals from Python's global random on every move: each session's own random state keeps a
    seed's deal the same when other games are seeded and played in between."""
    server = await start(TextArenaEnv({"games": ["Blackjack-v0"]}, name="arena"))
    client = ResourcesClient(static_registry(arena=server), "arena")
    moves = ["[hit]", "[stand]", "[hit]", "[stand]", "[hit]"]
    await client.seed_session("alone", _task("Blackjack-v0", seed=11))
    alone = [await _move(client, "alone", m) for m in moves]
    await client.seed_session("first", _task("Blackjack-v0", seed=11))
    beside = []
    for number, m in enumerate(moves):
        await client.seed_session(f"other{number}", _task("Blackjack-v0", seed=100 + number))  # reseeds the game
        beside.append(await _move(client, "first", m))
        await _move(client, f"other{number}", "[hit]")
    assert beside == alone
    await client.registry.close()


async def test_closing_the_session_releases_its_game(arena):
    client, env = arena
    await client.seed_session("s", _task())
    await _move(client, "s", "[10]")
    assert list(env.games.live) == ["s"]
    await client.close_session("s")
    assert env.games.live == {}
    with pytest.raises(errors.FailedPrecondition, match="SeedSession first"):
        await client.call_tool("s", r.FunctionCall(name="move", arguments='{"action": "[3]"}'))


async def test_a_game_nobody_plays_is_released_by_the_idle_timeout(start):
    server = await start(TextArenaEnv({**GAMES, "session_idle_timeout_seconds": 0.2}, name="arena"))
    client = ResourcesClient(static_registry(arena=server), "arena")
    games = server.app.games
    await client.seed_session("abandoned", _task("TowerOfHanoi-v0"))
    await client.seed_session("busy", _task("TowerOfHanoi-v0"))
    deadline = time.monotonic() + 5.0
    moves = iter(["[A C]", "[C A]"] * 100)
    while "abandoned" in games.live and time.monotonic() < deadline:
        await _move(client, "busy", next(moves))  # a rollout that keeps playing keeps its game
        await asyncio.sleep(0.05)
    assert list(games.live) == ["busy"]
    with pytest.raises(errors.FailedPrecondition, match="idle sessions are closed"):
        await client.call_tool("abandoned", r.FunctionCall(name="move", arguments='{"action": "[A C]"}'))
    await client.registry.close()


async def test_verify_after_the_session_closed_replays_the_moves_from_the_seed(arena):
    client, _ = arena
    await client.seed_session("s", _task(seed=4))
    output = []
    low, high = 1, 20
    while True:
        guess = (low + high) // 2
        fc = call("move", json.dumps({"action": f"[{guess}]"}))
        said = (await client.call_tool("s", fc.function_call)).output
        output += [fc, r.Item(function_call_output=r.FunctionCallOutput(call_id=fc.function_call.call_id, output=said))]
        if "[game over]" in said:
            break
        low, high = (guess + 1, high) if "higher" in said else (low, guess - 1)
    response = r.Response(output=[*output, assistant_message("Done.")])
    live = await client.verify("s", _task(seed=4), response)
    await client.close_session("s")
    replayed = await client.verify("s", _task(seed=4), response)
    assert live.reward == replayed.reward == 1.0
    assert rows.json_field(replayed, "fields")["replayed"] and not rows.json_field(live, "fields")["replayed"]
    assert rows.json_field(replayed, "fields")["moves"] == rows.json_field(live, "fields")["moves"]


@pytest.mark.parametrize(
    ("task", "key", "says"),
    [
        (_task("Wordle-v0"), "textarena_game", "'Wordle-v0' is not a game of this server"),
        (_task(seed=1.5), "textarena_seed", "must be a whole number"),  # type: ignore[arg-type]
    ],
)
async def test_a_row_naming_a_game_it_does_not_serve_cannot_seed_a_session(arena, task, key, says):
    client, env = arena
    with pytest.raises(errors.InvalidArgument, match=re.escape(says)) as raised:
        await client.seed_session("s", task)
    assert raised.value.field == f"task.data.{key}"
    assert env.games.live == {}


# --- configuration mistakes ----------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "where", "says"),
    [
        ({"games": ["GuessTheNumbr-v0"]}, "games", "TextArena has no game 'GuessTheNumbr-v0' (did you mean"),
        ({"games": []}, "games", "at least 1 item"),
        ({"games": ["TowerOfHanoi-v0"], "game_kwargs": {"Sudoku-v0": {}}}, "game_kwargs", "'Sudoku-v0', which is not"),
        ({"games": ["TowerOfHanoi-v0"], "seed": 3}, "seed", "Extra inputs are not permitted (did you mean 'seeds'?)"),
    ],
)
def test_a_bad_config_is_a_config_error_naming_the_server_and_key(config, where, says):
    with pytest.raises(errors.ConfigError, match=f"server 'arena': config.{where}") as raised:
        TextArenaEnv.checked_config(config, "arena")
    assert says in str(raised.value)


async def test_a_game_that_cannot_start_stops_the_server_naming_it(start):
    app = TextArenaEnv({"games": ["GuessTheNumber-v0"], "game_kwargs": {"GuessTheNumber-v0": {"max_numbr": 9}}})
    with pytest.raises(errors.ConfigError) as raised:
        await start(app)
    assert str(raised.value).startswith(
        "server 'TextArenaEnv': config.game_kwargs: TextArena cannot start GuessTheNumber-v0 here: TypeError: "
    )
    assert "max_numbr" in str(raised.value)


def test_gym_grpc_run_refuses_an_unknown_game_naming_it():
    done = gym(
        "run",
        str(REPO / "configs" / "local_policy.yaml"),
        str(CONFIG),
        "--registry",
        "127.0.0.1:0",
        "servers.textarena.config.games=[Chesss-v0]",
    )
    assert done.returncode != 0
    assert "server 'textarena'" in done.stderr and "TextArena has no game 'Chesss-v0'" in done.stderr


# --- task rows -----------------------------------------------------------------------


def test_the_example_rows_are_what_the_configured_server_writes():
    config = yaml.safe_load(CONFIG.read_text())["servers"]["textarena"]["config"]
    written = TextArenaEnv(config, name="textarena").task_rows(3)
    assert example_rows(EXAMPLES, TextArenaEnv) == written
    assert [row["textarena_game"] for row in written] == config["games"]  # the first rows mix the games


# --- a user's run: gym-grpc run + gym-grpc collect -----------------------------------


def _halving_player(body: dict) -> Turn:
    """A scripted policy on the engine's Responses endpoint: plays GuessTheNumber by halving, from the
    moves and tool outputs of its own conversation, and says so when the game is over."""
    items = body["input"]
    moves = [json.loads(i["arguments"])["action"] for i in items if i.get("type") == "function_call"]
    outputs = [i["output"] for i in items if i.get("type") == "function_call_output"]
    low, high = 1, 20
    for move, said in zip(moves, outputs, strict=True):
        guess = int(move.strip("[]"))
        if "[game over]" in said:
            return Turn(content=f"I found it: {guess}.")
        low, high = (guess + 1, high) if "higher" in said else (low, guess - 1)
    return Turn(tool_calls=[("move", json.dumps({"action": f"[{(low + high) // 2}]"}))])


@pytest.mark.slow
async def test_gym_grpc_run_and_collect_play_whole_games_and_record_the_games_reward(tmp_path):
    tasks = tmp_path / "guess.jsonl"
    config = {"games": ["GuessTheNumber-v0"], "seeds": 3}
    tasks.write_text("".join(json.dumps(row) + "\n" for row in TextArenaEnv(config).task_rows()))
    engine = FakeEngine(_halving_player)
    base_url = await engine.start()
    output = tmp_path / "rollouts.jsonl"
    try:
        with start_run(
            f"policy_base_url={base_url}",
            "policy_api_key=none",
            "policy_model_name=scripted",
            "servers.textarena.config.games=[GuessTheNumber-v0]",
            configs=(REPO / "configs" / "openai.yaml", CONFIG),
        ) as run:
            collected = await asyncio.to_thread(gym, *collect_args(run.registry, "textarena_agent", tasks, output))
            assert collected.returncode == 0, collected.stderr
    finally:
        await engine.stop()
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(row["textarena_seed"] for row in written) == [0, 1, 2]
    for row in written:
        moves = [i for i in row["response"]["output"] if i["type"] == "function_call"]
        last = json.loads(moves[-1]["arguments"])["action"]
        assert int(last.strip("[]")) == _target(row["textarena_seed"])  # the game TextArena picked for the seed
        assert row["reward"] == 1.0 and row["finished"] and row["moves"] == len(moves) and not row["replayed"]
        assert "Congratulations" in row["reason"]


class TestTextArenaConformance(ResourcesConformance):
    task_row = json.loads(EXAMPLES.read_text().splitlines()[0])
    answer = "I am done playing."

    def server(self) -> TextArenaEnv:
        return TextArenaEnv(yaml.safe_load(CONFIG.read_text())["servers"]["textarena"]["config"])
