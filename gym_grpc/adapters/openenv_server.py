"""A gym-grpc resources server served to OpenEnv clients: OpenEnv's HTTP/WebSocket protocol in front of it.

    python -m gym_grpc.adapters.openenv_server --registry 127.0.0.1:50050 --resources weather \\
        --tasks servers/resources/weather/data/example.jsonl --port 8000

Then OpenEnv's own client code (`openenv.core.GenericEnvClient`, or an `EnvClient` subclass, as TRL
uses it) plays the environment at http://127.0.0.1:8000, with nothing of gym-grpc installed beside it:

    with GenericEnvClient(base_url="http://127.0.0.1:8000").sync() as env:
        first = env.reset(task_index=0)      # first.observation: the task's prompt and tools
        out = env.step({"tool_name": "get_weather", "arguments": {"city": "Paris"}})
        end = env.step({"answer": "It is 21 C in Paris."})   # end.reward: Verify's reward; end.done

The wire is OpenEnv 0.10's (openenv.core.env_server.http_server): `GET /health`, `GET /metadata`,
`GET /schema` and the per-session WebSocket `/ws`, each connection one session, with `reset`, `step`,
`state` and `close` messages answered by `observation`, `state` and `error` frames. Served with aiohttp,
which gym-grpc already has; the `openenv` package is not needed on this side.

- **reset** picks a task row of `--tasks`: `task_index` (0-based), else `seed` modulo the number of rows,
  else the next row in turn. It opens a gym-grpc session for it (SeedSession, with a session id of its
  own, `episode_id` when the client gives one) and answers the observation `{"prompt": the row's input
  (a string, or its messages), "tools": the tools the row offers (else the server's), "task_index"}`.
  Another reset on the same connection closes the previous session first.
- **step** with `{"tool_name": ..., "arguments": {...}}` is a tool call (CallTool): the observation is
  `{"tool_name", "output", "error"}` (a tool's error is the model's, `error: true`), reward null, not done.
  A step with `{"answer": "..."}` ends the episode: the tool calls, their outputs and the answer as an
  assistant message make the response Verify scores; the observation is `{"answer", "fields"}` (the
  verifier's fields), the reward Verify's reward, done. The gym-grpc session is closed then. An action
  that is neither (OpenEnv's typed clients add `metadata`, which is allowed) is a VALIDATION_ERROR frame.
- **close**, or the connection ending, closes the session.

Not served: OpenEnv's HTTP `POST /reset` and `/step` (stateless in OpenEnv: a fresh env per request, no
episode across calls), its `/mcp` endpoint and MCP messages, and its web interface.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from gym_grpc import errors
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import jsonl
from gym_grpc.data import rows as row_format
from gym_grpc.responses import assistant_message, new_id
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

log = logging.getLogger("gym_grpc.openenv_server")

#: The action: a tool call, or the final answer (OpenEnv's typed actions also carry `metadata`).
ACTION_SCHEMA: dict[str, Any] = {
    "title": "GymGrpcAction",
    "description": "A tool call ({tool_name, arguments}) or the final answer ({answer}), which ends the episode "
    "and is scored by the environment's verifier.",
    "type": "object",
    "properties": {
        "tool_name": {"type": "string", "description": "The tool to call (one of the reset observation's tools)."},
        "arguments": {"type": "object", "description": "The tool's arguments, as its parameters schema says."},
        "answer": {"type": "string", "description": "The final answer: ends the episode; the reward is its score."},
        "metadata": {"type": "object", "description": "OpenEnv's action metadata (ignored)."},
    },
    "additionalProperties": False,
}
OBSERVATION_SCHEMA: dict[str, Any] = {
    "title": "GymGrpcObservation",
    "type": "object",
    "properties": {
        "prompt": {"description": "At reset: the task's input, a string or a list of messages."},
        "tools": {"type": "array", "description": "At reset: the tools, as function tool definitions."},
        "task_index": {"type": "integer", "description": "At reset: the task row's index."},
        "tool_name": {"type": "string", "description": "After a tool call: the tool called."},
        "output": {"type": "string", "description": "After a tool call: its output."},
        "error": {"type": "boolean", "description": "After a tool call: the output is the tool's error."},
        "answer": {"type": "string", "description": "After the answer: the answer scored."},
        "fields": {"type": "object", "description": "After the answer: the verifier's fields."},
    },
}
STATE_SCHEMA: dict[str, Any] = {
    "title": "GymGrpcState",
    "type": "object",
    "properties": {
        "episode_id": {"type": ["string", "null"]},
        "step_count": {"type": "integer"},
        "task_index": {"type": ["integer", "null"]},
        "done": {"type": "boolean"},
    },
}


class _ActionError(ValueError):
    """An action or reset the client sent that cannot be run: OpenEnv's VALIDATION_ERROR."""


@dataclass
class Episode:
    """One connection's current task, its gym-grpc session and what happened in it."""

    session_id: str
    task_index: int
    task: task_pb2.Task
    items: list[r.Item] = field(default_factory=list)
    steps: int = 0
    done: bool = False
    closed: bool = False


def _observation(observation: dict[str, Any], reward: float | None = None, done: bool = False) -> dict[str, Any]:
    return {"type": "observation", "data": {"observation": observation, "reward": reward, "done": done}}


def _error(message: str, code: str) -> dict[str, Any]:
    return {"type": "error", "data": {"message": message, "code": code}}


def _whole_number(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise _ActionError(f"reset: {key} must be a whole number, 0 or more, got {value!r}")
    return value


class OpenEnvFront:
    """OpenEnv's server protocol in front of the resources server `resources` reaches, for the task `rows`."""

    def __init__(self, resources: ResourcesClient, rows: list[dict[str, Any]], *, name: str = "") -> None:
        if not rows:
            raise errors.ConfigError("--tasks: no task rows to serve")
        self.resources = resources
        self.rows = rows
        self.tasks = [row_format.task_from_row(row) for row in rows]
        self.name = name or resources.name
        self._turn = itertools.cycle(range(len(rows)))
        self._server_tools: list[dict[str, Any]] | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""
        #: Connections being served; `drained()` waits for none (their sessions closed).
        self.connections = 0
        self._changed = asyncio.Condition()

    # --- serving ----------------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/metadata", self._metadata)
        app.router.add_get("/schema", self._schema)
        app.router.add_get("/ws", self._session)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on host:port (0: a free port, read back); the base URL."""
        self._runner = web.AppRunner(self.app(), handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = self._runner.addresses[0]
        self.url = f"http://{host}:{bound[1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()  # closes the open WebSockets, whose handlers close their sessions
            self._runner = None

    async def drained(self) -> None:
        """Wait until no connection is being served: every session a client opened is closed."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.connections == 0)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "healthy"})

    async def _metadata(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "name": self.name,
                "description": f"the gym-grpc resources server {self.resources.name!r}, {len(self.rows)} tasks",
                "readme_content": None,
                "version": None,
                "author": None,
                "documentation_url": None,
            }
        )

    async def _schema(self, request: web.Request) -> web.Response:
        return web.json_response({"action": ACTION_SCHEMA, "observation": OBSERVATION_SCHEMA, "state": STATE_SCHEMA})

    async def _session(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=100 * 1024 * 1024)
        await ws.prepare(request)
        episode: Episode | None = None
        self.connections += 1
        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    continue
                try:
                    sent = json.loads(message.data)
                except ValueError as e:
                    await ws.send_json(_error(f"Invalid JSON: {e}", "INVALID_JSON"))
                    continue
                kind = sent.get("type") if isinstance(sent, dict) else None
                if kind == "close":
                    break
                data = sent.get("data") if isinstance(sent, dict) else None
                try:
                    if kind == "reset":
                        if episode is not None:
                            await self._close(episode)
                        episode, answer = await self._reset(data if isinstance(data, dict) else {})
                    elif kind == "step":
                        answer = await self._step(episode, data)
                    elif kind == "state":
                        answer = {"type": "state", "data": self._state(episode)}
                    else:
                        answer = _error(f"Unknown message type: {kind}", "UNKNOWN_TYPE")
                except _ActionError as e:
                    answer = _error(str(e), "VALIDATION_ERROR")
                except errors.FrameworkError as e:  # the resources server's (or the registry's) error, named
                    answer = _error(str(e), "EXECUTION_ERROR")
                await ws.send_json(answer)
        finally:
            try:
                if episode is not None:
                    await self._close(episode)
            finally:
                async with self._changed:
                    self.connections -= 1
                    self._changed.notify_all()
        return ws

    # --- the episode ------------------------------------------------------------------------------

    async def _reset(self, data: dict[str, Any]) -> tuple[Episode, dict[str, Any]]:
        index = _whole_number(data, "task_index")
        seed = _whole_number(data, "seed")
        if index is not None and index >= len(self.rows):
            raise _ActionError(f"reset: task_index {index} is out of range (there are {len(self.rows)} tasks)")
        if index is None:
            index = seed % len(self.rows) if seed is not None else next(self._turn)
        episode_id = data.get("episode_id")
        session_id = str(episode_id) if episode_id else uuid.uuid4().hex
        task = self.tasks[index]
        await self.resources.seed_session(session_id, task)
        episode = Episode(session_id, index, task)
        params = self.rows[index].get("responses_create_params") or {}
        tools = params.get("tools") or await self._tools()
        return episode, _observation({"prompt": params.get("input"), "tools": tools, "task_index": index})

    async def _tools(self) -> list[dict[str, Any]]:
        """The server's own tools (DescribeTools), for rows that do not list theirs."""
        if self._server_tools is None:
            described = await self.resources.describe_tools()
            self._server_tools = row_format.params_to_json(
                r.CreateParams(tools=[r.Tool(function=t) for t in described.tools])
            ).get("tools", [])
        return self._server_tools

    async def _step(self, episode: Episode | None, action: Any) -> dict[str, Any]:
        if episode is None:
            raise _ActionError("step before reset: reset first")
        if not isinstance(action, dict):
            raise _ActionError(f"step: the action must be an object, got {type(action).__name__}")
        unknown = sorted(set(action) - set(ACTION_SCHEMA["properties"]))
        if unknown:
            raise _ActionError(
                f"step: unknown action field(s) {', '.join(map(repr, unknown))} (tool_name, arguments, answer)"
            )
        if ("tool_name" in action) == ("answer" in action):
            raise _ActionError("step: give either tool_name (with arguments) or answer")
        if episode.done:
            raise _ActionError("the episode is over: reset for another")
        episode.steps += 1
        if "answer" in action:
            return await self._answer(episode, action["answer"])
        return await self._call(episode, action["tool_name"], action.get("arguments", {}))

    async def _call(self, episode: Episode, name: Any, arguments: Any) -> dict[str, Any]:
        if not isinstance(name, str) or not name:
            raise _ActionError(f"step: tool_name must be a tool's name, got {name!r}")
        if isinstance(arguments, str):  # as a model writes them: JSON text, passed on as it is
            text = arguments
        elif isinstance(arguments, dict):
            text = json.dumps(arguments)
        else:
            raise _ActionError(f"step: arguments must be an object, got {type(arguments).__name__}")
        call = r.FunctionCall(
            id=new_id("fc"), call_id=new_id("call"), name=name, arguments=text, status=r.ITEM_STATUS_COMPLETED
        )
        result = await self.resources.call_tool(episode.session_id, call)
        episode.items.append(r.Item(function_call=call))
        output = r.FunctionCallOutput(
            id=new_id("fco"), call_id=call.call_id, output=result.output, status=r.ITEM_STATUS_COMPLETED
        )
        episode.items.append(r.Item(function_call_output=output))
        return _observation({"tool_name": name, "output": result.output, "error": result.error})

    async def _answer(self, episode: Episode, answer: Any) -> dict[str, Any]:
        if not isinstance(answer, str):
            raise _ActionError(f"step: answer must be text, got {type(answer).__name__}")
        episode.items.append(assistant_message(answer))
        verdict = await self.resources.verify(episode.session_id, episode.task, r.Response(output=episode.items))
        episode.done = True
        await self._close(episode)
        fields = row_format.json_field(verdict, "fields")
        return _observation({"answer": answer, "fields": fields}, reward=verdict.reward, done=True)

    def _state(self, episode: Episode | None) -> dict[str, Any]:
        if episode is None:
            return {"episode_id": None, "step_count": 0, "task_index": None, "done": False}
        return {
            "episode_id": episode.session_id,
            "step_count": episode.steps,
            "task_index": episode.task_index,
            "done": episode.done,
        }

    async def _close(self, episode: Episode) -> None:
        if episode.closed:
            return
        episode.closed = True
        try:
            await self.resources.close_session(episode.session_id)
        except errors.GymError as e:  # the session is the server's to forget (idle time-out); say why
            log.warning("closing session %r: %s", episode.session_id, e)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The task rows of a JSONL file, each line one JSON object; blank lines are passed over.
    Lines end at "\\n" only: a row may hold U+2028 or U+0085 raw inside a string, as JSON allows
    and orjson writes them, where `str.splitlines` would cut it in two."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise errors.ConfigError(f"--tasks: cannot read {path}: {e.strerror}") from None
    found = []
    for number, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            row = jsonl.parse_line(line)
        except ValueError as e:
            raise errors.ConfigError(f"--tasks: {path} line {number}: {e}") from None
        if not isinstance(row, dict):
            raise errors.ConfigError(f"--tasks: {path} line {number}: not a JSON object")
        found.append(row)
    return found


async def serve(registry: str, resources: str, tasks: Path, host: str, port: int) -> None:
    client = ResourcesClient(Registry(registry), resources)
    front = OpenEnvFront(client, read_rows(tasks))
    url = await front.start(host, port)
    # The line uvicorn prints, so that whatever waits for an OpenEnv server to listen reads this one too.
    print(f"gym-grpc OpenEnv server for {resources!r} running on {url} (Press CTRL+C to quit)", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await front.stop()
        await client.registry.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gym_grpc.adapters.openenv_server",
        description="Serve a gym-grpc resources server to OpenEnv clients (OpenEnv's HTTP/WebSocket protocol).",
    )
    parser.add_argument("--registry", required=True, help="the registry of a `gym-grpc run` (HOST:PORT)")
    parser.add_argument("--resources", required=True, help="the resources server's name in that run")
    parser.add_argument("--tasks", required=True, type=Path, help="a JSONL file of task rows for that server")
    parser.add_argument("--host", default="127.0.0.1", help="the address to serve on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="the port (default 8000, OpenEnv's; 0: a free one)")
    args = parser.parse_args(argv)
    try:
        asyncio.run(serve(args.registry, args.resources, args.tasks, args.host, args.port))
    except errors.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
