"""Replicas on one machine, without Ray: calls spread over a server's replicas by gRPC's
round_robin, a session's calls pinned to the replica that opened it, a replica that stops
serving taken out of the rotation by client-side health checking, clients that follow the
registry as replicas come and go, and a call lost with its replica that names it.

Replicas here are servers on loopback, in this process or (where a replica must die as a
process does) in their own processes; the registry is the real registry service."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gym_grpc import errors
from gym_grpc.client.stubs import ModelClient, ResourcesClient
from gym_grpc.responses import input_items, message_text
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import Running
from gym_grpc.testing import Calculator, Servers, say
from gym_grpc.testing.processes import GymRun
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, EchoModel, eventually, task, worker_process


def entry(name: str, *replicas: Running) -> reg.ServerInfo:
    """The registry's entry of a server with these replicas, as `gym-grpc run --ray` writes it."""
    return reg.ServerInfo(
        name=name,
        addresses=[s.address for s in replicas],
        replicas=[reg.Replica(address=s.address, index=i) for i, s in enumerate(replicas)],
    )


async def start_registry(servers: Servers) -> Running:
    from gym_grpc.launch.runner import RegistryServer

    return await servers.start(RegistryServer())


async def replicated(servers: Servers, name: str, apps: list) -> tuple[list[Running], Registry]:
    """`apps` served as the replicas of server `name` behind a real registry service, and a
    client's Registry of that service."""
    registry_server = await start_registry(servers)
    replicas = [await servers.start(app) for app in apps]
    registry_server.app.servicer.add(entry(name, *replicas))
    return replicas, Registry(registry_server.address)


def params(text: str) -> r.CreateParams:
    p = r.CreateParams()
    p.input_items.items.add().message.CopyFrom(r.Message(role=r.ROLE_USER, text=text))
    return p


def calls(replica: Running, method: str) -> int:
    """Calls of `method` the replica answered OK."""
    counters = replica.app.counters.methods.get(method)
    return 0 if counters is None else counters.by_status["OK"]


async def test_calls_spread_over_every_replica_of_a_server():
    async with Servers() as servers:
        replicas, registry = await replicated(servers, "model", [EchoModel(delay=0) for _ in range(3)])
        client = ModelClient(registry, "model")
        try:
            for i in range(300):
                await client.create_response(params(f"hello {i}"))
        finally:
            await registry.close()
        counts = [len(replica.app.requests) for replica in replicas]
        assert sum(counts) == 300
        assert min(counts) >= 90, counts


async def test_the_first_burst_of_calls_is_spread_too():
    """round_robin alone would send a new channel's first calls to the replica that connected
    first: a collector's whole first window. The client waits until every replica answers."""
    async with Servers() as servers:
        replicas, registry = await replicated(servers, "model", [EchoModel(delay=0.05) for _ in range(3)])
        client = ModelClient(registry, "model")
        try:
            await asyncio.gather(*(client.create_response(params(f"{i}")) for i in range(300)))
        finally:
            await registry.close()
        counts = [len(replica.app.requests) for replica in replicas]
        assert sum(counts) == 300
        assert max(counts) - min(counts) <= 6, counts  # without the wait: [66, 168, 66] and the like


async def calculator_sessions(client: ResourcesClient, count: int) -> tuple[list[int], set[str]]:
    """`count` sessions of the calculator at once, each adding three times: how many adds each
    session's Verify saw, and the replicas that held them (SeedSessionResponse.replica)."""

    async def session(i: int) -> tuple[int, str]:
        session = f"s{i}"
        await client.seed_session(session, task("add", expected_answer=3))
        for _ in range(3):  # each call would fail on a replica without the session
            result = await client.call_tool(session, r.FunctionCall(name="add", arguments='{"a": 1, "b": 2}'))
            assert not result.error, result
        held_by = client.replica_of(session)
        verified = await client.verify(session, task("add", expected_answer=3), r.Response(output=say("3")))
        await client.close_session(session)
        return json.loads(verified.fields_json)["tool_calls_seen"], held_by

    done = await asyncio.gather(*(session(i) for i in range(count)))
    return [seen for seen, _ in done], {held_by for _, held_by in done}


async def test_a_sessions_calls_reach_the_replica_that_opened_it():
    async with Servers() as servers:
        replicas, registry = await replicated(servers, "calc", [Calculator() for _ in range(3)])
        for replica in replicas:
            replica.app.replica = replica.address
        client = ResourcesClient(registry, "calc")
        try:
            seen, _ = await calculator_sessions(client, 60)
        finally:
            await registry.close()
        assert seen == [3] * 60  # every session kept its own count: one replica held it throughout
        for replica in replicas:
            opened = calls(replica, "SeedSession")
            assert opened > 0
            assert calls(replica, "CallTool") == 3 * opened
            assert calls(replica, "Verify") == calls(replica, "CloseSession") == opened
            assert not replica.app.sessions  # all closed where they were opened
        assert not client._sessions  # and forgotten by the client


@pytest.mark.slow
def test_a_sessions_calls_reach_the_worker_process_that_opened_it(tmp_path):
    """A resources server in two processes behind one port (`num_workers: 2`), called from outside
    the run: the kernel gives each of the client's connections to either process, so a session's
    calls round the connections would reach the one without it. Each worker answers SeedSession
    with a port it serves alone (Worker.address), and the session's calls go there."""
    config = tmp_path / "calc.yaml"
    config.write_text("servers:\n  calc: {entrypoint: gym_grpc.testing:Calculator, num_workers: 2}\n")
    run = GymRun.start(config)
    try:

        async def sessions() -> tuple[reg.ServerInfo, list[int], set[str]]:
            registry = Registry(run.registry)
            try:
                info = await registry.info("calc")
                seen, held_by = await calculator_sessions(ResourcesClient(registry, "calc"), 60)
            finally:
                await registry.close()
            return info, seen, held_by

        info, seen, held_by = asyncio.run(sessions())
    finally:
        run.stop()
    (replica,) = info.replicas
    own = {worker.address for worker in replica.workers}
    assert len(own) == 2 and replica.address not in own, info
    assert seen == [3] * 60  # every session kept its own count: one process held it throughout
    assert held_by == own  # both processes opened sessions, and each named its own port


async def test_a_replica_that_stops_serving_is_taken_out_of_the_rotation():
    async with Servers() as servers:
        replicas, registry = await replicated(servers, "model", [EchoModel(delay=0) for _ in range(2)])
        client = ModelClient(registry, "model")
        leaving = replicas[0].app.requests

        async def calls_until(done, what: str) -> None:
            """Keep calling until `done()`: the health update travels over a Watch stream."""
            deadline = time.monotonic() + 20
            while not done():
                assert time.monotonic() < deadline, what
                await client.create_response(params("which?"))

        try:
            await calls_until(lambda: all(r.app.requests for r in replicas), "calls on both replicas")
            await replicas[0].health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
            seen = [len(leaving)]  # calls it had; 50 calls in a row without one more means it is out

            def out_of_rotation() -> bool:
                seen.append(len(leaving))
                return len(seen) > 50 and seen[-51] == seen[-1]

            await calls_until(out_of_rotation, "the replica that stopped serving still gets calls")
            await replicas[0].health.set("", health_pb2.HealthCheckResponse.SERVING)
            back = len(leaving)
            await calls_until(lambda: len(leaving) > back, "no calls on the replica serving again")
        finally:
            await registry.close()


class HeldModel(EchoModel):
    """Answers at once, except prompts that say "hold": those wait until `release` is set."""

    def __init__(self) -> None:
        super().__init__(delay=0)
        self.release = asyncio.Event()
        self.held = 0

    async def create_response(self, params, session_id):
        if message_text(input_items(params)[-1].message) == "hold":
            self.held += 1
            await self.release.wait()
        return await super().create_response(params, session_id)


async def test_clients_follow_the_registry_as_replicas_come_and_go():
    async with Servers() as servers:
        registry_server = await start_registry(servers)
        first = await servers.start(HeldModel())
        second = await servers.start(HeldModel())
        servicer = registry_server.app.servicer
        servicer.add(entry("model", first))
        registry = Registry(registry_server.address)
        client = ModelClient(registry, "model")
        held: list[asyncio.Future] = []
        try:
            await client.create_response(params("one"))
            assert len(first.app.requests) == 1

            servicer.add(entry("model", first, second))  # a replica joins

            async def reaches(replica: Running) -> None:
                while not replica.app.requests:
                    await client.create_response(params("which?"))

            await asyncio.wait_for(reaches(second), 20)

            # A call in flight on the replica about to leave (round_robin sends every other one there).
            while not first.app.held:
                assert len(held) < 20, "no held call reached the first replica"
                held.append(asyncio.ensure_future(client.create_response(params("hold"))))
                await eventually(lambda: first.app.held + second.app.held == len(held), "the held call arrives")
            servicer.add(entry("model", second))  # the first replica leaves the registry

            async def followed() -> bool:
                return list((await registry.info("model")).addresses) == [second.address]

            deadline = time.monotonic() + 20
            while not await followed():
                assert time.monotonic() < deadline, "the client did not follow the registry"
                await asyncio.sleep(0.01)
            count = len(first.app.requests)
            for i in range(20):
                await client.create_response(params(f"after {i}"))
            assert len(first.app.requests) == count  # new calls go to the replicas listed now
            first.app.release.set()
            second.app.release.set()
            for call in held:
                assert (await call).output  # the call in flight on the old channel finished there
        finally:
            for call in held:
                call.cancel()
            await registry.close()


def _start_replica_process(latency: float) -> tuple[subprocess.Popen, str]:
    """A local-policy model server in its own process, as `gym-grpc run` starts one; its address."""
    entrypoint = f"{REPO}/servers/models/local_policy/server.py:LocalPolicyModel"
    return worker_process("model", entrypoint, {"latency_seconds": latency})


async def _in_flight(address: str) -> int:
    """CreateResponse calls in flight in the server at `address`."""
    async with transport.open_channel(address) as channel:
        counters = await admin_grpc.AdminServiceStub(channel).GetCounters(admin_pb.GetCountersRequest(), timeout=10)
    return sum(m.in_flight for m in counters.methods if m.method == "CreateResponse")


@pytest.mark.slow
async def test_a_call_lost_with_its_replica_fails_unavailable_naming_it():
    # The calls wait out a latency far longer than the test: every call is still in its
    # server when the doomed one is killed, however slow this machine is today.
    processes = [_start_replica_process(latency=600.0) for _ in range(2)]
    (doomed, doomed_address), (_, survivor_address) = processes
    try:
        async with Servers() as servers:
            registry_server = await start_registry(servers)
            info = reg.ServerInfo(name="model", addresses=[doomed_address, survivor_address])
            registry_server.app.servicer.add(info)
            registry = Registry(registry_server.address)
            client = ModelClient(registry, "model")
            rollouts = []
            try:
                for _ in range(4):
                    await client.server_info()  # both replicas connected and answering
                rollouts = [asyncio.ensure_future(client.create_response(params(f"{i}"))) for i in range(4)]
                deadline = time.monotonic() + 30
                while (on_doomed := await _in_flight(doomed_address)) + await _in_flight(survivor_address) < 4:
                    assert time.monotonic() < deadline, "the calls did not all reach the replicas"
                    await asyncio.sleep(0.01)
                assert 0 < on_doomed < 4  # round_robin put calls on both
                doomed.send_signal(signal.SIGKILL)
                done: set[asyncio.Future] = set()
                while len(done) < on_doomed:  # the doomed replica's calls end; bounded by the wait's timeout
                    finished, _ = await asyncio.wait(rollouts, timeout=60, return_when=asyncio.FIRST_COMPLETED)
                    assert finished - done, "no call ended within 60 s of the kill"
                    done |= finished
                await asyncio.sleep(0.5)  # and no other call ends with them: the survivor serves on
                pending = [rollout for rollout in rollouts if not rollout.done()]
            finally:
                for rollout in rollouts:
                    rollout.cancel()
                await registry.close()
        assert len(done) == on_doomed and len(pending) == 4 - on_doomed  # the survivor's calls go on
        for failed in done:
            error = failed.exception()
            assert isinstance(error, errors.GymError) and error.code == grpc.StatusCode.UNAVAILABLE, error
            assert f"(replica {doomed_address} not answering)" in error.message, error.message
            assert survivor_address not in error.message
    finally:
        for process, _ in processes:
            process.kill()
            process.wait()
