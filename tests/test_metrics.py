"""Every worker process in `status`, and live Prometheus metrics: real servers, real HTTP
scrapes parsed by prometheus_client's own parser, real `gym-grpc run` and `status` processes."""

import asyncio
import json
import os
import signal
import socket
import urllib.request
from collections import defaultdict

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gym_grpc import errors
from gym_grpc.responses import input_items, message_text
from gym_grpc.rpc import transport
from gym_grpc.server.serving import serve
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import model_service_pb2_grpc as model_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import registry_service_pb2_grpc as reg_grpc
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from tests.support import ScriptedModel, alive, eventually, gym, listening_pids, say, start_run, task


class GatedModel(ScriptedModel):
    """Answers "ok" once its gate is open; "bad" is INVALID_ARGUMENT, "boom" a bug (INTERNAL)."""

    def __init__(self) -> None:
        super().__init__([], name="gated")
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()
        self.gate.set()

    async def create_response(self, params, session_id):
        text = message_text(input_items(params)[-1].message)
        if text == "bad":
            raise errors.InvalidArgument("input: 'bad' is not a question", field="params.input")
        if text == "boom":
            raise RuntimeError("engine exploded")
        self.entered.set()
        await self.gate.wait()
        return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=say("ok"))


def _request(text: str) -> model_pb.CreateResponseRequest:
    return model_pb.CreateResponseRequest(params=r.CreateParams(input_text=text))


def _scrape(address: str) -> dict[str, dict[frozenset, float]]:
    """GET http://address/metrics, parsed by prometheus_client: {sample name: {labels: value}}."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as reply:
        assert reply.status == 200 and reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples: dict[str, dict[frozenset, float]] = defaultdict(dict)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name][frozenset(sample.labels.items())] = sample.value
    return samples


def _labels(**labels: str) -> frozenset:
    return frozenset(labels.items())


async def test_metrics_count_calls_by_method_and_code_with_latencies_and_calls_in_flight():
    model = GatedModel()
    running = await serve(model, "127.0.0.1", 0, metrics_port=0)
    try:
        channel = transport.open_channel(running.address)
        stub = model_grpc.ModelServiceStub(channel)
        for _ in range(3):
            await stub.CreateResponse(_request("hello"))
        for text, code in (("bad", grpc.StatusCode.INVALID_ARGUMENT), ("boom", grpc.StatusCode.INTERNAL)):
            with pytest.raises(grpc.aio.AioRpcError) as failed:
                await stub.CreateResponse(_request(text))
            assert failed.value.code() == code
        info = await admin_grpc.AdminServiceStub(channel).GetServerInfo(admin_pb.GetServerInfoRequest())
        assert info.metrics_address == running.metrics.address == f"127.0.0.1:{running.metrics.port}"
        assert info.worker == 0

        model.gate.clear()  # the next call stays in flight until the gate opens
        model.entered.clear()
        held = asyncio.ensure_future(stub.CreateResponse(_request("hello")))
        await model.entered.wait()
        during = await asyncio.to_thread(_scrape, info.metrics_address)
        model.gate.set()
        await held
        after = await asyncio.to_thread(_scrape, info.metrics_address)
        await channel.close()
    finally:
        await running.stop(grace=1.0)

    me = {"server": "gated", "method": "CreateResponse"}
    calls = during["gym_server_calls_total"]
    assert calls == {
        _labels(**me, code="OK"): 3,
        _labels(**me, code="INVALID_ARGUMENT"): 1,
        _labels(**me, code="INTERNAL"): 1,
    }
    assert during["gym_server_calls_in_flight"] == {_labels(**me): 1}
    assert during["gym_server_call_duration_seconds_count"] == {_labels(**me): 5}
    assert after["gym_server_calls_in_flight"] == {_labels(**me): 0}
    assert after["gym_server_calls_total"][_labels(**me, code="OK")] == 4
    assert after["gym_server_call_duration_seconds_count"] == {_labels(**me): 6}
    buckets = {dict(labels)["le"]: value for labels, value in after["gym_server_call_duration_seconds_bucket"].items()}
    assert buckets["+Inf"] == 6
    ordered = sorted(buckets.items(), key=lambda item: float(item[0]))
    assert all(a[1] <= b[1] for a, b in zip(ordered, ordered[1:], strict=False))  # cumulative
    assert after["gym_server_call_duration_seconds_sum"][_labels(**me)] > 0
    assert after["gym_server_info"] == {_labels(server="gated", role="model", worker="0", version=info.version): 1}
    assert after["process_resident_memory_bytes"][frozenset()] > 0  # the process's own, beside ours


async def test_a_metrics_port_in_use_is_an_error_that_names_metrics_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"'gated' could not serve its metrics on 127.0.0.1:{port} \(metrics_port\)"):
            await serve(GatedModel(), "127.0.0.1", 0, metrics_port=port)


class FailingStart(GatedModel):
    async def start(self) -> None:
        raise RuntimeError("no engine")


async def test_a_server_that_cannot_start_frees_its_metrics_port():
    app = FailingStart()
    with pytest.raises(RuntimeError, match="no engine"):
        await serve(app, "127.0.0.1", 0, metrics_port=0)
    port = int(app.metrics_address.rsplit(":", 1)[1])
    with socket.socket() as again:
        again.bind(("127.0.0.1", port))  # OSError (in use) if the endpoint were still up


async def test_a_server_without_metrics_port_serves_no_metrics():
    running = await serve(GatedModel(), "127.0.0.1", 0)
    try:
        async with transport.open_channel(running.address) as channel:
            info = await admin_grpc.AdminServiceStub(channel).GetServerInfo(admin_pb.GetServerInfoRequest())
    finally:
        await running.stop(grace=1.0)
    assert running.metrics is None and info.metrics_address == ""


TWO_WORKERS = """\
servers:
  calc:
    entrypoint: gym_grpc.testing.doubles:Calculator
    num_workers: 2
    metrics_port: 0
    restart: true
"""

#: Connections opened to the two-worker server: the kernel spreads connections over its workers.
CONNECTIONS = 8


async def _one_session_per_connection(address: str) -> dict[int, int]:
    """On each of CONNECTIONS connections, a SeedSession and a CallTool; the number of connections
    each worker answered (all calls of one connection reach the worker that accepted it)."""
    answered: dict[int, int] = defaultdict(int)
    for index in range(CONNECTIONS):
        # A subchannel pool of its own: a new TCP connection, not one shared with the other channels.
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            info = await admin_grpc.AdminServiceStub(channel).GetServerInfo(admin_pb.GetServerInfoRequest())
            stub = res_grpc.ResourcesServiceStub(channel)
            await stub.SeedSession(res_pb.SeedSessionRequest(session_id=f"s{index}", task=task("x")))
            call = r.FunctionCall(name="add", arguments='{"a": 1, "b": 2}')
            await stub.CallTool(
                res_pb.CallToolRequest(session_id=f"s{index}", name=call.name, arguments=call.arguments)
            )
            answered[info.worker] += 1
    return answered


async def _watch_until_restarted(registry: str, worker: int) -> reg.Worker:
    """Follow the registry's entry of `calc` until worker `worker` shows a restart."""
    async with transport.open_channel(registry) as channel:
        async for update in reg_grpc.RegistryServiceStub(channel).WatchServer(reg.WatchServerRequest(name="calc")):
            entry = update.server.replicas[0].workers[worker]
            if entry.restarts:
                return entry
    raise AssertionError("the registry stopped before the worker was restarted")


def _status(registry: str) -> dict:
    done = gym("status", "--registry", registry, "--json", "--interval", "0.1")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    return row


@pytest.mark.slow
def test_status_lists_every_worker_with_its_pid_and_metrics_and_each_worker_counts_its_own_calls(tmp_path):
    config = tmp_path / "two_workers.yaml"
    config.write_text(TWO_WORKERS)
    run = start_run(configs=(config,))
    try:
        row = _status(run.registry)
        workers = row["workers"]
        assert [w["index"] for w in workers] == [0, 1]
        pids = [w["pid"] for w in workers]
        assert len(set(pids)) == 2 and all(alive(pid) for pid in pids)
        port = int(row["address"].rsplit(":", 1)[1])
        assert sorted(pids) == listening_pids(port)  # exactly the processes serving the port
        assert row["pid"] == pids[row["worker"]]  # the one that answered is one of them
        metrics = [w["metrics_address"] for w in workers]
        assert len(set(metrics)) == 2 and all(m.startswith("127.0.0.1:") for m in metrics)
        own = [w["address"] for w in workers]  # where the sessions each worker holds are called
        assert len(set(own)) == 2 and all(
            listening_pids(int(a.rsplit(":", 1)[1])) == [w["pid"]] for a, w in zip(own, workers, strict=True)
        )

        table = gym("status", "--registry", run.registry, "--interval", "0.1").stdout
        for worker in workers:
            assert (
                f"worker {worker['index']}: pid {worker['pid']}, own port {worker['address']}, "
                f"metrics http://{worker['metrics_address']}/metrics" in table
            )

        answered = asyncio.run(_one_session_per_connection(row["address"]))
        assert sum(answered.values()) == CONNECTIONS
        # Each worker holds the sessions of its connections; status adds them up, each worker asked at its own port.
        assert _status(run.registry)["sessions_open"] == CONNECTIONS
        for worker in workers:
            scraped = _scrape(worker["metrics_address"])
            assert scraped["gym_server_info"] == {
                _labels(server="calc", role="resources", worker=str(worker["index"]), version=row["version"]): 1
            }
            calls = scraped["gym_server_calls_total"]
            for method in ("SeedSession", "CallTool"):
                assert calls.get(_labels(server="calc", method=method, code="OK"), 0) == answered[worker["index"]]

        # A worker that dies is started again: status shows its new pid, the other's is unchanged.
        os.kill(pids[1], signal.SIGKILL)
        # (the bound only keeps a broken restart from hanging the run; the runner restarts at once)
        restarted = asyncio.run(asyncio.wait_for(_watch_until_restarted(run.registry, 1), 120))
        assert restarted.pid not in pids and alive(restarted.pid) and restarted.restarts == 1
        after = _status(run.registry)["workers"]
        assert [w["pid"] for w in after] == [pids[0], restarted.pid]
        assert after[1]["restarts"] == 1 and after[1]["metrics_address"] == restarted.metrics_address
        assert _scrape(restarted.metrics_address)["gym_server_info"]  # the new process serves metrics
    finally:
        run.stop()


@pytest.mark.slow
def test_status_leaves_a_worker_that_died_out_of_the_sums_and_names_it(tmp_path):
    config = tmp_path / "two_workers.yaml"
    config.write_text(TWO_WORKERS.replace("    restart: true\n", ""))  # a dead worker stays dead
    run = start_run(configs=(config,))
    try:
        pids = run.pids("calc")
        os.kill(pids[1], signal.SIGKILL)
        asyncio.run(eventually(lambda: not alive(pids[1]), "the killed worker is gone"))
        row = _status(run.registry)
        assert row["health"] == "serving" and row["pid"] == pids[0]  # the other worker serves the shared port
        assert row["workers_not_answering"] == [1]
        table = gym("status", "--registry", run.registry, "--interval", "0.1").stdout
        assert f"worker 1: pid {pids[1]}" in table and "(not answering at its own port" in table
    finally:
        run.stop()
