"""The bootstrap every server shares: ports, health, reflection, limits, shutdown."""

import asyncio
import json
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.resources import ResourcesServer, Session, tool
from gym_grpc.rpc import transport
from gym_grpc.server.serving import serve
from gym_grpc.v1 import responses_pb2 as r
from tests.support import Calculator, static_registry, task


class Gate(ResourcesServer):
    """A tool that waits until the test opens the gate."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.gate = asyncio.Event()
        self.waiting = 0

    @tool
    async def wait(self) -> str:
        """Wait for the gate."""
        self.waiting += 1
        await self.gate.wait()
        return "through"

    async def verify(self, session: Session, response: r.Response) -> float:
        return 0.0


async def test_port_zero_binds_a_free_port_and_reads_it_back(start):
    a = await start(Calculator())
    b = await start(Calculator())
    assert a.port > 0 and b.port > 0 and a.port != b.port


async def test_a_taken_port_is_an_error_not_a_shared_port(start):
    first = await start(Calculator())
    with pytest.raises(OSError, match="could not bind"):
        await serve(Calculator(), "127.0.0.1", first.port)


async def test_health_and_reflection_are_served(start):
    server = await start(Calculator())
    async with transport.open_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "gym.v1.ResourcesService"):
            reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = set()
        async for reply in replies:
            names |= {s.name for s in reply.list_services_response.service}
    assert {"gym.v1.ResourcesService", "grpc.health.v1.Health"} <= names


async def test_thousands_of_waiting_calls_are_not_cancelled(start):
    # grpcio cancels calls past max_pending_requests (1,000 by default) unless raised.
    app = Gate()
    server = await start(app)
    client = ResourcesClient(static_registry(gate=server), "gate")
    await client.seed_session("s", task("wait"))
    n = 4000
    calls = [
        asyncio.ensure_future(client.call_tool("s", r.FunctionCall(name="wait", arguments="{}"))) for _ in range(n)
    ]
    for _ in range(600):
        if app.waiting == n:
            break
        await asyncio.sleep(0.05)
    app.gate.set()
    results = await asyncio.gather(*calls)
    assert app.waiting == n
    assert all(result.output == "through" and not result.error for result in results)
    await client.registry.close()


@pytest.mark.slow
async def test_stop_goes_not_serving_and_lets_in_flight_calls_finish(start):
    app = Gate()
    server = await start(app)
    client = ResourcesClient(static_registry(gate=server), "gate")
    await client.seed_session("s", task("wait"))
    async with transport.open_channel(server.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        in_flight = asyncio.ensure_future(client.call_tool("s", r.FunctionCall(name="wait", arguments="{}")))
        while app.waiting == 0:
            await asyncio.sleep(0.01)
        stopping = asyncio.ensure_future(server.stop(grace=5.0))
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        app.gate.set()
        result = await in_flight
        await stopping
    assert result.output == "through"
    with pytest.raises(grpc.aio.AioRpcError) as error:
        async with transport.open_channel(server.address) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
    assert error.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    await client.registry.close()


def test_a_child_forked_while_grpc_is_busy_starts():
    """Ray starts its raylet with a fork while our gRPC threads run; the child must live to exec.

    A real child process imports gym_grpc, keeps health calls in flight and forks
    300 children. With gRPC's fork handlers on, about one child in ten aborted
    before exec (measured 28-41 of 300), which is how `ray.init` failed in CI.
    The variable is removed from the child's environment so that only what
    importing gym_grpc does counts.
    """
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run(
        [sys.executable, "-m", "tests.programs.busy_forker", "300"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    assert json.loads(out.stdout.splitlines()[-1]) == {"children": 300, "failed": 0}, out.stderr[-2000:]
