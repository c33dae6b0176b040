"""OpenEnv's wire, spoken from gym-grpc: the server process, its schema and a session over its WebSocket.

OpenEnv 0.10 (openenv.core.env_server.http_server, env_client) serves each environment with FastAPI:
`GET /schema` (the action, observation and state JSON schemas), `GET /health`, and `/ws`, a WebSocket
whose connection is one session with an environment instance of its own. On it the client sends
`{"type": "reset", "data": {seed, episode_id, ...}}`, `{"type": "step", "data": ACTION}`,
`{"type": "state"}` and `{"type": "close"}`; the server answers each (but close) with
`{"type": "observation", "data": {"observation": {...}, "reward": R, "done": D, "metadata"?: {...}}}`,
`{"type": "state", "data": {...}}` or `{"type": "error", "data": {"message": ..., "code": ...}}`
(codes: INVALID_JSON, UNKNOWN_TYPE, VALIDATION_ERROR, EXECUTION_ERROR, CAPACITY_REACHED, FACTORY_ERROR,
SESSION_ERROR). This module speaks it with aiohttp, which gym-grpc already has, so that the `openenv`
package (whose fastmcp 3 wants an mcp that gym-grpc's other bridges cannot share) need not be installed
beside gym-grpc: the environment runs in its own interpreter, as a child process or anywhere reachable.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import re
import signal
import sys
from typing import Any

import aiohttp

from gym_grpc import errors
from gym_grpc.engines.local_vllm.process import die_with_parent

log = logging.getLogger("gym_grpc.openenv_envs")

#: The line uvicorn (which every OpenEnv server runs on) prints once it listens, with the bound port
#: (port 0 included).
_LISTENING = re.compile(r"running on (https?://[^\s]+)", re.IGNORECASE)


def unavailable(url: str, problem: str) -> errors.Unavailable:
    return errors.Unavailable(
        f"OpenEnv server {url}: {problem}", reason=errors.Reason.OPENENV_UNAVAILABLE, metadata={"openenv_url": url}
    )


def ws_url(base_url: str) -> str:
    """The session WebSocket of a server at `base_url` (http -> ws, https -> wss), as OpenEnv's client makes it."""
    base = base_url.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base.removeprefix("https://") + "/ws"
    return "ws://" + base.removeprefix("http://") + "/ws"


class ServerProcess:
    """An OpenEnv server started as a child process; its URL is read from the line uvicorn prints."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: str | None) -> None:
        self.command = command
        self.env = env
        self.cwd = cwd
        self.process: asyncio.subprocess.Process | None = None
        self.url = ""
        self.last_lines: collections.deque[str] = collections.deque(maxlen=20)
        self._drain: asyncio.Task | None = None

    async def start(self, timeout: float) -> str:
        """Start it and wait (at most `timeout` seconds) for it to listen; its base URL. A command that
        fails, exits or stays silent is a ConfigError quoting what it printed last."""
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,  # its own process group: stop() ends what it started too
                # Ended with this process even when no stop() runs (SIGKILL, a crash): no server left behind.
                preexec_fn=die_with_parent if sys.platform == "linux" else None,
            )
        except OSError as e:
            raise errors.ConfigError(f"config.command: cannot start {self.command[0]!r}: {e}") from None
        try:
            self.url = await asyncio.wait_for(self._listening(), timeout)
        except TimeoutError:
            await self.stop()
            raise errors.ConfigError(
                f"config.command: the OpenEnv server did not say it listens within {timeout:g} s "
                f"(start_timeout_seconds){self._tail()}"
            ) from None
        except errors.ConfigError:
            await self.stop()
            raise
        self._drain = asyncio.create_task(self._read_rest())
        return self.url

    async def _listening(self) -> str:
        assert self.process is not None and self.process.stdout is not None
        while True:
            line = await self.process.stdout.readline()
            if not line:
                code = await self.process.wait()
                raise errors.ConfigError(
                    f"config.command: the OpenEnv server exited (status {code}) before listening{self._tail()}"
                )
            text = line.decode(errors="replace").rstrip()
            self.last_lines.append(text)
            found = _LISTENING.search(text)
            if found:
                # A server bound to every interface (0.0.0.0, as OpenEnv's templates do) is reached on loopback.
                return found.group(1).replace("://0.0.0.0:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")

    async def _read_rest(self) -> None:
        """Keep reading what it prints (a full pipe would stop it), kept for the errors that quote it."""
        assert self.process is not None and self.process.stdout is not None
        async for line in self.process.stdout:
            text = line.decode(errors="replace").rstrip()
            self.last_lines.append(text)
            log.debug("openenv server: %s", text)

    def _tail(self) -> str:
        lines = [line for line in self.last_lines if line.strip()][-5:]
        return ": " + " | ".join(lines) if lines else ""

    def exited(self) -> str | None:
        """Why the process is gone (status and last output), or None while it runs."""
        if self.process is None or self.process.returncode is None:
            return None
        return f"its process exited (status {self.process.returncode}){self._tail()}"

    async def stop(self, grace: float = 5.0) -> None:
        process, self.process = self.process, None
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        if self._drain is not None:
            self._drain.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._drain


async def fetch_schema(http: aiohttp.ClientSession, base_url: str, timeout: float) -> dict[str, Any]:
    """`GET /schema`: the action, observation and state schemas; OPENENV_UNAVAILABLE when it cannot be had."""
    try:
        async with http.get(base_url.rstrip("/") + "/schema", timeout=aiohttp.ClientTimeout(total=timeout)) as reply:
            if reply.status != 200:
                raise unavailable(base_url, f"GET /schema answered HTTP {reply.status}")
            schema = await reply.json(content_type=None)
    except TimeoutError:
        raise unavailable(
            base_url, f"no answer to GET /schema within {timeout:g} s (connect_timeout_seconds)"
        ) from None
    except (aiohttp.ClientError, ValueError) as e:
        raise unavailable(base_url, f"GET /schema failed: {type(e).__name__}: {e}") from None
    if not isinstance(schema, dict) or not isinstance(schema.get("action"), dict):
        raise unavailable(base_url, "GET /schema did not answer OpenEnv's schema object (no 'action' schema)")
    return schema


class OpenEnvError(Exception):
    """An error frame of the server: its message and code (VALIDATION_ERROR, EXECUTION_ERROR, ...)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(f"{message} ({code})" if code else message)
        self.code = code


class EnvSession:
    """One OpenEnv session: a WebSocket to `/ws`, one message and its answer at a time."""

    def __init__(self, base_url: str, ws: aiohttp.ClientWebSocketResponse, message_timeout: float) -> None:
        self.base_url = base_url
        self.ws = ws
        self.message_timeout = message_timeout
        self.lock = asyncio.Lock()

    @classmethod
    async def open(
        cls, http: aiohttp.ClientSession, base_url: str, connect_timeout: float, message_timeout: float
    ) -> EnvSession:
        try:
            # The whole opening (TCP, HTTP upgrade) bounded: an address that drops packets costs connect_timeout.
            ws = await asyncio.wait_for(
                http.ws_connect(
                    ws_url(base_url),
                    timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=5.0),
                    max_msg_size=100 * 1024 * 1024,  # OpenEnv's own client allows 100 MiB
                ),
                connect_timeout,
            )
        except TimeoutError:
            raise unavailable(
                base_url, f"no session on /ws within {connect_timeout:g} s (connect_timeout_seconds)"
            ) from None
        except (aiohttp.ClientError, OSError) as e:
            raise unavailable(base_url, f"cannot open a session on /ws: {type(e).__name__}: {e}") from None
        return cls(base_url, ws, message_timeout)

    async def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message and read its answer's `data`; OpenEnvError for an error frame, OPENENV_UNAVAILABLE
        when the connection is gone or the answer does not come within the message time-out (the socket is
        then closed: a late answer would pair with the next message)."""
        async with self.lock:
            if self.ws.closed:
                raise unavailable(self.base_url, "the session's connection is closed")
            try:
                with contextlib.suppress(ConnectionError):
                    # A session the server refuses (at capacity) gets its error frame, then the server closes: a
                    # send that finds it closed still has that frame to read (OpenEnv's own client does the same).
                    await self.ws.send_str(json.dumps(message))
                frame = await self.ws.receive(timeout=self.message_timeout)
            except TimeoutError:
                await self.close(polite=False)
                raise unavailable(
                    self.base_url,
                    f"no answer to {message['type']!r} within {self.message_timeout:g} s (message_timeout_seconds)",
                ) from None
            except (aiohttp.ClientError, ConnectionError, RuntimeError) as e:
                raise unavailable(self.base_url, f"the session's connection failed: {type(e).__name__}: {e}") from None
        if frame.type != aiohttp.WSMsgType.TEXT:
            reason = f" ({frame.extra})" if frame.extra else ""
            raise unavailable(self.base_url, f"the session's connection ended ({frame.type.name}{reason})")
        try:
            answer = json.loads(frame.data)
        except ValueError:
            raise unavailable(self.base_url, f"answered with text that is not JSON: {frame.data[:200]!r}") from None
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, dict):
            raise unavailable(self.base_url, f"answered with a frame without a data object: {frame.data[:200]!r}")
        if answer.get("type") == "error":
            raise OpenEnvError(str(data.get("message", "unknown error")), str(data.get("code", "")))
        return data

    async def close(self, *, polite: bool = True) -> None:
        """End the session: OpenEnv's close message, then the socket (the server then drops the env)."""
        if self.ws.closed:
            return
        if polite:
            with contextlib.suppress(Exception):
                await self.ws.send_str(json.dumps({"type": "close"}))
        with contextlib.suppress(Exception):
            await self.ws.close()
