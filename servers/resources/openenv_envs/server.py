"""An OpenEnv environment as a multi-turn environment, configured, not coded.

    servers:
      openenv:
        entrypoint: server.py:OpenEnvBridge
        config:
          url: http://127.0.0.1:8000          # an OpenEnv server that runs already, or:
          # command: [python, -m, uvicorn, my_env.server.app:app, --port, "0"]   # started as a child

Each rollout is one OpenEnv session over OpenEnv's per-session WebSocket (`/ws`), spoken by
gym-grpc itself (connection.py: the `openenv` package is not needed beside gym-grpc):

- SeedSession opens the session and resets it with the row's `openenv_seed` and `openenv_reset`
  (more keyword arguments of the env's `reset`, over the config's `reset_kwargs`). A server that cannot
  be reached fails the rollout at once with OPENENV_UNAVAILABLE naming it; so does one that stops
  answering (each message waits at most `message_timeout_seconds`), never a hang.
- An MCP environment's tools (an OpenEnv `MCPEnvironment`, whose action is `CallToolAction`: `tools: auto`
  sees it in the schema) are listed at start with OpenEnv's `list_tools` action and offered one by one,
  with their MCP names and input schemas; a call is the env's `call_tool` action, its output the MCP
  result's text, an MCP error the model's error output.
- Otherwise the model acts with one tool (`step`, or `tool_name`) whose parameters are the env's action JSON
  schema, read from the server's `GET /schema` (without OpenEnv's own `metadata` field). Its output is
  the observation as JSON, the step's reward, and `[episode over]` once the env says done. An action the
  env refuses (its validation, or an error while stepping) is the model's error, as an error output.
- Verify answers with the episode's return (`reward: sum`, the rewards of every step) or the last
  step's reward (`reward: last`, for envs that score at the end). Without an open session (reverify,
  or after the idle time-out) the response's step calls are replayed on a fresh session from the seed.
- CloseSession sends OpenEnv's close message and closes the socket: the server drops the session's env.

With `command`, the OpenEnv server is a child process of this server, started at start (its URL is the
one uvicorn prints, so `--port 0` is the way to run it) and stopped at stop. A command that exits or does
not listen within `start_timeout_seconds` is a ConfigError quoting what it printed. With `url`, a server
not up yet at start only logs a warning: each rollout then fails with OPENENV_UNAVAILABLE until it is.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from pydantic import Field, model_validator

from gym_grpc import errors
from gym_grpc.data.rows import params_to_json
from gym_grpc.resources import ResourcesConfig, ResourcesServer, Session, Verification, tool_arguments, unknown_tool
from gym_grpc.responses import function_calls
from gym_grpc.v1 import responses_pb2 as r

from .connection import EnvSession, OpenEnvError, ServerProcess, fetch_schema, unavailable

log = logging.getLogger("gym_grpc.openenv_envs")

SEED_KEY = "openenv_seed"
RESET_KEY = "openenv_reset"
#: Before the server is reached, the tool's parameters are unknown: any object (the server checks it).
_ANY_ACTION: dict[str, Any] = {"type": "object"}


class OpenEnvConfig(ResourcesConfig):
    url: str | None = Field(None, description="the base URL of a running OpenEnv server (http://host:port)")
    command: list[str] | None = Field(
        None, min_length=1, description="a command that starts the OpenEnv server (uvicorn ... --port 0), a child"
    )
    env: dict[str, str] = Field(default_factory=dict, description="environment variables for the command")
    cwd: str | None = Field(None, description="the command's working directory; default: this server's")
    start_timeout_seconds: float = Field(120.0, gt=0, description="most time for the command's server to listen")
    connect_timeout_seconds: float = Field(10.0, gt=0, description="most time to open a session (or read /schema)")
    message_timeout_seconds: float = Field(
        120.0, gt=0, description="most time for one reset or step: longer fails the rollout, named"
    )
    tools: Literal["auto", "step", "mcp"] = Field(
        "auto",
        description="step: one tool taking the env's action; mcp: an MCP env's own tools, one by one; auto: mcp "
        "when the action is OpenEnv's CallToolAction, else step",
    )
    tool_name: str = Field("step", min_length=1, description="the name of the model's tool that steps the env")
    tool_description: str | None = Field(None, description="the tool's description; default: the action's own")
    reward: Literal["sum", "last"] = Field(
        "sum", description="Verify's reward: the sum of the step rewards (the return), or the last step's reward"
    )
    reset_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of every reset (a row's openenv_reset adds to them)"
    )
    seeds: int = Field(10, ge=1, description="task_rows writes seeds 0 .. seeds-1")
    instructions: str = Field(
        "You act in an OpenEnv environment through its tools, one call per action; stop when the episode is over.",
        description="task_rows' prompt, before the first observation",
    )

    @model_validator(mode="after")
    def _one_way_in(self) -> OpenEnvConfig:
        given = [key for key in ("url", "command") if getattr(self, key)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of url and command (got {', '.join(given) or 'neither'})")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url: {self.url!r} is not an http:// or https:// URL")
        if self.url is not None and (self.env or self.cwd):
            raise ValueError("env, cwd: only for a command, not a url")
        return self


@dataclass
class Episode:
    """One rollout's OpenEnv session and how it went."""

    session: EnvSession
    seed: int | None
    rewards: list[float] = field(default_factory=list)
    done: bool = False

    def score(self, how: str) -> float:
        if not self.rewards:
            return 0.0
        return self.rewards[-1] if how == "last" else sum(self.rewards)


def _reward(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def described(data: dict[str, Any]) -> str:
    """An observation frame's data as the model reads it: the observation's fields as JSON (OpenEnv's
    empty `metadata` left out), then the step's reward."""
    observation = dict(data.get("observation") or {})
    if not observation.get("metadata"):
        observation.pop("metadata", None)
    text = json.dumps(observation, ensure_ascii=False)
    reward = _reward(data.get("reward"))
    return text if reward is None else f"{text}\nreward: {reward:g}"


def is_mcp_action(action: dict[str, Any]) -> bool:
    """Whether an action schema is OpenEnv's CallToolAction (an MCPEnvironment's): `type` is "call_tool"."""
    kind = (action.get("properties") or {}).get("type")
    return isinstance(kind, dict) and kind.get("const") == "call_tool"


def mcp_output(data: dict[str, Any]) -> str:
    """A CallToolObservation's frame as the model reads it: the MCP result's text (else the result as JSON),
    then the reward if the env gave one. A tool's error (MCP's isError, or OpenEnv's `error`) raises
    ToolFailed with it, for the model."""
    observation = data.get("observation") or {}
    error = observation.get("error")
    if isinstance(error, dict) and error:
        raise errors.ToolFailed(f"{error.get('error_type', 'error')}: {error.get('message', '')}")
    result = observation.get("result")
    content = result.get("content") if isinstance(result, dict) else None
    if isinstance(content, list) and all(isinstance(c, dict) for c in content):
        text = "\n".join(
            str(c.get("text", "")) if c.get("type") == "text" else f"[{c.get('type', 'content')} content, not shown]"
            for c in content
        )
        if isinstance(result, dict) and result.get("is_error"):
            raise errors.ToolFailed(text)
    else:
        text = json.dumps(result, ensure_ascii=False)
    reward = _reward(data.get("reward"))
    return text if reward is None else f"{text}\nreward: {reward:g}"


def action_tool_schema(action: dict[str, Any]) -> dict[str, Any]:
    """The env's action schema as a tool's parameters: OpenEnv's `metadata` field (every Action has it, for
    the framework, not the policy) taken out."""
    schema = copy.deepcopy(action)
    schema.pop("title", None)
    schema.pop("description", None)
    properties = schema.get("properties")
    if isinstance(properties, dict):
        properties.pop("metadata", None)
    if isinstance(schema.get("required"), list):
        schema["required"] = [name for name in schema["required"] if name != "metadata"]
    return schema


class OpenEnvBridge(ResourcesServer):
    """An OpenEnv environment (a server of the openenv package) behind gym-grpc's ResourcesService."""

    Config = OpenEnvConfig
    config: OpenEnvConfig
    verifier_fields = {
        "seed": "the seed the episode was reset with (null: none)",
        "steps": "steps the env took (actions it refused not counted)",
        "done": "the env said the episode is over",
        "last_reward": "the last step's reward",
        "replayed": "the episode was replayed from the response's steps (no open session at Verify)",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stateless = False
        self.episodes: dict[str, Episode] = {}
        self.base_url = self.config.url or ""
        self.process: ServerProcess | None = None
        self.schema: dict[str, Any] | None = None
        #: An MCP env's tools (name -> OpenEnv's tool: name, description, input_schema); None: not one, or not
        #: listed yet.
        self.mcp_tools: dict[str, dict[str, Any]] | None = None
        self._http: aiohttp.ClientSession | None = None

    # --- the OpenEnv server ---------------------------------------------------------------

    async def _reach(self) -> None:
        """Start the command's server (if any) and read the action schema. A command's server that cannot
        serve is a ConfigError; a url's that cannot be reached yet is only logged (rollouts fail, named)."""
        self._http = aiohttp.ClientSession()
        if self.config.command:
            self.process = ServerProcess(self.config.command, self.config.env, self.config.cwd)
            self.base_url = await self.process.start(self.config.start_timeout_seconds)
            log.info("server %r: OpenEnv server %s started (pid %s)", self.name, self.base_url, self.process_pid)
        try:
            await self._describe()
        except errors.Unavailable as e:
            if self.process is not None:
                raise errors.ConfigError(f"config.command: {e.message}") from None
            log.warning("server %r: %s; its rollouts fail until it answers", self.name, e.message)

    async def _describe(self) -> None:
        """Read the action schema and, for an MCP env, list its tools (on a session of their own; OpenEnv lists
        them without a reset)."""
        assert self._http is not None
        schema = await fetch_schema(self._http, self.base_url, self.config.connect_timeout_seconds)
        mcp = self.config.tools == "mcp" or (self.config.tools == "auto" and is_mcp_action(schema["action"]))
        if mcp:
            session = await EnvSession.open(
                self._http, self.base_url, self.config.connect_timeout_seconds, self.config.message_timeout_seconds
            )
            try:
                frame = await session.ask({"type": "step", "data": {"type": "list_tools"}})
            except OpenEnvError as e:
                raise errors.ConfigError(
                    f"config.tools: OpenEnv server {self.base_url} did not list tools: {e}"
                ) from None
            finally:
                await session.close()
            observation = frame.get("observation") or {}
            listed = observation.get("tools")
            if not isinstance(listed, list) or (observation.get("metadata") or {}).get("error"):
                why = (observation.get("metadata") or {}).get("error") or "no tools in its answer"
                raise errors.ConfigError(f"config.tools: OpenEnv server {self.base_url} did not list tools: {why}")
            self.mcp_tools = {t["name"]: t for t in listed if isinstance(t, dict) and isinstance(t.get("name"), str)}
        self.schema = schema

    @property
    def process_pid(self) -> int | None:
        return self.process.process.pid if self.process and self.process.process else None

    async def _release(self) -> None:
        for session_id in list(self.episodes):
            episode = self.episodes.pop(session_id)
            await episode.session.close()
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self.process is not None:
            await self.process.stop()

    async def start(self) -> None:
        try:
            await self._reach()
        except BaseException:
            await self._release()
            raise
        await super().start()

    async def stop(self) -> None:
        try:
            await super().stop()  # closes the open sessions (close_session)
        finally:
            await self._release()

    def _unavailable(self, error: errors.Unavailable) -> errors.Unavailable:
        """`error`, or why the command's server is gone when it is (its exit status and last output)."""
        why = self.process.exited() if self.process is not None else None
        return unavailable(self.base_url, why) if why else error

    async def _open(self, seed: int | None, reset: dict[str, Any]) -> tuple[Episode, dict[str, Any]]:
        """A new session, reset: the episode and the reset's observation frame."""
        if self._http is None:
            raise errors.FailedPrecondition(f"server {self.name!r} has not started")
        if self.schema is None:  # a url's server that was down at start: ask again
            await self._describe()
        try:
            session = await EnvSession.open(
                self._http, self.base_url, self.config.connect_timeout_seconds, self.config.message_timeout_seconds
            )
        except errors.Unavailable as e:
            raise self._unavailable(e) from None
        data = {**self.config.reset_kwargs, **reset, **({"seed": seed} if seed is not None else {})}
        try:
            frame = await session.ask({"type": "reset", "data": data})
        except OpenEnvError as e:
            await session.close()
            if e.code == "CAPACITY_REACHED":
                raise errors.ResourceExhausted(
                    f"OpenEnv server {self.base_url} has no room for another session: {e} (its max_concurrent_envs)"
                ) from None
            raise errors.FailedPrecondition(f"OpenEnv server {self.base_url}: reset failed: {e}") from None
        except BaseException:
            await session.close(polite=False)
            raise
        episode = Episode(session, seed, done=bool(frame.get("done")))
        return episode, frame

    # --- sessions and tools ---------------------------------------------------------------

    def _reset_args(self, data: dict[str, Any]) -> tuple[int | None, dict[str, Any]]:
        seed = data.get(SEED_KEY)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
            raise errors.TaskDataError(SEED_KEY, f"must be a whole number, 0 or more, got {seed!r}")
        reset = data.get(RESET_KEY, {})
        if not isinstance(reset, dict):
            raise errors.TaskDataError(RESET_KEY, f"must be an object of reset's keyword arguments, got {reset!r}")
        return seed, reset

    async def seed_session(self, session: Session) -> None:
        seed, reset = self._reset_args(session.data)
        episode, _ = await self._open(seed, reset)  # the row's prompt holds the first observation
        self.episodes[session.id] = episode

    async def close_session(self, session: Session) -> None:
        episode = self.episodes.pop(session.id, None)
        if episode is not None:
            await episode.session.close()

    def tool_schemas(self) -> list[r.FunctionTool]:
        if self.mcp_tools is not None:
            return [
                r.FunctionTool(
                    name=name,
                    description=str(t.get("description") or ""),
                    parameters_json=json.dumps(t.get("input_schema") or {"type": "object"}),
                )
                for name, t in self.mcp_tools.items()
            ]
        action = self.schema["action"] if self.schema else None
        description = (
            self.config.tool_description
            or (action or {}).get("description")
            or ("Take one action in the environment. The output is the next observation and the step's reward.")
        )
        parameters = action_tool_schema(action) if action else _ANY_ACTION
        return [
            r.FunctionTool(name=self.config.tool_name, description=description, parameters_json=json.dumps(parameters))
        ]

    def _action(self, name: str, arguments: str) -> dict[str, Any]:
        """The OpenEnv action a tool call is: the arguments themselves (the step tool), or an MCP env's
        CallToolAction."""
        if self.mcp_tools is not None:
            if name not in self.mcp_tools:
                raise unknown_tool(name, self.mcp_tools)
            return {"type": "call_tool", "tool_name": name, "arguments": tool_arguments(name, arguments)}
        if name != self.config.tool_name:
            raise unknown_tool(name, [self.config.tool_name])
        return tool_arguments(name, arguments)

    async def call_tool(self, session: Session, name: str, arguments: str) -> str | list[r.ContentPart]:
        action = self._action(name, arguments)
        episode = self.episodes.get(session.id)
        if episode is None:
            raise errors.FailedPrecondition(f"session {session.id!r} has no OpenEnv session", field="session_id")
        return await self._step(episode, action)

    async def _step(self, episode: Episode, action: dict[str, Any]) -> str:
        if episode.done:
            raise errors.ToolFailed("the episode is over; answer without acting")
        try:
            frame = await episode.session.ask({"type": "step", "data": action})
        except OpenEnvError as e:  # the env refused the action or failed on it: the model reads why
            raise errors.ToolFailed(f"the environment refused the action: {e}") from None
        except errors.Unavailable as e:
            raise self._unavailable(e) from None
        reward = _reward(frame.get("reward"))
        episode.rewards.append(reward or 0.0)
        episode.done = bool(frame.get("done"))
        said = mcp_output(frame) if self.mcp_tools is not None else described(frame)
        if episode.done:
            said += f"\n[episode over] return {episode.score(self.config.reward):g}"
        return said

    # --- verify -----------------------------------------------------------------------------

    async def verify(self, session: Session, response: r.Response) -> Verification:
        episode = self.episodes.get(session.id)
        replayed = episode is None
        if episode is None:
            episode = await self._replay(session, response)
        return Verification(
            reward=episode.score(self.config.reward),
            fields={
                "seed": episode.seed,
                "steps": len(episode.rewards),
                "done": episode.done,
                "last_reward": episode.rewards[-1] if episode.rewards else None,
                "replayed": replayed,
            },
        )

    async def _replay(self, session: Session, response: r.Response) -> Episode:
        """The episode a response's step calls make, played again on a new session from the task's seed."""
        seed, reset = self._reset_args(session.data)
        episode, _ = await self._open(seed, reset)
        try:
            for call in function_calls(response):
                if episode.done:
                    break
                try:
                    await self._step(episode, self._action(call.name, call.arguments))
                except (errors.ToolFailed, errors.InvalidArgument, errors.NotFound):
                    continue  # it failed in the rollout too, and changed nothing
        finally:
            await episode.session.close()
        return episode

    # --- task rows ---------------------------------------------------------------------------

    def task_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Seeds 0 .. seeds-1 (the first `limit`): the instructions and the reset's observation as the user's
        message, and the step tool. Reaches the server (starting the command's) to reset each seed."""
        found: list[list[dict[str, Any]]] = []
        failed: list[BaseException] = []

        def run() -> None:  # its own event loop, wherever this is called from
            try:
                found.append(asyncio.run(self._task_rows(limit)))
            except BaseException as e:
                failed.append(e)

        thread = threading.Thread(target=run, name="openenv-task-rows")
        thread.start()
        thread.join()
        if failed:
            raise failed[0]
        return found[0]

    async def _task_rows(self, limit: int | None) -> list[dict[str, Any]]:
        await self._reach()
        try:
            if self.schema is None:
                raise errors.ConfigError(f"config.url: OpenEnv server {self.base_url} does not answer")
            tools = params_to_json(r.CreateParams(tools=[r.Tool(function=t) for t in self.tool_schemas()]))["tools"]
            rows = []
            for seed in range(self.config.seeds if limit is None else min(limit, self.config.seeds)):
                episode, frame = await self._open(seed, {})
                await episode.session.close()
                prompt = f"{self.config.instructions}\n\n{described(frame)}"
                rows.append(
                    {
                        "responses_create_params": {"input": [{"role": "user", "content": prompt}], "tools": tools},
                        SEED_KEY: seed,
                    }
                )
            return rows
        finally:
            await self._release()
