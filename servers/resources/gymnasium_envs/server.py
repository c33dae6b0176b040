"""Gymnasium environments as a multi-turn environment, configured, not coded.

    servers:
      gymnasium:
        entrypoint: server.py:GymnasiumEnv
        config:
          envs: [FrozenLake-v1, CliffWalking-v1]          # registered Gymnasium ids
          env_kwargs: {FrozenLake-v1: {is_slippery: false}}
          seeds: 20                                       # task rows: seeds 0..19 of each env

Each rollout is one episode of a real `gymnasium.Env` (`gymnasium.make`), made text:

- SeedSession makes the row's env (`gymnasium_env`, one of `envs`; default the first) and resets it
  with the row's `gymnasium_seed`. The observation the model reads is the env's own text rendering
  (`render_mode="ansi"`, as FrozenLake, CliffWalking and Taxi draw their grids) when it has one,
  followed by the observation itself as JSON (numpy values as lists and numbers).
- The model acts with the tool `step(action)`: an action of the env's `Discrete` action space (its
  actions are integers from `start` to `start + n - 1`). The output is the next observation, the
  step's reward, and whether the episode ended (terminated, or truncated by the env's time limit). A
  step after the end is the model's error, not the rollout's.
- Verify answers with the episode's return (the sum of its rewards); an episode still running keeps
  the return so far. Without an open session (reverify) it replays the response's `step` calls on a
  fresh env from the task's seed.

Envs whose action space is not `Discrete` are refused at start with a ConfigError naming the space
(an action the model must type as a float vector is not a tool call this bridge offers).
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, field_validator

from gym_grpc import errors
from gym_grpc.resources import ResourcesConfig, ResourcesServer, Session, Verification, tool
from gym_grpc.responses import function_calls
from gym_grpc.v1 import responses_pb2 as r

try:
    import gymnasium
except ImportError as e:  # pragma: no cover - the extra's own message
    raise ImportError(
        f"the gymnasium_envs environment needs Gymnasium ({e.name}): pip install 'gym-grpc[gymnasium]'", name=e.name
    ) from e

_HIGHLIGHT = re.compile(r"\x1b\[4\dm(.*?)\x1b\[0m")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
ENV_KEY = "gymnasium_env"
SEED_KEY = "gymnasium_seed"


class GymnasiumConfig(ResourcesConfig):
    envs: list[str] = Field(min_length=1, description="registered Gymnasium env ids this server runs; rows pick one")
    env_kwargs: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="per env id, arguments passed to gymnasium.make"
    )
    seeds: int = Field(20, ge=1, description="task_rows writes seeds 0 .. seeds-1 of each env")
    action_meanings: dict[str, list[str]] = Field(
        default_factory=dict, description="per env id, what each action does, in order (the prompt lists them)"
    )

    @field_validator("envs")
    @classmethod
    def _registered(cls, envs: list[str]) -> list[str]:
        for env_id in envs:
            if env_id not in gymnasium.registry:
                near = difflib.get_close_matches(env_id, list(gymnasium.registry), n=1, cutoff=0.6)
                hint = f"did you mean {near[0]!r}?" if near else "Gymnasium's ids are like 'FrozenLake-v1'"
                raise ValueError(f"Gymnasium has no env {env_id!r} ({hint})")
        return envs

    @field_validator("env_kwargs", "action_meanings")
    @classmethod
    def _for_served_envs(cls, kwargs: dict[str, Any], info: Any) -> dict[str, Any]:
        stray = [env_id for env_id in kwargs if env_id not in (info.data.get("envs") or [])]
        if stray:
            raise ValueError(f"{info.field_name} for {', '.join(map(repr, stray))}, which is not in envs")
        return kwargs


def _jsonable(value: Any) -> Any:
    """An observation as JSON data: numpy arrays as lists, numpy numbers as numbers, tuples and dicts kept."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_jsonable(v) for v in value]
    return value


@dataclass
class Episode:
    """One rollout's episode: the env and how it went."""

    env_id: str
    seed: int
    env: Any
    observation: Any = None
    steps: int = 0
    total: float = 0.0
    terminated: bool = False
    truncated: bool = False

    @classmethod
    def start(cls, env_id: str, seed: int, kwargs: dict[str, Any]) -> Episode:
        env = gymnasium.make(env_id, render_mode="ansi" if _draws_text(env_id) else None, **kwargs)
        episode = cls(env_id, seed, env)
        episode.observation, _ = env.reset(seed=seed)
        return episode

    @property
    def ended(self) -> bool:
        return self.terminated or self.truncated

    def describe(self) -> str:
        """The observation as the model reads it: the env's drawing (if it draws text), then the value."""
        drawing = self.env.render() if self.env.render_mode == "ansi" else None
        value = f"observation: {json.dumps(_jsonable(self.observation))}"
        if not isinstance(drawing, str) or not drawing.strip():
            return value
        # Terminal colours mark the agent (FrozenLake): brackets instead, then no escape codes at all.
        drawing = _ANSI.sub("", _HIGHLIGHT.sub(r"[\1]", drawing))
        return f"{drawing.strip(chr(10))}\n{value}"

    def step(self, action: int) -> str:
        if self.ended:
            raise ValueError("the episode is over; answer without acting")
        space = self.env.action_space
        if not space.contains(space.dtype.type(action)):
            raise ValueError(f"action {action} is not in the action space {space}")
        self.observation, reward, self.terminated, self.truncated, _ = self.env.step(action)
        self.steps += 1
        self.total += float(reward)
        said = f"{self.describe()}\nreward: {float(reward):g}"
        if self.ended:
            how = "terminated" if self.terminated else "truncated (time limit)"
            said += f"\n[episode over] {how}; return {self.total:g}"
        return said


@functools.cache
def _draws_text(env_id: str) -> bool:
    """Whether the env renders itself as text (render_mode "ansi"), by its class's metadata."""
    env = gymnasium.make(env_id)
    try:
        return "ansi" in (env.metadata.get("render_modes") or [])
    finally:
        env.close()


def episode_of(config: GymnasiumConfig, data: dict[str, Any]) -> tuple[str, int]:
    """The (env id, seed) a task row names; TaskDataError naming the key otherwise."""
    env_id = data.get(ENV_KEY, config.envs[0])
    if env_id not in config.envs:
        raise errors.TaskDataError(ENV_KEY, f"{env_id!r} is not an env of this server ({', '.join(config.envs)})")
    seed = data.get(SEED_KEY, 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise errors.TaskDataError(SEED_KEY, f"must be a whole number, got {seed!r}")
    return env_id, seed


class GymnasiumEnv(ResourcesServer):
    verifier_fields = {
        "env": "the Gymnasium env id",
        "seed": "the seed the episode was reset with",
        "steps": "steps taken",
        "terminated": "the episode reached a terminal state",
        "truncated": "the episode was cut by the env's time limit",
        "replayed": "the episode was replayed from the response's steps (no open session at Verify)",
    }

    Config = GymnasiumConfig
    config: GymnasiumConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.episodes: dict[str, Episode] = {}
        for env_id in self.config.envs:  # an env that cannot run here stops the server, named
            try:
                episode = Episode.start(env_id, 0, self.config.env_kwargs.get(env_id, {}))
            except Exception as e:
                key = "env_kwargs" if env_id in self.config.env_kwargs else "envs"
                raise errors.ConfigError(
                    f"config.{key}: Gymnasium cannot make {env_id}: {type(e).__name__}: {e}"
                ) from None
            space = episode.env.action_space
            episode.env.close()
            if not isinstance(space, gymnasium.spaces.Discrete):
                raise errors.ConfigError(
                    f"config.envs: {env_id}'s action space is {space}: this bridge offers Discrete action spaces only"
                )

    def _start(self, session: Session) -> Episode:
        env_id, seed = episode_of(self.config, session.data)
        return Episode.start(env_id, seed, self.config.env_kwargs.get(env_id, {}))

    async def seed_session(self, session: Session) -> None:
        self.episodes[session.id] = self._start(session)  # the row's prompt holds the first observation

    async def close_session(self, session: Session) -> None:
        episode = self.episodes.pop(session.id, None)
        if episode is not None:
            episode.env.close()

    @tool
    async def step(
        self,
        action: Annotated[int, Field(description="The action, an integer of the env's action space.")],
        session: Session,
    ) -> str:
        """Take one action in the environment. The output is the next observation, the reward, and whether the
        episode is over."""
        episode = self.episodes.get(session.id)
        if episode is None:
            raise errors.FailedPrecondition(f"session {session.id!r} has no episode", field="session_id")
        return episode.step(action)

    def task_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Seeds 0 .. seeds-1 of each env (the first `limit` rows): the env, its actions and its first
        observation as the user's message, and the step tool."""
        rows = []
        tools = self.tool_definitions()
        for seed in range(self.config.seeds):
            for env_id in self.config.envs:
                episode = Episode.start(env_id, seed, self.config.env_kwargs.get(env_id, {}))
                space = episode.env.action_space
                actions = f"integers {space.start} to {space.start + space.n - 1}"
                meanings = self.config.action_meanings.get(env_id)
                if meanings:
                    actions += " (" + ", ".join(f"{space.start + i}: {m}" for i, m in enumerate(meanings)) + ")"
                prompt = (
                    f"You act in the Gymnasium environment {env_id}. Its actions are the {actions}.\n\n"
                    f"{episode.describe()}\n\nAct by calling the step tool once per action; stop when the episode "
                    "is over."
                )
                episode.env.close()
                rows.append(
                    {
                        "responses_create_params": {"input": [{"role": "user", "content": prompt}], "tools": tools},
                        ENV_KEY: env_id,
                        SEED_KEY: seed,
                    }
                )
        return rows[:limit] if limit is not None else rows

    async def verify(self, session: Session, response: r.Response) -> Verification:
        episode = self.episodes.get(session.id)
        replayed = episode is None
        if episode is None:
            episode = self._replay(session, response)
        return Verification(
            reward=episode.total,
            fields={
                "env": episode.env_id,
                "seed": episode.seed,
                "steps": episode.steps,
                "terminated": episode.terminated,
                "truncated": episode.truncated,
                "replayed": replayed,
            },
        )

    def _replay(self, session: Session, response: r.Response) -> Episode:
        """The episode a response's steps leave, played again from the task's seed."""
        episode = self._start(session)
        try:
            for call in function_calls(response):
                if call.name != "step" or episode.ended:
                    continue
                try:
                    episode.step(json.loads(call.arguments or "{}").get("action"))
                except (ValueError, AttributeError, TypeError):
                    continue  # the call failed in the rollout too, and changed nothing
        finally:
            episode.env.close()
        return episode
