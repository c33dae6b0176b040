"""How the registry scales with its watchers: N WatchServer streams open on one registry,
then one change of an entry; the time until every watcher has it, and the CPU spent.

    python bench/registry_fanout.py 2000     # prints one JSON line

The registry and the watchers share this one process and its one event loop (so the
CPU figure covers both ends); on a cluster each watcher is a client process elsewhere.
Every process that calls a server by name (an agent replica, a collector, a trainer)
holds one stream per name it calls.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc

from gym_grpc.launch.runner import RegistryServer
from gym_grpc.server.serving import serve
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import registry_service_pb2_grpc as reg_grpc

#: Watch streams per client channel (one HTTP/2 connection each), as a process watching a few names has.
STREAMS_PER_CHANNEL = 4


def _entry(replicas: int) -> reg.ServerInfo:
    addresses = [f"10.0.{i // 250}.{i % 250 + 1}:50051" for i in range(replicas)]
    return reg.ServerInfo(
        name="env", addresses=addresses, replicas=[reg.Replica(address=a, index=i) for i, a in enumerate(addresses)]
    )


async def main(watchers: int) -> dict:
    registry = await serve(RegistryServer(), "127.0.0.1", 0)
    servicer = registry.app.servicer
    servicer.add(_entry(100))
    channels = [
        grpc.aio.insecure_channel(registry.address, options=[("grpc.bench_index", i)])
        for i in range(-(-watchers // STREAMS_PER_CHANNEL))
    ]
    streams = [
        reg_grpc.RegistryServiceStub(channels[i // STREAMS_PER_CHANNEL]).WatchServer(reg.WatchServerRequest(name="env"))
        for i in range(watchers)
    ]
    await asyncio.gather(*(s.read() for s in streams))  # every watcher has the first entry
    cpu = time.process_time()
    started = time.monotonic()
    servicer.add(_entry(99))  # one replica lost
    updates = await asyncio.gather(*(s.read() for s in streams))
    seconds = time.monotonic() - started
    cpu = time.process_time() - cpu
    assert all(len(u.server.replicas) == 99 for u in updates)
    for stream in streams:
        stream.cancel()
    for channel in channels:
        await channel.close()
    await servicer.close()
    await registry.stop(0)
    return {
        "watchers": watchers,
        "replicas_in_entry": 99,
        "seconds_to_reach_all": round(seconds, 3),
        "cpu_ms_per_watcher": round(1000 * cpu / watchers, 3),
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(int(sys.argv[1])))))
