"""Forks children while gRPC is busy in another thread: run as its own process by the tests.

    python -m tests.programs.busy_forker COUNT

Imports gym_grpc the way a server process does, serves the health service on
loopback with calls in flight from a client in another thread, and meanwhile
starts COUNT children through a Python preexec_fn, which makes subprocess fork
(the way Ray starts its raylet). Prints a JSON line: how many children exited
with something other than 0.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading

import gym_grpc  # noqa: F401  (before grpc: it decides how gRPC treats fork when grpc is imported)

# isort: split
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def main(count: int) -> None:
    ready, done = threading.Event(), threading.Event()

    async def calls() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            ready.set()
            while not done.is_set():
                await asyncio.gather(*(stub.Check(health_pb2.HealthCheckRequest()) for _ in range(10)))
        await server.stop(0)

    caller = threading.Thread(target=asyncio.run, args=(calls(),))
    caller.start()
    ready.wait()
    failed = 0
    for _ in range(count):
        child = subprocess.run(["true"], preexec_fn=lambda: None, stderr=subprocess.DEVNULL)
        failed += child.returncode != 0
    done.set()
    caller.join()
    print(json.dumps({"children": count, "failed": failed}))


if __name__ == "__main__":
    main(int(sys.argv[1]))
