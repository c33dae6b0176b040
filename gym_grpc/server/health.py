"""The standard `grpc.health.v1.Health` service, complete.

grpcio-health-checking's servicer (1.85) answers Check and Watch but not List,
which the health.proto of 2024 added for clients (and load balancers) that want
every service's status in one call; its generated base class answers
UNIMPLEMENTED. This subclass adds List from the same statuses.
"""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health, health_pb2

#: The service's full name, "grpc.health.v1.Health".
SERVICE_NAME = health.SERVICE_NAME


class HealthServicer(health.aio.HealthServicer):
    """Check, Watch and List over one table of statuses ("" is the whole server)."""

    async def List(self, request: health_pb2.HealthListRequest, context: Any) -> health_pb2.HealthListResponse:
        # The base class keeps its statuses here; tests/test_discovery.py proves List sees every update.
        statuses = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=status) for name, status in statuses.items()}
        )
