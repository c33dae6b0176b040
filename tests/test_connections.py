"""Calls to a server that answered before wait for it while it cannot be reached
(a restart costs time, not the call) and fail once it has been gone too long;
a server never reached fails at once."""

import asyncio

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import serve
from gym_grpc.v1 import responses_pb2 as r
from tests.support import Calculator, task

ADD = r.FunctionCall(name="add", arguments='{"a": 2, "b": 3}')


async def _until_the_channel_sees_the_server_gone(channel) -> None:
    """A call sent in the instant between a server's stop and the client noticing it goes
    out on the dying connection and fails (gRPC: "Stream removed"); a call made once the
    channel has left READY waits for the server."""
    state = channel.get_state()
    while state == grpc.ChannelConnectivity.READY:
        await channel.wait_for_state_change(state)
        state = channel.get_state()


async def test_a_call_waits_for_a_server_restarted_on_its_port_and_succeeds():
    server = await serve(Calculator(name="calc"))
    registry = Registry(static={"calc": server.address}, unreachable_seconds=30)
    client = ResourcesClient(registry, "calc")
    try:
        await client.seed_session("s", task("x"))
        await server.stop(grace=0)
        for connection in await registry.connections("calc"):
            await asyncio.wait_for(_until_the_channel_sees_the_server_gone(connection.channel), 30)
        waiting = asyncio.ensure_future(client.seed_session("t", task("y")))
        await asyncio.sleep(1.0)
        assert not waiting.done()  # waiting for the server, not failed
        server = await serve(Calculator(name="calc"), port=server.port)
        await asyncio.wait_for(waiting, 30)
        assert (await client.call_tool("t", ADD)).output == "5"
    finally:
        await registry.close()
        await server.stop(grace=0)


async def test_a_server_gone_longer_than_the_limit_fails_waiting_and_later_calls_with_unavailable():
    server = await serve(Calculator(name="calc"))
    registry = Registry(static={"calc": server.address}, unreachable_seconds=1.0)
    client = ResourcesClient(registry, "calc", timeout=120)
    try:
        await client.seed_session("s", task("x"))
        await server.stop(grace=0)
        for connection in await registry.connections("calc"):
            await asyncio.wait_for(_until_the_channel_sees_the_server_gone(connection.channel), 30)
        with pytest.raises(errors.Unavailable) as waited:  # not DeadlineExceeded: the limit ended the wait
            await client.seed_session("t", task("y"))
        expected = f"resources server 'calc' SeedSession: UNAVAILABLE: {server.address} unreachable for 1 s"
        assert str(waited.value) == expected
        with pytest.raises(errors.Unavailable) as at_once:  # no wait: grpc's own reason
            await client.seed_session("u", task("z"))
        assert "Connection refused" in str(at_once.value)
    finally:
        await registry.close()


async def test_a_server_never_reached_fails_at_once_with_grpcs_reason():
    registry = Registry(static={"calc": "127.0.0.1:1"})
    with pytest.raises(errors.Unavailable) as error:
        await ResourcesClient(registry, "calc", timeout=120).seed_session("s", task("x"))
    assert "Connection refused" in str(error.value)
    await registry.close()


async def test_a_peer_that_answered_is_waited_for_even_if_its_ready_state_went_unseen(monkeypatch):
    """The channel's state can go READY and away again before the connection's follower
    task runs (seen once in a full-suite run): a call that got an answer still counts."""
    monkeypatch.setattr(transport.Connection, "_follow_state", _sees_nothing)
    server = await serve(Calculator(name="calc"))
    registry = Registry(static={"calc": server.address}, unreachable_seconds=30)
    client = ResourcesClient(registry, "calc")
    try:
        await client.seed_session("s", task("x"))
        [connection] = await registry.connections("calc")
        assert connection.wait  # the next call waits for this peer if it is gone
    finally:
        await registry.close()
        await server.stop(grace=0)


async def _sees_nothing(self) -> None:
    await asyncio.Event().wait()


async def test_a_new_client_reaches_a_new_server_on_a_port_whose_old_server_another_client_saw_fail():
    """A channel that failed to reach a stopped server is in backoff; a new server on that port (a restart,
    or the OS giving the port to the next server) must answer a new client's first call, which does not
    wait. grpc shares connections across a process by default, and shared this failed one: the first
    call failed at once with the old "Connection refused" (it made the test suite flaky)."""
    old = await serve(Calculator(name="calc"))
    port = int(old.address.rsplit(":", 1)[1])
    async with transport.open_channel(old.address) as stale:
        await stale.channel_ready()
        await old.stop(grace=0)
        state = stale.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.TRANSIENT_FAILURE:  # it tried to reconnect, was refused
            await asyncio.wait_for(stale.wait_for_state_change(state), 30)
            state = stale.get_state(try_to_connect=True)
        new = await serve(Calculator(name="calc"), "127.0.0.1", port)
        registry = Registry(static={"calc": new.address})
        try:
            tools = await ResourcesClient(registry, "calc").describe_tools()
            assert tools.tools
        finally:
            await registry.close()
            await new.stop(grace=0)
