"""Fixtures for every test, in tests/ and next to the servers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest

from gym_grpc.serving import GymServer, Running, serve


@pytest.fixture
async def start() -> AsyncIterator[Callable[[GymServer], Awaitable[Running]]]:
    """start(app) serves app on 127.0.0.1:0; everything started is stopped after the test."""
    running: list[Running] = []

    async def _start(app: GymServer) -> Running:
        server = await serve(app, "127.0.0.1", 0)
        running.append(server)
        return server

    yield _start
    for server in reversed(running):
        await server.stop(grace=0.5)


@pytest.fixture(scope="session")
def local_ray() -> Iterator[Any]:
    """A local Ray for the whole session (it takes seconds to start); Ray is in the test extras."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
