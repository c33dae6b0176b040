"""Fixtures of the vLLM model server's tests."""

import pytest

from tests.fake_engine import FakeEngine


@pytest.fixture
async def engine():
    """engine(*args, **kwargs): a started FakeEngine, stopped after the test."""
    engines = []

    async def make(*args, **kwargs) -> FakeEngine:
        fake = FakeEngine(*args, **kwargs)
        await fake.start()
        engines.append(fake)
        return fake

    yield make
    for fake in engines:
        await fake.stop()
