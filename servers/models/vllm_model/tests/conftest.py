"""Fixtures of the vLLM model server's tests."""

import pytest


@pytest.fixture
def engine(fake_engine):
    """engine(*args, **kwargs): a started FakeEngine, stopped after the test (the kit's `fake_engine`)."""
    return fake_engine
