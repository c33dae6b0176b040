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
rollouts. Several base URLs make a pool (pool.py).
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import orjson

from gym_grpc import errors, tracing
from gym_grpc.engines import load
from gym_grpc.engines.link import EngineError, EngineLink
from gym_grpc.engines.load import EngineLoad
from gym_grpc.engines.retries import Failure, FailureClass, retry_after_seconds
from gym_grpc.engines.settings import EngineSettings
from gym_grpc.server import open_files
from gym_grpc.server.counters import Counters

#: HTTP statuses worth retrying; the others are the engine's answer. 500 is among them
#: (as in OpenAI's own clients): vLLM answers it to the requests in flight when its
#: engine core dies ("EngineCore encountered an issue"), a stop or a crash, not the request.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


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


class Engine(EngineLink):
    """One engine behind one HTTP base URL."""

    def __init__(self, base_url: str, settings: EngineSettings, counters: Counters | None = None) -> None:
        super().__init__(base_url, settings, counters)
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Requests past the connection cap wait in aiohttp's pool, in order.
            self._session = self._new_session(
                aiohttp.TCPConnector(
                    limit=self.settings.max_connections,
                    limit_per_host=0,
                    keepalive_timeout=self.settings.keepalive_seconds,
                )
            )
        return self._session

    def _new_session(self, connector: aiohttp.TCPConnector) -> aiohttp.ClientSession:
        headers = {"Content-Type": "application/json"}
        if self.settings.api_key:
            headers["Authorization"] = f"Bearer {self.settings.api_key}"
        timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=self.settings.connect_timeout, sock_read=self.settings.read_timeout
        )
        return aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector)

    async def post(self, path: str, body: dict[str, Any], *, from_root: bool = False) -> dict[str, Any]:
        """POST JSON to base_url + path (or, `from_root`, to the server root without
        "/v1": vLLM's /tokenize), retrying what is worth retrying; the answer's JSON.

        Raises EngineError for an HTTP error not worth retrying, and a GymError
        (UNAVAILABLE, DEADLINE_EXCEEDED) when retries, budget or deadline run out."""
        payload = orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)
        return await self._request("POST", path, payload, from_root, str(body.get("model") or ""))

    async def get(self, path: str, *, from_root: bool = False) -> dict[str, Any]:
        """GET base_url + path (vLLM's /models, say), retried as `post` is; the answer's JSON."""
        return await self._request("GET", path, None, from_root)

    async def _request(
        self, method: str, path: str, payload: bytes | None, from_root: bool, model: str = ""
    ) -> dict[str, Any]:
        url = f"{self.base_url.removesuffix('/v1') if from_root else self.base_url}{path}"
        return await self._retried(f"engine {url}", lambda: self._send(method, url, payload, path, model))

    async def control(self, path: str, body: dict[str, Any] | None = None, **query: str) -> dict[str, Any]:
        """POST to the engine's root once, without retries: a call of vLLM's RL control API
        (`/pause`, `/collective_rpc`...), which a retry could repeat or make worse. On a connection
        of its own, opened for it: one kept from an earlier request may be closed by the engine
        as the call goes out, and the call would fail for it. Raises EngineError for an HTTP
        error, aiohttp's errors when the engine cannot be reached; the caller bounds the time."""
        url = f"{self.base_url.removesuffix('/v1')}{path}"
        payload = orjson.dumps(body) if body is not None else None
        async with (
            self._new_session(aiohttp.TCPConnector(force_close=True)) as session,
            session.post(url, data=payload, params=query or None) as reply,
        ):
            answer = await reply.read()
            if reply.status >= 400:
                raise EngineError(reply.status, _error_message(reply.status, answer), url)
            return _parse(answer, reply.status, url)

    def _failure(self, error: Exception) -> Failure | None:
        if isinstance(error, _Retryable):
            return error.failure
        if isinstance(error, aiohttp.SocketTimeoutError):
            return Failure("timeout", f"no answer within read_timeout ({self.settings.read_timeout:g} s)")
        if isinstance(error, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError):
            if open_files.ran_out(error):  # not the engine's fault, and retrying only adds noise
                raise errors.OutOfFiles(open_files.explain(f"connecting to engine {self.base_url}")) from None
            return Failure("connect", f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        return None

    async def _send(self, method: str, url: str, payload: bytes | None, path: str, model: str) -> dict[str, Any]:
        # Each attempt a span of its own, whose traceparent the engine continues (vLLM does, started
        # with --otlp-traces-endpoint).
        with tracing.engine_request(method, url, path, model) as span:
            async with self._client().request(method, url, data=payload, headers=tracing.engine_headers()) as reply:
                self._heard_from()
                body = await reply.read()
                if reply.status in RETRY_STATUSES:
                    detail = _error_message(reply.status, body)
                    raise _Retryable(reply.status, detail, reply.headers.get("Retry-After"))
                if reply.status >= 400:
                    raise EngineError(reply.status, _error_message(reply.status, body), url)
                answer = _parse(body, reply.status, url)
                tracing.engine_answered(span, reply.status, answer)
                return answer

    async def load(self, within: float | None = None) -> EngineLoad:
        """The engine's load now, from its /metrics (gym_grpc.engines.load), read once (in `within` s at most)."""
        return await load.read(self._client(), self.base_url, within)

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
