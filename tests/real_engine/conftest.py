"""The local CPU vLLM for the real_engine tests: prepared (cached), started once per session, stopped after.

Run them with `pytest --real-engine tests/real_engine`. The first run builds
the engine's virtualenv and model under GYM_GRPC_ENGINE_CACHE (about 2
minutes and 3.5 GB); later runs reuse them. Any failure to prepare or start is
an error of every test that needs the engine, never a skip.

To iterate on the tests without starting vLLM each time, start it once
(`python -m gym_grpc.engines.local_vllm start`) and give its base URL in
GYM_GRPC_REAL_ENGINE_URL; the tests then use it and leave it running.
"""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Iterator

import pytest

from gym_grpc.engines import local_vllm


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_vllm.Engine]:
    given = os.environ.get("GYM_GRPC_REAL_ENGINE_URL")
    if given:
        with urllib.request.urlopen(f"{given.rstrip('/')}/models", timeout=10) as reply:
            model = json.loads(reply.read())["data"][0]["id"]
        yield local_vllm.Engine(given.rstrip("/"), pid=0, log_path=tmp_path_factory.mktemp("none"), model=model)
        return
    prepared = local_vllm.prepare()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with local_vllm.running(prepared, log_path=log_path) as running:
        yield running
