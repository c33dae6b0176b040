"""The engines of one model server, and the base class of model servers in front of engines.

A pool holds one link per base URL, all HTTP (http.py) or all vLLM gRPC (vllm_grpc.py); a model
call goes to the engine its routing key picks (routing.py).
"""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path
from typing import ClassVar

from gym_grpc import errors
from gym_grpc.engines import weights
from gym_grpc.engines.http import Engine
from gym_grpc.engines.load import EngineLoad
from gym_grpc.engines.routing import routing_key
from gym_grpc.engines.settings import EngineSettings
from gym_grpc.engines.vllm_grpc import GrpcEngine
from gym_grpc.model import ModelServer
from gym_grpc.server.counters import Counters
from gym_grpc.server.serving import ServerConfig
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import responses_pb2 as r


class EnginePool:
    """The engines of one model server; a session always goes to the same one."""

    def __init__(self, settings: EngineSettings, counters: Counters | None = None) -> None:
        link = GrpcEngine if settings.grpc else Engine
        self.engines: list[Engine | GrpcEngine] = [link(url, settings, counters) for url in settings.base_url]
        self._next = 0

    def for_key(self, key: str) -> Engine | GrpcEngine:
        """The engine of a routing key (gym_grpc.engines.routing): fixed by the key; round robin without one."""
        if key:
            return self.engines[zlib.crc32(key.encode()) % len(self.engines)]
        self._next = (self._next + 1) % len(self.engines)
        return self.engines[self._next]

    async def loads(self, within: float | None = None) -> list[admin_pb.EngineLoad]:
        """Each engine's load now, read from all at once in `within` seconds at most (GetCountersResponse.engines)."""
        return list(await asyncio.gather(*(_load(engine, within) for engine in self.engines)))

    async def close(self) -> None:
        for engine in self.engines:
            await engine.close()


async def _load(engine: Engine | GrpcEngine, within: float | None) -> EngineLoad:
    if isinstance(engine, GrpcEngine):  # its GetLoads is not read (yet): front it with vLLM's HTTP server
        return EngineLoad(
            url=engine.base_url, error="a vLLM gRPC engine: its load is read from vLLM's HTTP /metrics only"
        )
    return await engine.load(within)


class EngineModelServer(ModelServer):
    """Base of a model server in front of engines: its EnginePool lives from start to stop."""

    Config: ClassVar[type[ServerConfig]] = EngineSettings
    config: EngineSettings

    async def start(self) -> None:
        self.engines = EnginePool(self.config, self.counters)
        self.counters.engine_loads = self.engines.loads

    def engine_for(self, params: r.CreateParams, session_id: str) -> Engine | GrpcEngine:
        """The engine of a model call: by its routing key (gym_grpc.engines.routing), worked out only
        when there is a choice (it reads the request's extra fields and, by prompt, hashes its start)."""
        if len(self.engines.engines) == 1:
            return self.engines.engines[0]
        return self.engines.for_key(routing_key(params, session_id, self.config.route_by))

    async def update_weights(
        self, request: model_pb.UpdateWeightsRequest, timeout: float
    ) -> list[model_pb.EngineUpdate]:
        """Every engine of the pool loads the checkpoint (gym_grpc.engines.weights)."""
        if self.config.grpc:
            raise errors.WeightUpdateUnsupported(
                "vLLM's gRPC server has no pause or weight-loading RPC: front the engine with its HTTP server "
                "(started with VLLM_SERVER_DEV_MODE=1) to update its weights through gym-grpc"
            )
        path = request.checkpoint_path
        if self.config.checkpoint_check and not (Path(path) / "config.json").is_file():
            raise errors.InvalidArgument(
                f"checkpoint_path {path!r} is no checkpoint directory here (no config.json in it); if the engines "
                "see files this model server does not, set its checkpoint_check: false",
                field="checkpoint_path",
            )
        engines = [e for e in self.engines.engines if isinstance(e, Engine)]
        mode = weights.PAUSE_MODES[request.pause_mode]
        return await weights.update(
            engines, request.version, path, mode, lambda: self.served_version.set(request.version), timeout
        )

    async def stop(self) -> None:
        await self.engines.close()
        await super().stop()
