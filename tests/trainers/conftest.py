"""The trainer adapters' tests: run them with `.ci/trainers` (installs CPU torch, TRL and
tinker-cookbook pinned, then runs `pytest --trainers tests/trainers`).

Their modules import torch, TRL and tinker-cookbook only inside tests and fixtures, so that the
default run, whose virtualenv lacks them, still collects (and deselects) them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_grpc.engines import local_vllm
from tests.real_engine.conftest import engine, engine_traces  # noqa: F401 - the real CPU vLLM, one per session


@pytest.fixture(scope="session")
def model_dir() -> Path:
    """SmolLM2-135M-Instruct as the real engine serves it (safetensors + tokenizer), prepared if need be."""
    return local_vllm.prepare().model_dir
