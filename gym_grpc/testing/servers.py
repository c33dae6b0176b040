"""Servers in the test's own process, on 127.0.0.1 port 0, stopped when the test ends.

    async with serving(WeatherEnv()) as env:              # one server
        client = ResourcesClient(static_registry(weather=env), "weather")

    async with Servers() as servers:                      # several, stopped in reverse order
        model = await servers.start(ScriptedModel([say("4")]))
        env = await servers.start(MathEnv())
        agent = await servers.start(SimpleAgent(config, registry=static_registry(model=model, math=env)))

The port is the one the server bound (read back, never guessed), so tests
run side by side without colliding. The pytest plugin
(`gym_grpc.testing.plugin`) offers the same as a `start` fixture.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from types import TracebackType
from typing import TypeVar

from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import GymServer, Running, serve

#: Seconds in-flight calls get when a test's server stops.
STOP_GRACE_SECONDS = 0.5

App = TypeVar("App", bound=GymServer)


class Servers:
    """Servers started by `start(app)`, all stopped (the last started first) on leaving the block."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.running: list[Running] = []

    async def start(self, app: GymServer) -> Running:
        """Serve `app` on a free port; the `Running` server has its `address` and its `app`."""
        server = await serve(app, self.host, 0)
        self.running.append(server)
        return server

    async def stop(self) -> None:
        while self.running:
            await self.running.pop().stop(grace=STOP_GRACE_SECONDS)

    async def __aenter__(self) -> Servers:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        await self.stop()


@contextlib.asynccontextmanager
async def serving(app: GymServer, host: str = "127.0.0.1") -> AsyncIterator[Running]:
    """Serve one `app` on a free port for the block; its address is `.address`."""
    async with Servers(host) as servers:
        yield await servers.start(app)


def static_registry(**servers: Running) -> Registry:
    """A Registry that knows the given running servers by keyword name, as `gym-grpc run`'s would."""
    return Registry(static={name: s.address for name, s in servers.items()})
