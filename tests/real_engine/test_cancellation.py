"""A model call cancelled mid-generation stops its generation on the real engine, over HTTP and over gRPC.

Two identical calls go to the model server of `gym-grpc run configs/vllm.yaml` at once (greedy,
`ignore_eos`, 3,000 tokens: minutes on this CPU), so the engine generates both in the same steps and,
left alone, would finish both in the same step. The test waits for the engine's own count of its
requests (HTTP: /metrics `vllm:num_requests_running` + `waiting`; gRPC: GetLoads) to say 2, cancels
the first call (the caller gone: a rollout cancelled, or its deadline passed), and then that count
must reach 1 while the second call is still generating: the first generation was aborted, not run to
its end. Then the second is cancelled too, and the count goes back to 0. Over HTTP the model server's
closed connection is what vLLM sees; over gRPC the cancelled Generate.
"""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from pathlib import Path

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2 as pb
from smg_grpc_proto import vllm_engine_pb2_grpc

from gym_grpc.client.stubs import ModelClient
from gym_grpc.engines import local_vllm
from gym_grpc.engines.settings import GRPC_SCHEME
from gym_grpc.responses import user_message
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from tests.real_engine import gym_cli

pytestmark = pytest.mark.real_engine

TOKENS = 3000


class EngineRequests:
    """The engine's own count of the requests it holds (running or waiting)."""

    def __init__(self, engine: local_vllm.Engine) -> None:
        self.engine = engine
        self.channel = None
        if engine.base_url.startswith(GRPC_SCHEME):
            self.channel = grpc.aio.insecure_channel(engine.base_url.removeprefix(GRPC_SCHEME))

    async def count(self) -> int:
        if self.channel is not None:
            loads = await vllm_engine_pb2_grpc.VllmEngineStub(self.channel).GetLoads(pb.GetLoadsRequest(), timeout=30)
            return sum(load.num_running_reqs + load.num_waiting_reqs for load in loads.loads)
        return await asyncio.to_thread(self._scrape)

    def _scrape(self) -> int:
        with urllib.request.urlopen(f"{self.engine.base_url.removesuffix('/v1')}/metrics", timeout=30) as reply:
            text = reply.read().decode()
        found = re.findall(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\} (\S+)$", text, re.MULTILINE)
        assert len(found) == 2, "no vllm:num_requests_running or _waiting in /metrics"
        return int(sum(map(float, found)))

    async def until(self, wanted: int, limit: float = 300) -> None:
        """Poll until the count is `wanted` (the limit only bounds a hang)."""
        async with asyncio.timeout(limit):
            while await self.count() != wanted:
                await asyncio.sleep(0.1)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


def _params() -> r.CreateParams:
    params = r.CreateParams(temperature=0.0, max_output_tokens=TOKENS)
    params.input_items.items.append(user_message("Count from one to ten thousand, in words."))
    params.metadata["extra_body"] = json.dumps({"ignore_eos": True})
    return params


def test_a_call_cancelled_mid_generation_is_aborted_on_the_engine(policy: local_vllm.Engine, tmp_path: Path) -> None:
    with gym_cli.serving(policy, tmp_path, gym_cli.VLLM) as run:

        async def scenario() -> None:
            held = EngineRequests(policy)
            assert await held.count() == 0, "the engine is busy with something else"
            registry = Registry(run.registry)
            client = ModelClient(registry, "policy_model")
            try:
                first = asyncio.ensure_future(client.create_response(_params(), "first"))
                second = asyncio.ensure_future(client.create_response(_params(), "second"))
                await held.until(2)
                first.cancel()
                await held.until(1)
                assert not second.done(), "the second generation ended before the first was seen aborted"
                second.cancel()
                await held.until(0)
            finally:
                await registry.close()
                await held.close()

        asyncio.run(scenario())
