"""The registry client: one lookup per name however many callers ask at once, and a retry after a miss."""

import asyncio

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.rpc.registry import Registry, RegistryServicer
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import registry_service_pb2_grpc as reg_grpc


class CountingRegistry(RegistryServicer):
    def __init__(self) -> None:
        super().__init__()
        self.lookups = 0

    async def GetServer(self, request, context):
        self.lookups += 1
        await asyncio.sleep(0.01)  # long enough for every caller to be waiting at once
        return await super().GetServer(request, context)


@pytest.fixture
async def registry_service():
    servicer = CountingRegistry()
    server = grpc.aio.server()
    reg_grpc.add_RegistryServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield servicer, f"127.0.0.1:{port}"
    await server.stop(0)


async def test_concurrent_first_lookups_of_a_name_share_one_call(registry_service):
    servicer, address = registry_service
    servicer.add(reg.ServerInfo(name="math", addresses=["127.0.0.1:1"]))
    registry = Registry(address)
    infos = await asyncio.gather(*(registry.info("math") for _ in range(500)))
    assert {tuple(i.addresses) for i in infos} == {("127.0.0.1:1",)}
    assert servicer.lookups == 1
    await registry.close()


async def test_a_name_not_found_is_asked_again_later(registry_service):
    servicer, address = registry_service
    registry = Registry(address)
    with pytest.raises(errors.NotFound, match="no server named 'late'"):
        await registry.info("late")
    servicer.add(reg.ServerInfo(name="late", addresses=["127.0.0.1:2"]))
    assert list((await registry.info("late")).addresses) == ["127.0.0.1:2"]
    assert servicer.lookups == 2
    await registry.close()


async def test_watch_sends_the_entry_then_each_change_and_ends_when_the_registry_closes(registry_service):
    servicer, address = registry_service
    servicer.add(reg.ServerInfo(name="env", addresses=["127.0.0.1:1"]))
    channel = grpc.aio.insecure_channel(address)
    stream = reg_grpc.RegistryServiceStub(channel).WatchServer(reg.WatchServerRequest(name="env"))
    first = (await stream.read()).server
    assert list(first.addresses) == ["127.0.0.1:1"] and first.generation == 1
    servicer.add(reg.ServerInfo(name="env", addresses=["127.0.0.1:1"]))  # the same entry: nothing to send
    servicer.add(reg.ServerInfo(name="env", addresses=["127.0.0.1:1", "127.0.0.1:2"]))
    second = (await stream.read()).server
    assert list(second.addresses) == ["127.0.0.1:1", "127.0.0.1:2"] and second.generation == 2
    await servicer.close()
    assert await stream.read() == grpc.aio.EOF
    assert await stream.code() == grpc.StatusCode.OK
    await channel.close()


async def test_watching_an_unknown_server_is_not_found(registry_service):
    servicer, address = registry_service
    servicer.add(reg.ServerInfo(name="math", addresses=["127.0.0.1:1"]))
    async with grpc.aio.insecure_channel(address) as channel:
        stream = reg_grpc.RegistryServiceStub(channel).WatchServer(reg.WatchServerRequest(name="maht"))
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stream.read()
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "did you mean 'math'" in caught.value.details()
