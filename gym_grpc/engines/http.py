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
sessions spread over all of them (or calls by their prompt: see routing.py).
"""

from __future__ import annotations

import json
import zlib
from typing import TYPE_CHECKING, Any, ClassVar

import aiohttp
import grpc
import orjson
from pydantic import Field, field_validator

from gym_grpc import errors
from gym_grpc.engines.link import EngineLink
from gym_grpc.engines.retries import Failure, FailureClass, RetrySettings, retry_after_seconds
from gym_grpc.engines.routing import RouteBy, routing_key
from gym_grpc.model import ModelServer
from gym_grpc.server import open_files
from gym_grpc.server.counters import Counters
from gym_grpc.server.serving import ServerConfig
from gym_grpc.v1 import responses_pb2 as r

if TYPE_CHECKING:
    from gym_grpc.engines.vllm_grpc import GrpcEngine


#: HTTP statuses worth retrying; the others are the engine's answer. 500 is among them
#: (as in OpenAI's own clients): vLLM answers it to the requests in flight when its
#: engine core dies ("EngineCore encountered an issue"), a stop or a crash, not the request.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
#: How a base URL names a vLLM gRPC server (gym_grpc.engines.vllm_grpc).
GRPC_SCHEME = "grpc://"


class EngineSettings(ServerConfig, RetrySettings):
    """How to reach the engines of one model server (the `config:` keys of model servers)."""

    base_url: list[str] = Field(
        description="one base URL or several, such as http://gpu-1:8000/v1, or vLLM gRPC servers as grpc://gpu-1:50051"
    )
    api_key: str = Field("", description="bearer token; keep it in env.yaml")
    model: str = Field(description="model name the engine serves")
    max_connections: int = Field(
        1024, ge=0, description="most requests in flight per engine (one per connection); 0 for no cap"
    )
    route_by: RouteBy = Field(
        "session",
        description="with several engines, what keeps calls on one: 'session' (a rollout's turns) or 'prompt' "
        "(the conversation's start: a GRPO group's rollouts too); a request's prompt_cache_key wins over both",
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
        if len({url.startswith(GRPC_SCHEME) for url in value}) > 1:
            raise ValueError(f"either every base URL is {GRPC_SCHEME}host:port or none is: {value}")
        return [url.rstrip("/") for url in value]

    @property
    def grpc(self) -> bool:
        """Whether the engines are vLLM gRPC servers (grpc://host:port), not HTTP ones."""
        return self.base_url[0].startswith(GRPC_SCHEME)


class EngineError(errors.GymError):
    """An engine answered with an HTTP error that is not worth retrying. Its status code
    follows the HTTP status: 401/403 FAILED_PRECONDITION (ENGINE_AUTH_FAILED), other 4xx
    INVALID_ARGUMENT (ENGINE_REJECTED_REQUEST), else INTERNAL (ENGINE_FAILED: a 5xx that is not
    retried, such as 501, or an answer that is not JSON)."""

    def __init__(self, status: int, detail: str, url: str, *, answered: str | None = None) -> None:
        # `answered`: what the engine's own protocol said, when it is not HTTP (a gRPC status, whose
        # HTTP counterpart is `status`).
        text = f"engine {url} answered {answered or f'HTTP {status}'}: {detail}"
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


class Engine(EngineLink):
    """One engine behind one HTTP base URL."""

    def __init__(self, base_url: str, settings: EngineSettings, counters: Counters | None = None) -> None:
        super().__init__(base_url, settings, counters)
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
        (UNAVAILABLE, DEADLINE_EXCEEDED) when retries, budget or deadline run out."""
        return await self._request("POST", path, orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS), from_root)

    async def get(self, path: str, *, from_root: bool = False) -> dict[str, Any]:
        """GET base_url + path (vLLM's /models, say), retried as `post` is; the answer's JSON."""
        return await self._request("GET", path, None, from_root)

    async def _request(self, method: str, path: str, payload: bytes | None, from_root: bool) -> dict[str, Any]:
        url = f"{self.base_url.removesuffix('/v1') if from_root else self.base_url}{path}"
        return await self._retried(f"engine {url}", lambda: self._send(method, url, payload))

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

    async def _send(self, method: str, url: str, payload: bytes | None) -> dict[str, Any]:
        async with self._client().request(method, url, data=payload) as reply:
            self._heard_from()
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
        self.engines: list[Engine | GrpcEngine] = []
        if settings.grpc:
            from gym_grpc.engines.vllm_grpc import GrpcEngine  # its stubs only where a grpc:// engine is

            self.engines.extend(GrpcEngine(url, settings, counters) for url in settings.base_url)
        else:
            self.engines.extend(Engine(url, settings, counters) for url in settings.base_url)
        self._next = 0

    def for_key(self, key: str) -> Engine | GrpcEngine:
        """The engine of a routing key (gym_grpc.engines.routing): fixed by the key; round robin without one."""
        if key:
            return self.engines[zlib.crc32(key.encode()) % len(self.engines)]
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

    def engine_for(self, params: r.CreateParams, session_id: str) -> Engine | GrpcEngine:
        """The engine of a model call: by its routing key (gym_grpc.engines.routing)."""
        return self.engines.for_key(routing_key(params, session_id, self.config.route_by))

    async def stop(self) -> None:
        await self.engines.close()
        await super().stop()
