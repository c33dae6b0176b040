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
import functools
import logging
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_grpc import errors
from gym_grpc.rpc import transport
from gym_grpc.rpc.in_process import InProcessServer
from gym_grpc.rpc.security import Security
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import registry_service_pb2_grpc as reg_grpc

log = logging.getLogger("gym_grpc.rpc.registry")

#: Seconds before asking a registry that could not be watched again; doubles up to the max.
WATCH_RETRY_FIRST_SECONDS = 0.5
WATCH_RETRY_MAX_SECONDS = 5.0

#: Seconds a replica has to answer a health check when a call to its server failed.
PROBE_SECONDS = 1.0

#: Seconds a new channel over several replicas has to reach them all before it is used.
CONNECT_SECONDS = 5.0

#: Seconds the calls in flight on a channel replaced by a newer one get to finish.
RETIRE_GRACE_SECONDS = 600.0

REGISTRY_SERVICE = reg.DESCRIPTOR.services_by_name["RegistryService"].full_name


#: A server role's name, for tables and JSON.
SERVER_ROLES = {
    reg.SERVER_ROLE_MODEL: "model",
    reg.SERVER_ROLE_RESOURCES: "resources",
    reg.SERVER_ROLE_AGENT: "agent",
    reg.SERVER_ROLE_TASKS: "tasks",
}


def closest(name: str, known: list[str]) -> str:
    """A hint naming the known name closest to `name`, for error messages."""
    if not known:
        return "no servers are registered"
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.0)
    return f"did you mean {match[0]!r}? known: {', '.join(sorted(known))}"


class RegistryServicer(reg_grpc.RegistryServiceServicer):
    """The registry service over an in-memory table of servers.

    The runner that owns it calls `add` for each server it started and again
    whenever a server's replicas change; watchers (WatchServer) get each new
    entry."""

    def __init__(self) -> None:
        self.servers: dict[str, reg.ServerInfo] = {}
        self._changed = asyncio.Condition()
        self._closed = False

    def add(self, info: reg.ServerInfo) -> None:
        """Put a server's entry in the table (replacing the one of that name) and tell its watchers."""
        old = self.servers.get(info.name)
        entry = _with_generation(info, old.generation if old is not None else 0)
        if entry == old:
            return
        entry.generation += 1
        self.servers[info.name] = entry
        asyncio.ensure_future(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def close(self) -> None:
        """End every WatchServer stream (the registry is stopping)."""
        self._closed = True
        await self._notify()

    async def ListServers(
        self, request: reg.ListServersRequest, context: grpc.aio.ServicerContext
    ) -> reg.ListServersResponse:
        return reg.ListServersResponse(servers=[self.servers[k] for k in sorted(self.servers)])

    async def GetServer(
        self, request: reg.GetServerRequest, context: grpc.aio.ServicerContext
    ) -> reg.GetServerResponse:
        return reg.GetServerResponse(server=await self._entry(request.name, context))

    async def WatchServer(
        self, request: reg.WatchServerRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[reg.WatchServerResponse]:
        info = await self._entry(request.name, context)
        while not self._closed:
            yield reg.WatchServerResponse(server=info)
            async with self._changed:
                await self._changed.wait_for(functools.partial(self._changed_since, request.name, info.generation))
            info = self.servers[request.name]

    def _changed_since(self, name: str, generation: int) -> bool:
        return self._closed or self.servers[name].generation != generation

    async def _entry(self, name: str, context: grpc.aio.ServicerContext) -> reg.ServerInfo:
        if not name:
            await context.abort_with_status(errors.InvalidArgument("name: is required", field="name").to_status())
        info = self.servers.get(name)
        if info is None:
            error = errors.NotFound(
                f"no server named {name!r}: {closest(name, list(self.servers))}",
                field="name",
                reason=errors.Reason.SERVER_NOT_FOUND,
                metadata={"server": name},
            )
            await context.abort_with_status(error.to_status())
        assert info is not None  # abort_with_status raised
        return info


def _forget(retiring: set[transport.Connection], connection: transport.Connection, _: object) -> None:
    retiring.discard(connection)


def _with_generation(info: reg.ServerInfo, generation: int) -> reg.ServerInfo:
    copy = reg.ServerInfo()
    copy.CopyFrom(info)
    copy.generation = generation
    return copy


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
        #: The servers of this process that calls reach without gRPC (a `process:` group), by name.
        self.in_process: dict[str, InProcessServer] = {}
        self._infos: dict[str, asyncio.Future[reg.ServerInfo]] = {}
        self._connections: dict[str, list[transport.Connection]] = {}
        self._opened: dict[str, reg.ServerInfo] = {}  # the entry each pool was opened for
        self._watches: dict[str, asyncio.Future[None]] = {}
        self._replicas: dict[str, transport.Connection] = {}
        self._retiring: set[transport.Connection] = set()
        self._probes: dict[str, tuple[float, asyncio.Future[bool]]] = {}
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
        """The connections to server `name`, opened on first use: one channel over
        its replicas (several when worker processes share a replica's port), which
        gRPC balances. Through a registry service, the entry is then followed
        (WatchServer): when replicas come or go, new calls use a new channel over
        the live ones and calls in flight finish on the old one."""
        pool = self._connections.get(name)
        if pool is None:
            async with self._lock:  # thousands of first calls must not open thousands of channels
                pool = self._connections.get(name)
                if pool is None:
                    info = await self.info(name)
                    pool = self._open(info)
                    await self._spread(pool, len(info.addresses))
                    self._connections[name] = pool
                    self._opened[name] = info
                    if self.address is not None and name not in self._static:
                        self._watches[name] = asyncio.ensure_future(self._watch(name))
        if not pool:
            raise errors.Unavailable(
                f"server {name!r} has no live replica (see gym-grpc status)", metadata={"server": name}
            )
        return pool

    async def _spread(self, pool: builtins.list[transport.Connection], replicas: int) -> None:
        """Return once calls on a new channel reach every replica (within CONNECT_SECONDS).

        round_robin spreads calls over the replicas whose connection is ready and
        healthy; a new channel's first calls would all go to the replica that got
        there first (a collector's whole first window of rollouts, thousands). So
        the channel is asked who answers (AdminService.GetServerInfo's instance_id)
        until every replica has. Best effort: a replica that is not there in time
        gets calls once it is."""
        if replicas < 2:
            return
        stub = pool[0].stub(admin_grpc.AdminServiceStub)
        seen: set[str] = set()
        deadline = time.monotonic() + CONNECT_SECONDS
        while len(seen) < replicas and time.monotonic() < deadline:
            try:
                info = await stub.GetServerInfo(
                    admin_pb.GetServerInfoRequest(), timeout=deadline - time.monotonic(), wait_for_ready=True
                )
            except grpc.aio.AioRpcError:
                return  # not a gym-grpc server, or not answering: the calls will say
            if not info.instance_id:
                return  # a server before protocol 1.2 cannot say
            seen.add(info.instance_id)

    def opened(self, name: str) -> builtins.list[transport.Connection] | None:
        """The connections to server `name` if they are open (nothing is looked up or awaited)."""
        return self._connections.get(name)

    def _open(self, info: reg.ServerInfo) -> builtins.list[transport.Connection]:
        addresses = list(info.addresses)
        if not addresses:
            return []
        channels = transport.CONNECTIONS_PER_WORKER * info.workers if info.workers > 1 else 1
        where = ",".join(addresses)
        return [
            transport.Connection(transport.open_channel(addresses, self.security), where, self.unreachable_seconds)
            for _ in range(channels)
        ]

    def replica(self, address: str) -> transport.Connection:
        """A connection to one replica, for the calls of a session it holds (see
        SeedSessionResponse.replica). Such calls do not wait for a replica that
        cannot be reached: its sessions went with it."""
        connection = self._replicas.get(address)
        if connection is None:
            channel = transport.open_channel(address, security=self.security)
            connection = self._replicas[address] = transport.Connection(
                channel, address, self.unreachable_seconds, replica=True
            )
        return connection

    async def unreachable(self, addresses: builtins.list[str]) -> builtins.list[str]:
        """Which of these replica addresses do not answer a health check now (within
        PROBE_SECONDS). Asked when a call over several replicas failed UNAVAILABLE, to
        name the replica that went away; the calls that fail together share one probe."""
        now = time.monotonic()
        probes = []
        for address in addresses:
            probe = self._probes.get(address)
            if probe is None or probe[0] < now - PROBE_SECONDS:
                probe = self._probes[address] = (now, asyncio.ensure_future(self._answers(address)))
            probes.append(probe[1])
        answers = await asyncio.gather(*(asyncio.shield(p) for p in probes))
        return [address for address, answered in zip(addresses, answers, strict=True) if not answered]

    async def _answers(self, address: str) -> bool:
        stub = self.replica(address).stub(health_pb2_grpc.HealthStub)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_SECONDS)
        except grpc.aio.AioRpcError:
            return False
        return True

    async def _watch(self, name: str) -> None:
        """Follow `name`'s entry until closed; a lost registry is asked again, with backoff."""
        delay = WATCH_RETRY_FIRST_SECONDS
        while True:
            try:
                async for reply in self._stub().WatchServer(reg.WatchServerRequest(name=name)):
                    delay = WATCH_RETRY_FIRST_SECONDS
                    await self._update(reply.server)
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNIMPLEMENTED):
                    return  # the server left the registry, or a registry that cannot be watched
                log.debug("watching %r through registry %s: %s", name, self.address, e.details())
            await asyncio.sleep(delay)
            delay = min(delay * 2, WATCH_RETRY_MAX_SECONDS)

    async def _update(self, info: reg.ServerInfo) -> None:
        """Take a new entry of a server: a new channel when its replicas changed
        (the old one serves until the new one has connected)."""
        name = info.name
        settled: asyncio.Future[reg.ServerInfo] = asyncio.get_running_loop().create_future()
        settled.set_result(info)
        self._infos[name] = settled
        old = self._opened.get(name)
        if old is not None and old.addresses == info.addresses and old.workers == info.workers:
            return
        log.info("server %r now on %s", name, ", ".join(info.addresses) or "no live replica")
        pool = self._open(info)
        await self._spread(pool, len(info.addresses))
        retired = self._connections.get(name, [])
        self._connections[name] = pool
        self._opened[name] = info
        gone = set(old.addresses if old is not None else []) - set(info.addresses)
        retired += [self._replicas.pop(a) for a in gone if a in self._replicas]
        for connection in retired:
            self._retiring.add(connection)
            task = asyncio.ensure_future(connection.close(grace=RETIRE_GRACE_SECONDS))
            task.add_done_callback(functools.partial(_forget, self._retiring, connection))

    async def close(self) -> None:
        """Close every channel this registry opened."""
        for watch in self._watches.values():
            watch.cancel()
        self._watches.clear()
        connections = [connection for pool in self._connections.values() for connection in pool]
        connections += [*self._replicas.values(), *self._retiring]
        self._connections.clear()
        self._replicas.clear()
        self._retiring.clear()
        for connection in connections:
            await connection.close()
        if self._registry_channel is not None:
            await self._registry_channel.close()
            self._registry_channel = None
