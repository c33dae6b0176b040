"""What a client in any language can discover on every server before its first call:
health (Check, Watch and List), reflection (v1 and v1alpha, with the .proto comments),
the protocol handshake, and the .proto files shipped with the package."""

import asyncio
import json
import subprocess

from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_grpc import transport
from tests.support import Calculator
from tests.test_cli import _tool


async def _grpcurl(*args: str) -> str:
    """grpcurl in a thread: the server under test runs on this event loop."""
    done = await asyncio.to_thread(
        subprocess.run, [_tool("grpcurl"), "-plaintext", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


async def test_health_list_answers_every_service_and_follows_updates(start):
    server = await start(Calculator())
    async with transport.open_channel(server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        listed = await health.List(health_pb2.HealthListRequest(), timeout=30)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert {name: s.status for name, s in listed.statuses.items()} == {
            "": serving,
            "gym.v1.ResourcesService": serving,
            "gym.v1.AdminService": serving,
        }
        await server.health.set("gym.v1.ResourcesService", health_pb2.HealthCheckResponse.NOT_SERVING)
        listed = await health.List(health_pb2.HealthListRequest(), timeout=30)
        assert listed.statuses["gym.v1.ResourcesService"].status == health_pb2.HealthCheckResponse.NOT_SERVING
    by_grpcurl = json.loads(await _grpcurl(server.address, "grpc.health.v1.Health/List"))
    assert by_grpcurl["statuses"][""] == {"status": "SERVING"}
