"""pytest fixtures of the testing kit. Enable them in the conftest.py at your tests' root:

    pytest_plugins = ["gym_grpc.testing.plugin"]

`start(app)` serves a server on 127.0.0.1:0 for the test; `fake_engine(...)`
starts a `FakeEngine` (an OpenAI-compatible HTTP engine). Both stop what they
started when the test ends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from gym_grpc.server.serving import GymServer, Running
from gym_grpc.testing.fake_engine import FakeEngine
from gym_grpc.testing.servers import Servers


@pytest.fixture
async def start() -> AsyncIterator[Callable[[GymServer], Awaitable[Running]]]:
    """start(app) serves app on 127.0.0.1:0; everything started is stopped after the test."""
    async with Servers() as servers:
        yield servers.start


@pytest.fixture
async def fake_engine() -> AsyncIterator[Callable[..., Awaitable[FakeEngine]]]:
    """fake_engine(turns, **options): a started FakeEngine (its URL is `.base_url`), stopped after the test."""
    engines: list[FakeEngine] = []

    async def make(*args: Any, **kwargs: Any) -> FakeEngine:
        engine = FakeEngine(*args, **kwargs)
        await engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()
