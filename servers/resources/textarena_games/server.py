"""TextArena's single-player games as a multi-turn environment, configured, not coded.

    servers:
      textarena:
        entrypoint: server.py:TextArenaEnv
        config:
          games: [GuessTheNumber-v0, TowerOfHanoi-v0]   # TextArena env ids
          seeds: 50                                     # task rows: seeds 0..49 of each game

Each rollout plays one game of TextArena (the real package, `ta.make`):

- SeedSession makes the row's game (`textarena_game`, one of `games`;
  default the first) and resets it with the row's `textarena_seed`, so a
  task is one reproducible game. The game and its random state live in the
  session.
- The model plays with the tool `move(action)`: the action goes to the
  game's `step` (through the env id's own wrappers, which put a bare move in
  brackets), and the tool's output is the next observation, the game's
  messages since the last move (the model's own action is not echoed). A
  move after the game ended is the model's error, not the rollout's.
- Verify answers with the game's reward for player 0 (`env.close()`: 1 for a
  win; a game's own partial credit or penalty, which may be negative, for the
  rest); a game still running gets `unfinished_reward`. Fields: whether it
  finished, moves, the game's reason, whether the last move was invalid.
- CloseSession releases the game; so does the idle time-out
  (`session_idle_timeout_seconds`) for an agent that never closes.

TextArena games draw from Python's global `random` (and some from numpy's):
each session keeps its own generator state, put in place around every reset
and move, so concurrent games do not disturb each other's draws and a seed
plays the same game whatever else the server runs. Without an open session
(reverify, a session the idle time-out closed) Verify replays the response's
`move` calls on a fresh game from the task's seed.

Each game is started once when the server starts, so one that cannot run
here (Wordle, Hangman and the other word games fetch NLTK corpora at run
time; some games need two or more players, or an API key) stops the server
with a ConfigError naming it; docs/bridges.md lists what was tried here.
Moves run on the event loop: a TextArena step is pure Python and quick.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from pydantic import Field, field_validator

from gym_grpc import errors
from gym_grpc.resources import Episode, ResourcesConfig, ResourcesServer, Role, Session, Turn, Verification, tool
from gym_grpc.responses import final_text, function_calls
from gym_grpc.v1 import responses_pb2 as r

try:
    import textarena as ta
    from textarena.envs.registration import ENV_REGISTRY
except ImportError as e:  # pragma: no cover - the extra's own message
    raise ImportError(
        f"the textarena_games environment needs TextArena ({e.name}): pip install 'gym-grpc[textarena]'", name=e.name
    ) from e

GAME_KEY = "textarena_game"
SEED_KEY = "textarena_seed"


class TextArenaConfig(ResourcesConfig):
    games: list[str] = Field(min_length=1, description="TextArena env ids this server plays; rows pick one")
    game_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per env id, settings passed to ta.make (the game class's arguments)"
    )
    seeds: int = Field(20, ge=1, description="task_rows writes seeds 0 .. seeds-1 of each game")
    unfinished_reward: float = Field(0.0, description="the reward of a game that had not ended at Verify")

    @field_validator("games")
    @classmethod
    def _registered(cls, games: list[str]) -> list[str]:
        for game in games:
            if game not in ENV_REGISTRY:
                near = difflib.get_close_matches(game, list(ENV_REGISTRY), n=1, cutoff=0.6)
                hint = f"did you mean {near[0]!r}?" if near else "TextArena's env ids are like 'GuessTheNumber-v0'"
                raise ValueError(f"TextArena has no game {game!r} ({hint})")
        return games

    @field_validator("game_kwargs")
    @classmethod
    def _for_served_games(cls, kwargs: dict[str, dict[str, Any]], info: Any) -> dict[str, dict[str, Any]]:
        served = info.data.get("games") or []
        stray = [game for game in kwargs if game not in served]
        if stray:
            raise ValueError(f"settings for {', '.join(map(repr, stray))}, which is not in games")
        return kwargs


@contextlib.contextmanager
def _own_random(state: dict[str, Any]) -> Iterator[None]:
    """Run a game's code with its own global random state (kept in `state`), then restore the process's."""
    numpy = sys.modules.get("numpy")
    outer = random.getstate(), numpy.random.get_state() if numpy else None
    if "python" in state:
        random.setstate(state["python"])
    if numpy is not None and state.get("numpy") is not None:
        numpy.random.set_state(state["numpy"])
    try:
        yield
    finally:
        state["python"] = random.getstate()
        state["numpy"] = numpy.random.get_state() if numpy else None
        random.setstate(outer[0])
        if numpy is not None and outer[1] is not None:
            numpy.random.set_state(outer[1])


def _innermost(env: Any) -> Any:
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


def _render(messages: Any, player: int = 0) -> str:
    """A player's observation as text: the game's messages, without the player's own actions."""
    if isinstance(messages, str):
        return messages.strip()
    lines = []
    for sender, text, kind in messages:
        if kind == ta.ObservationType.PLAYER_ACTION and sender == player:
            continue
        lines.append(str(text).strip())
    return "\n".join(line for line in lines if line)


@dataclass
class Game:
    """One rollout's game: the TextArena env, its random state, and how it went."""

    game_id: str
    seed: int
    env: Any
    random_state: dict[str, Any] = field(default_factory=dict)
    moves: int = 0
    done: bool = False
    rewards: dict[int, float] | None = None
    info: dict[str, Any] = field(default_factory=dict)
    #: The player whose turn it is (two-player games).
    player: int = 0

    @classmethod
    def start(cls, game_id: str, seed: int, kwargs: dict[str, Any], players: int = 1) -> tuple[Game, str]:
        """A new game, reset with `seed`, and the first observation (of the player who moves first)."""
        game = cls(game_id, seed, ta.make(game_id, **kwargs))
        with _own_random(game.random_state):
            random.seed(seed)
            numpy = sys.modules.get("numpy")
            if numpy is not None:
                numpy.random.seed(seed)
            game.env.reset(num_players=players, seed=seed)
            return game, game.observe()

    def observe(self) -> str:
        """What the player to move has not seen yet; that player becomes `player`."""
        self.player, messages = _innermost(self.env).get_observation()
        return _render(messages, self.player)

    def move(self, action: str) -> str:
        if self.done:
            raise ValueError("the game is over; answer without moving")
        with _own_random(self.random_state):
            self.done, step_info = self.env.step(action)
            self.moves += 1
            text = self.observe()
            if self.done:
                rewards, game_info = self.env.close()
                self.rewards = dict(rewards or {})
                self.info = dict((game_info or {}).get(0, {}))
                self.info.update(step_info or {})
        if self.done:
            ending = self.info.get("reason") or "the game is over"
            return f"{text}\n[game over] {ending} (reward {self.reward(0.0):g})".strip()
        return text

    def reward(self, unfinished: float) -> float:
        if not self.done or not self.rewards:
            return unfinished
        return float(self.rewards.get(0, unfinished))


def game_of(config: TextArenaConfig, data: dict[str, Any]) -> tuple[str, int]:
    """The (env id, seed) a task row names; TaskDataError naming the key otherwise."""
    game = data.get(GAME_KEY, config.games[0])
    if game not in config.games:
        raise errors.TaskDataError(GAME_KEY, f"{game!r} is not a game of this server ({', '.join(config.games)})")
    seed = data.get(SEED_KEY, 0)
    if isinstance(seed, bool) or not isinstance(seed, int | float) or not float(seed).is_integer():
        raise errors.TaskDataError(SEED_KEY, f"must be a whole number, got {seed!r}")
    return game, int(seed)


def check_games(server: str, config: TextArenaConfig, players: int) -> None:
    """Start each configured game once (seed 0): a game that cannot run here (missing data, settings it
    does not take, a module this Python cannot import, too few players) stops the server with a
    ConfigError naming it, instead of failing every rollout that draws it."""
    for game_id in config.games:
        try:
            Game.start(game_id, 0, config.game_kwargs.get(game_id, {}), players)
        except Exception as e:
            first = next((line.strip() for line in str(e).splitlines() if any(c.isalnum() for c in line)), "")
            key = "game_kwargs" if game_id in config.game_kwargs else "games"
            who = "" if players == 1 else f" for {players} players"
            raise errors.ConfigError(
                f"server {server!r}: config.{key}: TextArena cannot start {game_id}{who} here: "
                f"{type(e).__name__}: {first}"
            ) from None


def start_game(config: TextArenaConfig, data: dict[str, Any], players: int) -> tuple[Game, str]:
    """The game a task row names, started from its seed, and its first observation; FailedPrecondition
    when TextArena cannot start it."""
    game_id, seed = game_of(config, data)
    try:
        return Game.start(game_id, seed, config.game_kwargs.get(game_id, {}), players)
    except Exception as e:
        raise errors.FailedPrecondition(
            f"TextArena could not start {game_id} with seed {seed}: {type(e).__name__}: {e}"
        ) from None


class GameStore:
    """The games being played, by session id (what SeedSession acquires and CloseSession releases)."""

    def __init__(self) -> None:
        self.live: dict[str, Game] = {}

    def release(self, session_id: str) -> None:
        game = self.live.pop(session_id, None)
        if game is not None and not game.done:
            with contextlib.suppress(Exception), _own_random(game.random_state):
                game.env.close()


class _TextArenaServer(ResourcesServer):
    """What both servers share: the games being played, each configured game started once at start, and
    a session's game released at close (and the idle time-out)."""

    #: Players a game is started for.
    players: ClassVar[int] = 1
    config: TextArenaConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.games = GameStore()

    async def start(self) -> None:
        await super().start()
        check_games(self.name, self.config, players=self.players)

    async def close_session(self, session: Session) -> None:
        self.games.release(session.id)


class TextArenaEnv(_TextArenaServer):
    verifier_fields = {
        "game": "the TextArena env id played",
        "seed": "the seed that dealt the game",
        "finished": "the game ended (else unfinished_reward applies)",
        "moves": "moves made",
        "reason": "why the game ended, as TextArena says",
        "invalid_move": "the game ended on an invalid move",
        "replayed": "the game was replayed from the response's moves (no open session at Verify)",
    }

    Config = TextArenaConfig
    config: TextArenaConfig

    def _start(self, session: Session) -> tuple[Game, str]:
        return start_game(self.config, session.data, players=1)

    async def seed_session(self, session: Session) -> None:
        game, _ = self._start(session)  # the row's prompt holds the first observation (task_rows)
        self.games.live[session.id] = game

    @tool
    async def move(
        self,
        action: Annotated[str, Field(description="Your move, as the game's instructions ask for it, e.g. '[10]'.")],
        session: Session,
    ) -> str:
        """Make your move in the game. The output is what the game says next."""
        game = self.games.live.get(session.id)
        if game is None:
            raise errors.FailedPrecondition(f"session {session.id!r} has no game", field="session_id")
        return game.move(action)

    def task_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Seeds 0 .. seeds-1 of each game (the first `limit` rows): the game's first observation
        as the user's message, and the move tool."""
        rows = []
        tools = self.tool_definitions()
        for seed in range(self.config.seeds):  # seed by seed, so that the first rows mix the games
            for game_id in self.config.games:
                game, first = Game.start(game_id, seed, self.config.game_kwargs.get(game_id, {}))
                prompt = f"{first}\n\nPlay by calling the move tool once per move; stop when the game is over."
                rows.append(
                    {
                        "responses_create_params": {"input": [{"role": "user", "content": prompt}], "tools": tools},
                        GAME_KEY: game_id,
                        SEED_KEY: seed,
                    }
                )
        return rows[:limit] if limit is not None else rows

    async def verify(self, session: Session, response: r.Response) -> Verification:
        game = self.games.live.get(session.id)
        replayed = game is None
        if game is None:
            game = self._replay(session, response)
        return Verification(
            reward=game.reward(self.config.unfinished_reward),
            fields={
                "game": game.game_id,
                "seed": game.seed,
                "finished": game.done,
                "moves": game.moves,
                "reason": game.info.get("reason"),
                "invalid_move": bool(game.info.get("invalid_move", False)),
                "replayed": replayed,
            },
        )

    def _replay(self, session: Session, response: r.Response) -> Game:
        """The game a response's moves leave, played again from the task's seed."""
        game, _ = self._start(session)
        for call in function_calls(response):
            if call.name != "move" or game.done:
                continue
            try:
                action = json.loads(call.arguments or "{}").get("action")
            except (ValueError, AttributeError):
                continue  # the call failed in the rollout too, and changed nothing
            if isinstance(action, str):
                game.move(action)
        return game


PLAYER = "player_{}"


class TextArenaDuelConfig(TextArenaConfig):
    games: list[str] = Field(
        min_length=1, description="TextArena env ids of two-player games this server plays; rows pick one"
    )


class TextArenaDuelEnv(_TextArenaServer):
    """TextArena's two-player games as episodes with two roles (docs/episodes.md).

    The roles are player_0 and player_1, each played by its own model (or one policy for both).
    A row's prompt is the instructions both players share; each turn shows the player to move what
    it has not seen yet (the game's prompt for it on its first turn, then the other player's move and
    the board), and its answer is its move, stepped into the game as TextArena's own agents do. The
    game says whose turn is next, so a player who moved wrongly and has tries left moves again.
    Verify gives each player the game's reward (1 win, -1 loss, 0 draw in the zero-sum games) and
    the episode player_0's; a game not over gets `unfinished_reward` for both."""

    verifier_fields = {
        "game": "the TextArena env id played",
        "seed": "the seed that dealt the game",
        "finished": "the game ended (else unfinished_reward applies)",
        "moves": "moves made, by both players",
        "reason": "why the game ended, as TextArena says",
        "invalid_move": "the game ended on an invalid move",
    }

    Config = TextArenaDuelConfig
    config: TextArenaDuelConfig
    players = 2

    async def seed_session(self, session: Session) -> Episode:
        game, first = start_game(self.config, session.data, players=2)
        self.games.live[session.id] = game
        return Episode(
            roles=[Role(PLAYER.format(0)), Role(PLAYER.format(1))], first=Turn(PLAYER.format(game.player), first)
        )

    async def end_turn(self, session: Session, role: str, response: r.Response) -> Turn | None:
        game = self.games.live.get(session.id)
        if game is None:
            raise errors.FailedPrecondition(f"session {session.id!r} has no game", field="session_id")
        with _own_random(game.random_state):
            game.done, _ = game.env.step(final_text(response).strip())
            game.moves += 1
            if game.done:
                rewards, game_info = game.env.close()
                game.rewards = dict(rewards or {})
                infos = [dict(info or {}) for info in (game_info or {}).values()]
                game.info = {
                    "reason": next((info["reason"] for info in infos if info.get("reason")), None),
                    "invalid_move": any(info.get("invalid_move") for info in infos),
                }
                return None
            shown = game.observe()
        return Turn(PLAYER.format(game.player), shown)

    def task_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Seeds 0 .. seeds-1 of each game (the first `limit` rows): the instructions both players share."""
        rows = []
        for seed in range(self.config.seeds):
            for game_id in self.config.games:
                rows.append(
                    {
                        "responses_create_params": {"input": [{"role": "system", "content": DUEL_INSTRUCTIONS}]},
                        GAME_KEY: game_id,
                        SEED_KEY: seed,
                    }
                )
        return rows[:limit] if limit is not None else rows

    async def verify(self, session: Session, response: r.Response) -> Verification:
        game = self.games.live.get(session.id)
        if game is None:
            raise errors.FailedPrecondition(
                f"session {session.id!r} has no game: a duel is scored from its open session (no replay)",
                field="session_id",
            )
        unfinished = self.config.unfinished_reward
        rewards = {
            PLAYER.format(p): float(game.rewards.get(p, unfinished)) if game.done and game.rewards else unfinished
            for p in (0, 1)
        }
        return Verification(
            reward=rewards[PLAYER.format(0)],
            role_rewards=rewards,
            fields={
                "game": game.game_id,
                "seed": game.seed,
                "finished": game.done,
                "moves": game.moves,
                "reason": game.info.get("reason"),
                "invalid_move": bool(game.info.get("invalid_move", False)),
            },
        )


DUEL_INSTRUCTIONS = (
    "You are one of the two players of a game. Each turn you are shown what happened since your last move. "
    "Answer with your move only, in the form the game asks for (for example [4])."
)
