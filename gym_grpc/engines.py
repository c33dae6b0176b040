"""HTTP clients for OpenAI-compatible inference engines (vLLM, SGLang, hosted APIs).

aiohttp, never httpx on the hot path (httpx's pool is quadratic in queued
requests). Each engine gets connect and read timeouts, a cap on concurrent
requests (its connection pool), and bounded retries with exponential backoff on 429,
502, 503, 504 and connection errors, each retry logged with its cause and
count. A request never outlives the deadline of the call that made it, so an
engine that is down costs UNAVAILABLE (or DEADLINE_EXCEEDED), never a hang.
Several base URLs make a pool: one session sticks to one engine, sessions
spread over all of them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import zlib
from typing import Any, ClassVar

import aiohttp
import grpc
from pydantic import Field, field_validator

from gym_grpc import errors, transport
from gym_grpc.model import ModelServer
from gym_grpc.serving import ServerConfig

log = logging.getLogger("gym_grpc.engines")

RETRY_STATUSES = frozenset({429, 502, 503, 504})


class EngineSettings(ServerConfig):
    """How to reach the engines of one model server (the `config:` keys of model servers)."""

    base_url: list[str] = Field(description="one base URL or several, such as http://gpu-1:8000/v1")
    api_key: str = Field("", description="bearer token; keep it in env.yaml")
    model: str = Field(description="model name the engine serves")
    max_connections: int = Field(
        1024, ge=0, description="most requests in flight per engine (one per connection); 0 for no cap"
    )
    connect_timeout: float = Field(10.0, gt=0, description="seconds to open a connection")
    read_timeout: float = Field(600.0, gt=0, description="seconds to wait for an answer")
    max_retries: int = Field(5, ge=0, description="retries of a request that failed in a retryable way")
    backoff_seconds: float = Field(0.5, ge=0, description="first retry delay; doubles each time, with jitter")
    max_backoff_seconds: float = Field(10.0, ge=0, description="longest retry delay")

    @field_validator("base_url", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("base_url")
    @classmethod
    def _not_empty(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("at least one base URL is needed")
        return [url.rstrip("/") for url in value]


class EngineError(errors.GymError):
    """An engine answered with an HTTP error that is not worth retrying. Its status code
    follows the HTTP status: 401/403 FAILED_PRECONDITION, other 4xx INVALID_ARGUMENT, else INTERNAL."""

    def __init__(self, status: int, detail: str, url: str) -> None:
        text = f"engine {url} answered HTTP {status}: {detail}"
        code = grpc.StatusCode.INTERNAL
        if status in (401, 403):
            text, code = f"{text} (check the API key)", grpc.StatusCode.FAILED_PRECONDITION
        elif 400 <= status < 500:
            code = grpc.StatusCode.INVALID_ARGUMENT
        super().__init__(text, code=code)
        self.status = status
        self.detail = detail
        self.url = url


def _error_message(status: int, body: bytes) -> str:
    try:
        data = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace")[:500] or f"HTTP {status}"
    if isinstance(data, dict):
        error = data.get("error", data)
        if isinstance(error, dict):
            return str(error.get("message") or error)[:500]
        return str(error)[:500]
    return str(data)[:500]


class Engine:
    """One engine behind one base URL."""

    def __init__(self, base_url: str, settings: EngineSettings) -> None:
        self.base_url = base_url
        self.settings = settings
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Content-Type": "application/json"}
            if self.settings.api_key:
                headers["Authorization"] = f"Bearer {self.settings.api_key}"
            timeout = aiohttp.ClientTimeout(
                total=None, sock_connect=self.settings.connect_timeout, sock_read=self.settings.read_timeout
            )
            # Requests past the connection cap wait in aiohttp's pool, in order.
            connector = aiohttp.TCPConnector(limit=self.settings.max_connections, limit_per_host=0)
            self._session = aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector)
        return self._session

    async def post(self, path: str, body: dict[str, Any], *, from_root: bool = False) -> dict[str, Any]:
        """POST JSON to base_url + path (or, `from_root`, to the server root without
        "/v1": vLLM's /tokenize), retrying what is worth retrying; the answer's JSON.

        Raises EngineError for an HTTP error not worth retrying, and a GymError
        (UNAVAILABLE, DEADLINE_EXCEEDED) when retries or the deadline run out."""
        url = f"{self.base_url.removesuffix('/v1') if from_root else self.base_url}{path}"
        payload = json.dumps(body).encode()
        attempts = self.settings.max_retries + 1
        for attempt in range(1, attempts + 1):
            budget = transport.timeout_for(None)
            if budget is not None and budget <= 0:
                raise errors.DeadlineExceeded(f"engine {url}: no time left for attempt {attempt}")
            try:
                return await asyncio.wait_for(self._send(url, payload), budget)
            except _Retryable as e:
                cause = str(e)
            except (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError) as e:
                cause = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            except TimeoutError:
                raise errors.DeadlineExceeded(f"engine {url}: the caller's deadline ran out") from None
            if attempt == attempts:
                raise errors.Unavailable(f"engine {url} failed {attempts} times; last: {cause}")
            delay = min(self.settings.backoff_seconds * 2 ** (attempt - 1), self.settings.max_backoff_seconds)
            delay *= 0.5 + random.random() / 2
            log.warning("engine %s: %s (attempt %d of %d); retrying in %.2f s", url, cause, attempt, attempts, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _send(self, url: str, payload: bytes) -> dict[str, Any]:
        async with self._client().post(url, data=payload) as reply:
            body = await reply.read()
            if reply.status in RETRY_STATUSES:
                raise _Retryable(f"HTTP {reply.status}: {_error_message(reply.status, body)}")
            if reply.status >= 400:
                raise EngineError(reply.status, _error_message(reply.status, body), url)
            try:
                return json.loads(body)
            except ValueError:
                raise EngineError(reply.status, f"answer is not JSON: {body[:200]!r}", url) from None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class _Retryable(Exception):
    """An answer worth retrying (429, 502, 503, 504)."""


class EnginePool:
    """The engines of one model server; a session always goes to the same one."""

    def __init__(self, settings: EngineSettings) -> None:
        self.engines = [Engine(url, settings) for url in settings.base_url]
        self._next = 0

    def for_session(self, session_id: str) -> Engine:
        """The engine of a session: fixed by the session id; round robin without one."""
        if session_id:
            return self.engines[zlib.crc32(session_id.encode()) % len(self.engines)]
        self._next = (self._next + 1) % len(self.engines)
        return self.engines[self._next]

    async def close(self) -> None:
        for engine in self.engines:
            await engine.close()


class EngineModelServer(ModelServer):
    """Base of a model server in front of engines: its EnginePool lives from start to stop."""

    Config: ClassVar[type[ServerConfig]] = EngineSettings
    config: EngineSettings

    async def start(self) -> None:
        self.engines = EnginePool(self.config)

    async def stop(self) -> None:
        await self.engines.close()
        await super().stop()
