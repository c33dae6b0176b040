"""The admin service of every server: info, live counters and the profile."""

from __future__ import annotations

import hashlib
import os
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Protocol

from pydantic import BaseModel

from gym_grpc.rpc import protocol
from gym_grpc.server import open_files, profiling
from gym_grpc.server.counters import Counters
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import registry_service_pb2 as reg

ADMIN_SERVICE = admin_pb.DESCRIPTOR.services_by_name["AdminService"].full_name

try:
    VERSION = version("gym-grpc")
except PackageNotFoundError:  # running from a checkout that is not installed
    VERSION = "unknown"


class Administered(Protocol):
    """What the admin service reads from the server it reports on (a `GymServer`).

    Read-only properties: a server's own, narrower config class and its role
    (a class variable) satisfy them."""

    @property
    def name(self) -> str: ...
    @property
    def role(self) -> reg.ServerRole.ValueType: ...
    @property
    def entrypoint(self) -> str: ...
    @property
    def instance_id(self) -> str: ...
    @property
    def worker(self) -> int: ...
    @property
    def metrics_address(self) -> str: ...
    @property
    def config(self) -> BaseModel: ...
    @property
    def counters(self) -> Counters: ...
    @property
    def profiler(self) -> profiling.Profiler: ...

    def capabilities(self) -> Any: ...


def config_hash(app: Administered) -> str:
    """First 12 hex digits of the SHA-256 of a server's config as canonical JSON."""
    canonical = app.config.model_dump_json(round_trip=True).encode()
    return hashlib.sha256(canonical).hexdigest()[:12]


class AdminServicer(admin_grpc.AdminServiceServicer):
    def __init__(self, app: Administered, services: list[admin_pb.ServedService]) -> None:
        self.app = app
        self.services = services

    async def GetServerInfo(
        self, request: admin_pb.GetServerInfoRequest, context: Any
    ) -> admin_pb.GetServerInfoResponse:
        app = self.app
        return admin_pb.GetServerInfoResponse(
            name=app.name,
            role=app.role,
            version=VERSION,
            uptime_seconds=app.counters.uptime(),
            config_hash=config_hash(app),
            pid=os.getpid(),
            instance_id=app.instance_id,
            worker=app.worker,
            metrics_address=app.metrics_address,
            entrypoint=app.entrypoint,
            profiling=app.profiler.running,
            open_files_limit=open_files.limit(),
            open_files=open_files.in_use(),
            protocol=protocol.version(),
            services=self.services,
            capabilities=app.capabilities(),
            unfilled_fields=sorted(protocol.UNFILLED),
        )

    async def GetCounters(self, request: admin_pb.GetCountersRequest, context: Any) -> admin_pb.GetCountersResponse:
        counters = self.app.counters
        reply = counters.to_proto()
        if counters.engine_loads is not None:
            # Half of what the caller's deadline leaves: an engine that does not answer its /metrics is
            # reported as such, and the counters still arrive in time (`status` gives 2 s).
            remaining = context.time_remaining() if hasattr(context, "time_remaining") else None
            reply.engines.extend(await counters.engine_loads(None if remaining is None else remaining / 2))
        return reply

    async def GetProfile(self, request: admin_pb.GetProfileRequest, context: Any) -> admin_pb.GetProfileResponse:
        entries = self.app.profiler.entries(request.limit or 50)
        return admin_pb.GetProfileResponse(
            enabled=self.app.profiler.running, entries=entries, table=profiling.table(entries) if entries else ""
        )
