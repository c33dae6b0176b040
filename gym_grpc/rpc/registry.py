"""Finding servers by name: the registry service and the client-side resolver.

`gym-grpc run` serves a `RegistryServicer` listing every server it started.
Servers and clients hold a `Registry`, which resolves a name to an address
(through the registry service, or from a fixed table in tests and scripts)
and keeps one channel per server.
"""

from __future__ import annotations

import asyncio
import builtins
import difflib

import grpc

from gym_grpc import errors
from gym_grpc.rpc import transport
from gym_grpc.rpc.security import Security
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import registry_service_pb2_grpc as reg_grpc

REGISTRY_SERVICE = reg.DESCRIPTOR.services_by_name["RegistryService"].full_name


#: A server role's name, for tables and JSON.
SERVER_ROLES = {reg.SERVER_ROLE_MODEL: "model", reg.SERVER_ROLE_RESOURCES: "resources", reg.SERVER_ROLE_AGENT: "agent"}


def closest(name: str, known: list[str]) -> str:
    """A hint naming the known name closest to `name`, for error messages."""
    if not known:
        return "no servers are registered"
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
    return f"did you mean {match[0]!r}? known: {', '.join(sorted(known))}"


class RegistryServicer(reg_grpc.RegistryServiceServicer):
    """The registry service over an in-memory table of servers."""

    def __init__(self) -> None:
        self.servers: dict[str, reg.ServerInfo] = {}

    def add(self, info: reg.ServerInfo) -> None:
        self.servers[info.name] = info

    async def ListServers(
        self, request: reg.ListServersRequest, context: grpc.aio.ServicerContext
    ) -> reg.ListServersResponse:
        return reg.ListServersResponse(servers=[self.servers[k] for k in sorted(self.servers)])

    async def GetServer(
        self, request: reg.GetServerRequest, context: grpc.aio.ServicerContext
    ) -> reg.GetServerResponse:
        info = self.servers.get(request.name)
        if not request.name:
            await context.abort_with_status(errors.InvalidArgument("name: is required", field="name").to_status())
        if info is None:
            error = errors.NotFound(
                f"no server named {request.name!r}: {closest(request.name, list(self.servers))}",
                field="name",
                reason=errors.Reason.SERVER_NOT_FOUND,
                metadata={"server": request.name},
            )
            await context.abort_with_status(error.to_status())
        return reg.GetServerResponse(server=info)


class Registry:
    """Resolves server names to channels, via a registry service or a fixed table.

    Registry("127.0.0.1:50050")              # ask a running `gym-grpc run`
    Registry(static={"weather": "127.0.0.1:4321"})  # no registry service
    Registry("...", security=Security(token=...))   # TLS and the bearer token on every channel
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        static: dict[str, str] | None = None,
        security: Security | None = None,
        unreachable_seconds: float = transport.UNREACHABLE_SECONDS,
    ) -> None:
        self.address = address
        #: How long calls wait for a server that answered before and cannot be reached now.
        self.unreachable_seconds = unreachable_seconds
        #: TLS and token settings for every channel this registry opens.
        self.security = security
        self._static = dict(static or {})
        self._infos: dict[str, asyncio.Future[reg.ServerInfo]] = {}
        self._connections: dict[str, list[transport.Connection]] = {}
        self._registry_channel: grpc.aio.Channel | None = None
        self._lock = asyncio.Lock()

    def _stub(self) -> reg_grpc.RegistryServiceStub:
        if self._registry_channel is None:
            assert self.address is not None, "a registry of static addresses has no service to call"
            self._registry_channel = transport.open_channel(self.address, security=self.security)
        return reg_grpc.RegistryServiceStub(self._registry_channel)

    async def info(self, name: str) -> reg.ServerInfo:
        """The registry's entry for `name` (UNAVAILABLE/NOT_FOUND errors as GymError).

        Looked up once: callers that ask at the same time share the answer."""
        lookup = self._infos.get(name)
        if lookup is None:
            lookup = self._infos[name] = asyncio.ensure_future(self._look_up(name))
        try:
            return await asyncio.shield(lookup)
        except errors.GymError:
            if self._infos.get(name) is lookup:
                del self._infos[name]  # ask again next time: the server may be up by then
            raise

    async def _look_up(self, name: str) -> reg.ServerInfo:
        if name in self._static:
            return reg.ServerInfo(name=name, addresses=[self._static[name]])
        if self.address is None:
            raise errors.Unavailable(
                f"server {name!r} is unknown: {closest(name, list(self._static))}", metadata={"server": name}
            )
        try:
            reply = await self._stub().GetServer(reg.GetServerRequest(name=name), timeout=transport.timeout_for(10.0))
        except grpc.aio.AioRpcError as e:
            raise errors.from_rpc_error(e, f"registry {self.address} looking up {name!r}") from None
        return reply.server

    async def list(self) -> list[reg.ServerInfo]:
        """Every server the registry knows."""
        if self.address is None:
            return [reg.ServerInfo(name=k, addresses=[v]) for k, v in sorted(self._static.items())]
        try:
            reply = await self._stub().ListServers(reg.ListServersRequest(), timeout=transport.timeout_for(10.0))
        except grpc.aio.AioRpcError as e:
            raise errors.from_rpc_error(e, f"registry {self.address}") from None
        return list(reply.servers)

    async def connections(self, name: str) -> builtins.list[transport.Connection]:
        """The connections to server `name`, opened on first use: one per address, or
        several per address when worker processes share it."""
        pool = self._connections.get(name)
        if pool is not None:
            return pool
        async with self._lock:  # thousands of first calls must not open thousands of channels
            pool = self._connections.get(name)
            if pool is None:
                info = await self.info(name)
                if not info.addresses:
                    raise errors.Unavailable(f"server {name!r} has no address", metadata={"server": name})
                per_address = transport.CONNECTIONS_PER_WORKER * info.workers if info.workers > 1 else 1
                pool = [
                    transport.Connection(transport.open_channel(a, i, self.security), a, self.unreachable_seconds)
                    for a in info.addresses
                    for i in range(per_address)
                ]
                self._connections[name] = pool
        return pool

    async def close(self) -> None:
        """Close every channel this registry opened."""
        connections = [connection for pool in self._connections.values() for connection in pool]
        self._connections.clear()
        for connection in connections:
            await connection.close()
        if self._registry_channel is not None:
            await self._registry_channel.close()
            self._registry_channel = None
