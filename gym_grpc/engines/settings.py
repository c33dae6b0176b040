"""How a model server reaches its engines: the `config:` keys every engine-backed model server has."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from gym_grpc.engines.retries import RetrySettings
from gym_grpc.engines.routing import RouteBy
from gym_grpc.server.serving import ServerConfig

#: How a base URL names a vLLM gRPC server (gym_grpc.engines.vllm_grpc).
GRPC_SCHEME = "grpc://"

#: Seconds an idle connection to an HTTP engine is kept for the next request, by default: under the
#: 5 s after which uvicorn, vLLM's and SGLang's HTTP server, closes one (aiohttp's own default is
#: 15 s). A request sent on a connection just as its server closes it meets a reset, which a request
#: retries and a control call, not retried, fails with.
KEEPALIVE_SECONDS = 4.0


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
    keepalive_seconds: float = Field(
        KEEPALIVE_SECONDS,
        gt=0,
        description="HTTP engines: seconds an idle connection is kept for the next request; under the engine's "
        "own keep-alive (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s unless set). Past it, a batch after a trainer's "
        "step opens its connections anew",
    )
    read_timeout: float = Field(600.0, gt=0, description="seconds to wait for an answer")
    checkpoint_check: bool = Field(
        True,
        description="UpdateWeights first checks that the checkpoint directory exists here and holds "
        "config.json (vLLM's engine core dies on one it cannot load); false when the engines see files "
        "the model server does not",
    )

    @field_validator("keepalive_seconds", mode="before")
    @classmethod
    def _empty_is_default(cls, value: Any) -> Any:
        return KEEPALIVE_SECONDS if value == "" else value  # `${policy_keepalive_seconds:-}` in configs/vllm.yaml

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
