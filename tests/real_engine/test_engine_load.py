"""A model server reads the real vLLM's load: the metric names gym_grpc.engines.load looks for are the
ones the installed vLLM serves, and a request that is generating shows in them."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request

import pytest

from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.engines import local_vllm
from gym_grpc.rpc import transport
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc

pytestmark = pytest.mark.real_engine


async def test_a_generating_request_shows_in_the_model_servers_engine_load(start, engine: local_vllm.Engine) -> None:
    server = await start(VLLMModel({"base_url": engine.base_url, "model": engine.model}, name="model"))
    body = {
        "model": engine.model,
        "prompt": "Write a long story about a lighthouse.",
        "max_tokens": 512,
        "ignore_eos": True,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{engine.base_url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    generating, release = threading.Event(), threading.Event()

    def stream() -> None:
        with urllib.request.urlopen(request, timeout=300) as reply:
            reply.readline()  # the first streamed token: the request is in the engine's batch
            generating.set()
            release.wait(300)  # then closed: vLLM aborts the request

    thread = threading.Thread(target=stream)
    thread.start()
    try:
        assert await asyncio.to_thread(generating.wait, 300)
        async with transport.open_channel(server.address) as channel:
            counters = await admin_grpc.AdminServiceStub(channel).GetCounters(admin_pb.GetCountersRequest(), timeout=30)
    finally:
        release.set()
        await asyncio.to_thread(thread.join)
    (load,) = counters.engines
    assert (load.url, load.error) == (engine.base_url, "")
    assert load.requests_running >= 1 and 0 < load.kv_cache_usage <= 1
