"""ModelService.UpdateWeights: ordered, idempotent, bounded, and never leaving an engine paused.

The vLLM model server in front of two engines of gym_grpc/testing/fake_engine.py (real aiohttp
servers that record the RL control calls they get). The fakes stand in for vLLM where these tests
need an engine to fail, hang or die on demand, which the real one (shared by the real-engine suite,
3 GB) cannot do without being lost; the update itself runs on the real CPU vLLM in
tests/real_engine/test_weight_updates.py. The trainer that goes away is a real `gym-grpc
update-weights` process, killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import struct
import subprocess
from pathlib import Path

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.client.stubs import ModelClient
from gym_grpc.launch.runner import RegistryServer
from gym_grpc.responses import final_text
from gym_grpc.rpc import transport
from gym_grpc.testing.fake_engine import FakeEngine, Turn
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import model_service_pb2_grpc as model_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, eventually, start_run, static_registry, tool

VLLM = REPO / "configs" / "vllm.yaml"
UPDATE = ["pause keep", "reload {path}", "label {version}", "resume"]


@pytest.fixture
async def fakes():
    pair = [FakeEngine([Turn(content="5")]), FakeEngine([Turn(content="5")])]
    for fake in pair:
        await fake.start()
    yield pair
    for fake in pair:
        await fake.stop()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


async def _model(start, fakes: list[FakeEngine], **config):
    base_url = [fake.base_url for fake in fakes]
    server = await start(VLLMModel({"base_url": base_url, "model": "policy", **config}, name="model"))
    return server, ModelClient(static_registry(model=server), "model")


async def _registry(start, server) -> str:
    """A registry (as `gym-grpc run` serves it) that knows the model server: what the CLI asks."""
    registry = RegistryServer()
    served = await start(registry)
    registry.servicer.add(reg.ServerInfo(name="model", role=reg.SERVER_ROLE_MODEL, addresses=[server.address]))
    return served.address


def _calls(path: Path, version: int) -> list[str]:
    return [step.format(path=path, version=version) for step in UPDATE]


async def test_an_update_pauses_loads_labels_and_resumes_every_engine_and_the_server_serves_its_version(
    start, fakes, checkpoint
):
    server, client = await _model(start, fakes)
    (answer,) = await client.update_weights(1, str(checkpoint))
    assert answer.updated and not answer.HasField("previous") and answer.seconds > 0
    assert [e.engine for e in answer.engines] == [fake.base_url for fake in fakes]
    assert all(e.load_seconds >= 0 and e.pause_seconds >= 0 for e in answer.engines)
    for fake in fakes:
        assert fake.control == _calls(checkpoint, 1) and not fake.paused and fake.weight_version == "1"
    assert server.app.served_version.get() == 1
    # a turn generated after it is stamped with the version (the fakes give no weight version spans)
    params = r.CreateParams()
    params.input_items.items.add().message.CopyFrom(r.Message(role=r.ROLE_USER, text="What is 2 + 3?"))
    turn = await client.create_response(params, "s")
    assert turn.output[-1].message.policy_version == 1
    await client.registry.close()


class _OneExchangePerConnection:
    """A TCP relay in front of an engine that resets a connection when a second request comes on
    it: what a request meets on a connection kept from an earlier one when the engine closes it
    as the request goes out (uvicorn, vLLM's HTTP server, closes one idle for 5 s), made certain
    here where it is a race in life. It broke a weight update of bench/async_training.py."""

    def __init__(self, upstream: str) -> None:
        self._upstream = int(upstream.rsplit(":", 1)[1].split("/")[0])
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task[None]] = set()
        self.resets = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for relay in self._relays:
            relay.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._relays.add(asyncio.current_task())  # type: ignore[arg-type]
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._upstream)
        answered = asyncio.Event()

        async def back() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                answered.set()

        answers = asyncio.ensure_future(back())
        try:
            while data := await reader.read(65536):
                if answered.is_set():  # a second request: reset, as a socket closed under it does
                    writer.get_extra_info("socket").setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    writer.transport.abort()
                    self.resets += 1
                    return
                up_writer.write(data)
        finally:
            answers.cancel()
            up_writer.close()


async def test_an_update_never_fails_for_a_connection_the_engine_closed_as_a_control_call_went_out(
    start, fakes, checkpoint
):
    """The control calls of an update (pause, load, label, resume) are not retried: each goes on a
    connection of its own, never on one an earlier request used, which the engine may be closing."""
    relay = _OneExchangePerConnection(fakes[0].base_url)
    base_url = await relay.start()
    try:
        server = await start(VLLMModel({"base_url": base_url, "model": "policy"}, name="model"))
        client = ModelClient(static_registry(model=server), "model")
        for version in (1, 2):
            (answer,) = await client.update_weights(version, str(checkpoint))
            assert answer.updated, answer
        assert fakes[0].control == _calls(checkpoint, 1) + _calls(checkpoint, 2) and not fakes[0].paused
        assert relay.resets == 0
        await client.registry.close()
    finally:
        await relay.stop()


async def test_a_retried_update_does_nothing_and_an_older_version_is_refused(start, fakes, checkpoint):
    server, client = await _model(start, fakes)
    await client.update_weights(3, str(checkpoint))
    (again,) = await client.update_weights(3, str(checkpoint))
    assert not again.updated and again.previous == 3 and not again.engines
    with pytest.raises(errors.FailedPrecondition) as older:
        await client.update_weights(2, str(checkpoint))
    assert older.value.reason == errors.Reason.POLICY_VERSION_BEHIND and "serves policy version 3" in str(older.value)
    assert all(fake.control == _calls(checkpoint, 3) for fake in fakes)  # nothing more reached the engines
    await client.registry.close()


async def test_an_engine_that_fails_to_load_is_named_every_engine_is_resumed_and_the_version_stays(
    start, fakes, checkpoint
):
    server, client = await _model(start, fakes)
    fakes[1].control_faults["/collective_rpc"] = 500
    with pytest.raises(errors.Unavailable) as failed:
        await client.update_weights(1, str(checkpoint), "abort")
    message = str(failed.value)
    assert failed.value.reason == errors.Reason.WEIGHT_UPDATE_FAILED
    assert f"engine {fakes[1].base_url} at load" in message and "every engine paused for it resumed" in message
    assert fakes[0].control[-1] == fakes[1].control[-1] == "resume" and not any(f.paused for f in fakes)
    assert server.app.served_version.get() is None
    del fakes[1].control_faults["/collective_rpc"]
    (answer,) = await client.update_weights(1, str(checkpoint), "abort")  # the same version, once fixed
    assert answer.updated and server.app.served_version.get() == 1
    await client.registry.close()


async def test_an_update_past_its_deadline_names_the_engine_that_did_not_follow_and_resumes_both(
    start, fakes, checkpoint
):
    server, client = await _model(start, fakes)
    stuck = fakes[0].control_faults["/pause"] = asyncio.Event()  # draining generations that never end
    # 10 s, so that the server keeps its whole reserve for the resumes and the answer
    # (REPLY_RESERVE_SECONDS, at most a fifth of the deadline): of 1 s it kept 0.2 s, which a
    # loaded CI run did not leave them, and the caller heard only its own deadline.
    with pytest.raises(errors.DeadlineExceeded) as late:
        await client.update_weights(1, str(checkpoint), "wait", timeout=10.0)
    assert f"engine {fakes[0].base_url} at pause: no answer within" in str(late.value)
    await eventually(lambda: fakes[0].control[-1:] == fakes[1].control[-1:] == ["resume"], "both resumed")
    assert not fakes[1].paused and server.app.served_version.get() is None
    stuck.set()
    await client.registry.close()


async def test_an_engine_that_dies_during_an_update_is_named_and_the_other_resumed(start, fakes, checkpoint):
    server, client = await _model(start, fakes)
    loading = fakes[1].control_faults["/collective_rpc"] = asyncio.Event()

    async def die_while_loading() -> None:
        await eventually(lambda: fakes[1].control[-1:] == [f"reload {checkpoint}"], "engine 2 loading")
        await fakes[1].stop()

    dying = asyncio.ensure_future(die_while_loading())
    with pytest.raises(errors.Unavailable) as failed:
        await client.update_weights(1, str(checkpoint))
    await dying
    loading.set()
    message = str(failed.value)
    assert f"engine {fakes[1].base_url} at load" in message
    assert f"not resumed: engine {fakes[1].base_url}" in message  # it is gone
    assert fakes[0].control[-1] == "resume" and not fakes[0].paused
    assert server.app.served_version.get() is None
    await client.registry.close()


async def test_an_update_whose_caller_is_killed_still_finishes_and_resumes_the_engines(start, fakes, checkpoint):
    """The trainer is a real `gym-grpc update-weights` process, SIGKILLed while the engines load."""
    server, client = await _model(start, fakes)
    loading = fakes[0].control_faults["/collective_rpc"] = asyncio.Event()
    registry = await _registry(start, server)
    process = subprocess.Popen(
        [tool("gym-grpc"), "update-weights", "model", "4", "--checkpoint", str(checkpoint), "--registry", registry],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        await eventually(lambda: fakes[0].control[-1:] == [f"reload {checkpoint}"], "the engines loading")
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    loading.set()  # the load ends after its caller is gone
    await eventually(lambda: server.app.served_version.get() == 4, "version 4 served")
    await eventually(lambda: all(f.control == _calls(checkpoint, 4) for f in fakes), "every engine resumed")
    await client.registry.close()


async def test_a_checkpoint_that_is_not_there_is_refused_before_any_engine_pauses(start, fakes, tmp_path):
    _, client = await _model(start, fakes)
    with pytest.raises(errors.InvalidArgument) as refused:
        await client.update_weights(1, str(tmp_path / "missing"))
    assert refused.value.field == "checkpoint_path" and "no config.json" in str(refused.value)
    assert all(fake.control == [] for fake in fakes)
    await client.registry.close()


async def test_a_server_that_cannot_load_weights_says_so_and_a_request_without_weights_is_refused(start, checkpoint):
    server = await start(LocalPolicyModel(name="model"))
    client = ModelClient(static_registry(model=server), "model")
    with pytest.raises(errors.GymError) as unsupported:
        await client.update_weights(1, str(checkpoint))
    assert unsupported.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert unsupported.value.reason == errors.Reason.WEIGHT_UPDATE_UNSUPPORTED and "SetPolicyVersion" in str(
        unsupported.value
    )
    async with transport.open_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as empty:
            await model_grpc.ModelServiceStub(channel).UpdateWeights(model_pb.UpdateWeightsRequest(version=1))
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "checkpoint_path" in empty.value.details()
    await client.registry.close()


def test_update_weights_command_reports_each_engine_and_refuses_an_unknown_pause_mode(checkpoint):
    done = subprocess.run(
        [tool("gym-grpc"), "update-weights", "model", "1", "--checkpoint", str(checkpoint), "--pause-mode", "kep"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "'kep' is not one of 'abort', 'keep', 'wait'" in done.stderr


async def test_update_weights_command_says_what_it_did(start, fakes, checkpoint):
    server, client = await _model(start, fakes)
    args = [tool("gym-grpc"), "update-weights", "model", "2", "--checkpoint", str(checkpoint)]
    registry = await _registry(start, server)
    done = await asyncio.to_thread(
        subprocess.run, [*args, "--registry", registry, "--pause-mode", "wait"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "model serves policy version 2 after" in done.stderr and fakes[1].base_url in done.stderr
    assert fakes[0].control[0] == "pause wait"
    again = await asyncio.to_thread(subprocess.run, [*args, "--registry", registry], capture_output=True, text=True)
    assert again.returncode == 0 and "already serves policy version 2: nothing done" in again.stderr
    await client.registry.close()


async def test_two_workers_asked_for_one_update_at_once_load_it_once(fakes, checkpoint, tmp_path):
    """`gym-grpc run configs/vllm.yaml` with two worker processes for the model server: the same
    update sent to each at once (a trainer that retried on another connection) reaches the engine
    once; the worker that waited finds the version served and answers `updated` false."""
    env = tmp_path / "env.yaml"
    env.write_text(f"policy_base_url: {fakes[0].base_url}\npolicy_api_key: EMPTY\npolicy_model_name: fake\n")
    run = await asyncio.to_thread(
        start_run, "--env-file", str(env), "servers.policy_model.num_workers=2", configs=(VLLM,)
    )
    try:
        loading = fakes[0].control_faults["/collective_rpc"] = asyncio.Event()
        channels = await _one_channel_per_worker(run.servers["policy_model"])
        request = model_pb.UpdateWeightsRequest(version=5, checkpoint_path=str(checkpoint))
        calls = [
            asyncio.ensure_future(model_grpc.ModelServiceStub(channel).UpdateWeights(request, timeout=60))
            for channel in channels
        ]
        await eventually(lambda: fakes[0].control[-1:] == [f"reload {checkpoint}"], "one worker loading")
        loading.set()
        answers = await asyncio.gather(*calls)
        assert sorted(answer.updated for answer in answers) == [False, True]
        assert fakes[0].control == _calls(checkpoint, 5)  # one update, not two
        for channel in channels:
            await channel.close()
    finally:
        await asyncio.to_thread(run.stop)


async def _one_channel_per_worker(address: str) -> list[grpc.aio.Channel]:
    """A channel to each of the two workers behind `address`: new connections until both answered
    (the kernel spreads connections; a 1 in 2^63 chance of never, in 64)."""
    by_worker: dict[int, grpc.aio.Channel] = {}
    for _ in range(64):
        channel = transport.open_channel(address)
        info = await admin_grpc.AdminServiceStub(channel).GetServerInfo(admin_pb.GetServerInfoRequest())
        if info.worker in by_worker:
            await channel.close()
            continue
        by_worker[info.worker] = channel
        if len(by_worker) == 2:
            break
    return list(by_worker.values())


@pytest.mark.parametrize("token_in_token_out", [True, False])
async def test_a_turn_the_engine_aborted_is_generated_again_and_counted(start, token_in_token_out):
    """The engine answers the turn's first request as vLLM does one that /pause?mode=abort stopped;
    the model server asks again, and the turn is the second answer (token path and chat path)."""
    fake = FakeEngine([Turn(content="7"), Turn(content="5")])
    await fake.start()
    try:
        fake.abort_next = 1
        config = {"return_token_ids": True, "token_in_token_out": token_in_token_out}
        server, client = await _model(start, [fake], **config)
        params = r.CreateParams()
        params.input_items.items.add().message.CopyFrom(r.Message(role=r.ROLE_USER, text="What is 2 + 3?"))
        turn = await client.create_response(params, "s")
        assert final_text(turn) == "5"
        counters = server.app.counters.to_proto()
        assert dict(counters.turns_caught_by_update) == {"regenerated": 1}
        await client.registry.close()
    finally:
        await fake.stop()
