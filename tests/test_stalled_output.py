"""Servers keep serving when nobody reads what they log: `gym-grpc run` stopped (SIGSTOP, as a
debugger or a terminal's Ctrl-S stops it), or its output piped to a program that does not read.

A server's log is a pipe the runner drains; once a pipe holds ~64 KB, a write to it blocks. Real
processes: `gym-grpc run` of the quickstart, 3,000 calls that each log a line (~450 KB in all), then
health checks and rollouts against the servers themselves, each bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import threading

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_grpc import errors
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server import stderr
from gym_grpc.testing.processes import GymRun, gym_grpc_command
from tests.support import QUICKSTART, eventually, task

#: Failed calls, each logged by the weather server (an INFO line of ~150 bytes).
LOGGED_CALLS = 3000


async def _rollouts(registry: Registry) -> list:
    agent = AgentClient(registry, "math_agent")
    return await asyncio.gather(*(agent.run(task(f"{i} + 1", expected_answer=i + 1), timeout=30) for i in range(10)))


async def _warm_up(servers: dict[str, str]) -> None:
    """Rollouts before the runner stops reading: the agents find their model and environment
    through the registry, which the runner serves, once."""
    registry = Registry(static=servers)
    try:
        await _rollouts(registry)
    finally:
        await registry.close()


async def _log_a_lot_then_serve(servers: dict[str, str]) -> None:
    """Make the weather server log LOGGED_CALLS lines, then check that every server answers
    its health check and that rollouts go through, each within a deadline far above their need."""
    registry = Registry(static=servers)
    try:
        weather = ResourcesClient(registry, "weather", timeout=30)
        for _ in range(LOGGED_CALLS // 100):
            outcomes = await asyncio.gather(
                *(weather.seed_session("", task("x")) for _ in range(100)), return_exceptions=True
            )
            assert all(isinstance(o, errors.InvalidArgument) for o in outcomes), outcomes[:3]
        for address in servers.values():
            async with transport.open_channel(address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, address
        rollouts = await _rollouts(registry)
        assert len(rollouts) == 10
    finally:
        await registry.close()


@pytest.mark.slow
def test_servers_keep_serving_when_the_runners_output_is_a_pipe_nobody_reads():
    process = subprocess.Popen(
        [gym_grpc_command(), "run", str(QUICKSTART), "--registry", "127.0.0.1:0", "--ready-json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # never read
    )
    try:
        assert process.stdout is not None
        ready = json.loads(process.stdout.readline())
        servers = {s["name"]: s["addresses"][0] for s in ready["servers"]}
        asyncio.run(_warm_up(servers))
        asyncio.run(_log_a_lot_then_serve(servers))
        assert process.poll() is None
    finally:
        process.kill()
        process.wait()


@pytest.mark.slow
def test_servers_keep_serving_while_the_runner_is_stopped_and_their_log_comes_through_after():
    with GymRun.start(QUICKSTART) as run:
        asyncio.run(_warm_up(run.servers))
        run.process.send_signal(signal.SIGSTOP)
        try:
            asyncio.run(_log_a_lot_then_serve(run.servers))
        finally:
            run.process.send_signal(signal.SIGCONT)
        # Queued, not lost: every logged call reaches the log once the runner reads again.
        asyncio.run(
            eventually(
                lambda: run.log().count("SeedSession INVALID_ARGUMENT") >= LOGGED_CALLS,
                f"the {LOGGED_CALLS} calls' log lines in the runner's log",
            )
        )


def test_a_full_queue_drops_lines_counts_them_and_says_how_many_where_they_went_missing():
    """On a pipe nobody reads, writes return at once; past the queue's capacity they are dropped
    and counted. Once the pipe is read again, every line kept comes out in order, and a note stands
    in each gap saying how many lines it holds, however late the writer thread started."""
    read, write = os.pipe()
    os.set_blocking(write, False)
    while True:  # fill the pipe, so that the writer thread blocks on it
        try:
            os.write(write, b"\0" * 65536)
        except BlockingIOError:
            break
    os.set_blocking(write, True)
    chunks: list[bytes] = []
    reader = threading.Thread(target=_read_to_end, args=(read, chunks))
    try:
        stream = stderr.Stderr(write, capacity=10)
        for i in range(1000):
            stream.write(f"line {i}\n")
        assert 980 <= stream.dropped < 1000
        reader.start()
        stream.drain(10)
        stream.write("line 1000\n")  # the last lines were dropped: this write's note tells of them
        stream.drain(10)
    finally:
        os.close(write)
        if reader.is_alive():
            reader.join(10)
        os.close(read)
    told, gap, kept = 0, 0, [-1]
    for line in b"".join(chunks).replace(b"\0", b"").decode().splitlines():
        if note := re.fullmatch(r"\[gym-grpc\] ([\d,]+) log lines dropped: .+", line):
            gap = int(note[1].replace(",", ""))
            told += gap
            continue
        number = int(line.removeprefix("line "))
        assert number == kept[-1] + 1 + gap, f"{line!r} after line {kept[-1]} and a note of {gap} dropped"
        kept.append(number)
        gap = 0
    assert kept[1] == 0 and 999 not in kept  # the first lines wait in the queue; the last are dropped
    assert (kept[-1], told) == (1000, stream.dropped)


def _read_to_end(fd: int, chunks: list[bytes]) -> None:
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
