"""HTTP clients for OpenAI-compatible inference engines (vLLM, SGLang, hosted APIs).

aiohttp, never httpx on the hot path (httpx's pool is quadratic in queued
requests). Each engine gets connect and read timeouts, a cap on concurrent
requests (its connection pool), and bounded retries per failure class
(`gym_grpc.engines.retries`), each retry logged with its cause and counted in the
server's counters (not when this process is out of open files: see
open_files.py). A request never outlives the deadline of the call that
made it, so an engine that is down costs UNAVAILABLE (or DEADLINE_EXCEEDED),
never a hang. An engine that has not answered yet (vLLM loading its model) is
waited for, up to `startup_wait_seconds`, so a collect started early loses no
rollouts. Several base URLs make a pool: one session sticks to one engine,
sessions spread over all of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import zlib
from typing import Any, ClassVar

import aiohttp
import grpc
import orjson
from pydantic import Field, field_validator

from gym_grpc import errors
from gym_grpc.engines.retries import Failure, FailureClass, Retries, RetrySettings, retry_after_seconds
from gym_grpc.model import ModelServer
from gym_grpc.server import open_files
from gym_grpc.server.counters import Counters
from gym_grpc.server.serving import ServerConfig

log = logging.getLogger("gym_grpc.engines.http")

#: HTTP statuses worth retrying; the others are the engine's answer. 500 is among them
#: (as in OpenAI's own clients): vLLM answers it to the requests in flight when its
#: engine core dies ("EngineCore encountered an issue"), a stop or a crash, not the request.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class EngineSettings(ServerConfig, RetrySettings):
    """How to reach the engines of one model server (the `config:` keys of model servers)."""

    base_url: list[str] = Field(description="one base URL or several, such as http://gpu-1:8000/v1")
    api_key: str = Field("", description="bearer token; keep it in env.yaml")
    model: str = Field(description="model name the engine serves")
    max_connections: int = Field(
        1024, ge=0, description="most requests in flight per engine (one per connection); 0 for no cap"
    )
    connect_timeout: float = Field(10.0, gt=0, description="seconds to open a connection")
    read_timeout: float = Field(600.0, gt=0, description="seconds to wait for an answer")

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
    follows the HTTP status: 401/403 FAILED_PRECONDITION (ENGINE_AUTH_FAILED), other 4xx
    INVALID_ARGUMENT (ENGINE_REJECTED_REQUEST), else INTERNAL (ENGINE_FAILED: a 5xx that is not
    retried, such as 501, or an answer that is not JSON)."""

    def __init__(self, status: int, detail: str, url: str) -> None:
        text = f"engine {url} answered HTTP {status}: {detail}"
        code, reason = grpc.StatusCode.INTERNAL, errors.Reason.ENGINE_FAILED
        if status in (401, 403):
            text, code = f"{text} (check the API key)", grpc.StatusCode.FAILED_PRECONDITION
            reason = errors.Reason.ENGINE_AUTH_FAILED
        elif 400 <= status < 500:
            code, reason = grpc.StatusCode.INVALID_ARGUMENT, errors.Reason.ENGINE_REJECTED_REQUEST
        super().__init__(text, code=code, reason=reason, metadata={"engine": url, "http_status": str(status)})
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

    def __init__(self, base_url: str, settings: EngineSettings, counters: Counters | None = None) -> None:
        self.base_url = base_url
        self.settings = settings
        self.counters = counters or Counters()
        self._session: aiohttp.ClientSession | None = None
        #: Set once the engine answered anything (even an error): it is up.
        self._answered = asyncio.Event()
        self._first_request: float | None = None
        self._waiting_since: float | None = None

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
        (UNAVAILABLE, DEADLINE_EXCEEDED) when retries, budget or deadline run out."""
        return await self._request("POST", path, orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), from_root)

    async def get(self, path: str, *, from_root: bool = False) -> dict[str, Any]:
        """GET base_url + path (vLLM's /models, say), retried as `post` is; the answer's JSON."""
        return await self._request("GET", path, None, from_root)

    async def _request(self, method: str, path: str, payload: bytes | None, from_root: bool) -> dict[str, Any]:
        url = f"{self.base_url.removesuffix('/v1') if from_root else self.base_url}{path}"
        retries = Retries(self.settings, f"engine {url}")
        if self._first_request is None:
            self._first_request = time.monotonic()
        startup_waits = 0
        while True:
            try:
                async with asyncio.timeout(retries.time_left()):  # no task per request, as wait_for makes
                    return await self._send(method, url, payload)
            except _Retryable as e:
                failure = e.failure
            except aiohttp.SocketTimeoutError:
                failure = Failure("timeout", f"no answer within read_timeout ({self.settings.read_timeout:g} s)")
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                if open_files.ran_out(e):  # not the engine's fault, and retrying only adds noise
                    raise errors.OutOfFiles(open_files.explain(f"connecting to engine {url}")) from None
                failure = Failure("connect", f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            except TimeoutError:
                raise retries.out_of_time() from None
            if failure.kind == "connect" and not self._answered.is_set():
                if await self._wait_for_start(failure, retries, startup_waits + 1):
                    startup_waits += 1
                    continue
                failure = dataclasses.replace(failure, cause=f"{failure.cause} (the engine never answered)")
            delay = retries.wait_before_retry(failure)
            self.counters.retried(failure.kind)
            log.warning(
                "engine %s: %s (%s retry %d of %d); retrying in %.2f s",
                url,
                failure.cause,
                failure.kind,
                retries.counts[failure.kind],
                self.settings.retry_limit(failure.kind),
                delay,
            )
            await asyncio.sleep(delay)

    async def _wait_for_start(self, failure: Failure, retries: Retries, wait: int) -> bool:
        """While the engine has never answered (still loading), wait for it instead of
        counting a connection failure, up to startup_wait_seconds from the first
        request; False once that is over. The `wait`-th wait of a request backs off
        like a retry, and wakes as soon as any request gets through."""
        assert self._first_request is not None
        left = self.settings.startup_wait_seconds - (time.monotonic() - self._first_request)
        if left <= 0:
            return False
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
            log.warning(
                "engine %s does not answer yet (%s); waiting up to %.0f s for it to start (startup_wait_seconds)",
                self.base_url,
                failure.cause,
                left,
            )
        delay = min(self.settings.backoff(wait), left)
        retries.check_wait(delay, failure.cause)
        self.counters.retried("connect")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._answered.wait(), delay)
        return True

    async def _send(self, method: str, url: str, payload: bytes | None) -> dict[str, Any]:
        async with self._client().request(method, url, data=payload) as reply:
            if not self._answered.is_set():
                self._answered.set()
                if self._waiting_since is not None:
                    log.warning(
                        "engine %s answered after %.1f s", self.base_url, time.monotonic() - self._waiting_since
                    )
            body = await reply.read()
            if reply.status in RETRY_STATUSES:
                raise _Retryable(reply.status, _error_message(reply.status, body), reply.headers.get("Retry-After"))
            if reply.status >= 400:
                raise EngineError(reply.status, _error_message(reply.status, body), url)
            return _parse(body, reply.status, url)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _parse(body: bytes, status: int, url: str) -> dict[str, Any]:
    """An engine's JSON answer: orjson (several times faster than json on answers
    with thousands of log-probs), or json for what orjson refuses and Python's
    json takes (NaN, Infinity): engines get liberal parsing."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(body)
    except ValueError:
        raise EngineError(status, f"answer is not JSON: {body[:200]!r}", url) from None


class _Retryable(Exception):
    """An answer worth retrying (429, 500, 502, 503, 504), as the Failure it is."""

    def __init__(self, status: int, detail: str, retry_after: str | None) -> None:
        super().__init__(detail)
        kind: FailureClass = "rate_limited" if status == 429 else "server_error"
        # Retry-After is honoured where HTTP defines it for these statuses.
        wait = retry_after_seconds(retry_after) if status in (429, 503) else None
        cause = f"HTTP {status}: {detail}" + (f" (Retry-After {wait:g} s)" if wait is not None else "")
        self.failure = Failure(kind, cause, wait)


class EnginePool:
    """The engines of one model server; a session always goes to the same one."""

    def __init__(self, settings: EngineSettings, counters: Counters | None = None) -> None:
        self.engines = [Engine(url, settings, counters) for url in settings.base_url]
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
        self.engines = EnginePool(self.config, self.counters)

    async def stop(self) -> None:
        await self.engines.close()
        await super().stop()
