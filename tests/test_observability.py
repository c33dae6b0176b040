"""Counters, failed-call logs, the admin service, status and profiling."""

import asyncio
import json
import logging
import re
import signal

import grpc
import pytest

from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.rpc import transport
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import model_service_pb2_grpc as model_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r
from tests.support import (
    REPO,
    WEATHER,
    Calculator,
    EchoModel,
    collect_args,
    grpcurl,
    gym,
    start_run,
    static_registry,
    task,
)


async def _admin(server):
    channel = transport.open_channel(server.address)
    return channel, admin_grpc.AdminServiceStub(channel)


async def test_counters_count_calls_by_method_and_status(start):
    server = await start(Calculator(name="calc"))
    client = ResourcesClient(static_registry(calc=server), "calc")
    await client.seed_session("s", task("x"))
    for _ in range(5):
        await client.call_tool("s", r.FunctionCall(name="add", arguments='{"a": 1, "b": 2}'))
    await client.call_tool("s", r.FunctionCall(name="add", arguments="not json"))
    channel, admin = await _admin(server)
    counters = await admin.GetCounters(admin_pb.GetCountersRequest())
    methods = {m.method: m for m in counters.methods}
    assert dict(methods["CallTool"].calls_by_status) == {"OK": 5, "INVALID_ARGUMENT": 1}
    assert dict(methods["SeedSession"].calls_by_status) == {"OK": 1}
    assert counters.calls_total == 7 and counters.in_flight == 0
    assert 0 < methods["CallTool"].p50_ms <= methods["CallTool"].p99_ms
    info = await admin.GetServerInfo(admin_pb.GetServerInfoRequest())
    assert info.name == "calc" and info.role == reg.SERVER_ROLE_RESOURCES and info.pid > 0
    assert info.entrypoint == "gym_grpc.testing.doubles:Calculator"
    assert len(info.config_hash) == 12 and not info.profiling
    await channel.close()
    await client.registry.close()


async def test_a_failed_call_is_one_log_line_and_success_is_quiet(start, caplog):
    caplog.set_level(logging.INFO, logger="gym_grpc")
    server = await start(Calculator(name="calc"))
    client = ResourcesClient(static_registry(calc=server), "calc")
    await client.seed_session("s", task("x"))
    await client.call_tool("s", r.FunctionCall(name="add", arguments='{"a": 1, "b": 2}'))
    await client.call_tool("s", r.FunctionCall(name="subtract", arguments="{}"))
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "gym_grpc"]
    failed = [line for line in lines if "subtract" in line]  # (a late line of an earlier test may show up too)
    assert len(failed) == 1 and not any(" OK " in line for line in lines), lines
    assert re.match(r"CallTool NOT_FOUND from ipv[46]:.+ after [\d.]+ ms: unknown tool 'subtract'", failed[0])
    await client.registry.close()


async def test_a_deadline_that_passes_counts_as_deadline_exceeded_and_a_cancel_as_cancelled(start, caplog):
    caplog.set_level(logging.INFO, logger="gym_grpc")
    server = await start(EchoModel(delay=30.0))
    channel, admin = await _admin(server)
    stub = model_grpc.ModelServiceStub(channel)
    request = model_pb.CreateResponseRequest(params=r.CreateParams(input_text="hello"))
    with pytest.raises(grpc.aio.AioRpcError) as timed_out:
        await stub.CreateResponse(request, timeout=0.2)
    assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    cancelled = stub.CreateResponse(request)
    await asyncio.sleep(0.2)
    cancelled.cancel()
    for _ in range(200):  # the server sees the cancel a moment later
        counters = await admin.GetCounters(admin_pb.GetCountersRequest())
        if counters.in_flight == 0:
            break
        await asyncio.sleep(0.05)
    methods = {m.method: m for m in counters.methods}
    assert dict(methods["CreateResponse"].calls_by_status) == {"DEADLINE_EXCEEDED": 1, "CANCELLED": 1}
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("CreateResponse")]
    assert [line.split()[1] for line in lines] == ["DEADLINE_EXCEEDED", "CANCELLED"], lines
    assert all(" from ipv" in line for line in lines)  # the peer, read while the call was alive
    await channel.close()


@pytest.mark.slow
def test_profiling_writes_a_log_with_the_verifiers_call_count_and_the_admin_answers_grpcurl(tmp_path):
    profiles = tmp_path / "profiles"
    # a process per server: a log per server (grouped, one per process: tests/test_grouped_layout.py)
    run = start_run("layout=per_server", "profiling_enabled=true", f"profiling_results_dirpath={profiles}")
    try:
        weather = run.servers["weather"]
        info = json.loads(grpcurl(weather, "gym.v1.AdminService/GetServerInfo"))
        assert info["name"] == "weather" and info["profiling"] is True and info["role"] == "SERVER_ROLE_RESOURCES"
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(WEATHER.read_text() * 3)  # 15 rollouts
        done = gym(
            *collect_args(run.registry, "weather_agent", str(tasks), str(tmp_path / "out.jsonl")),
            "--no-progress",
        )
        assert done.returncode == 0, done.stderr
        counters = json.loads(grpcurl(weather, "gym.v1.AdminService/GetCounters"))
        verify = next(m for m in counters["methods"] if m["method"] == "Verify")
        assert verify["calls_by_status"] == {"OK": "15"}
        agent = json.loads(grpcurl(run.servers["weather_agent"], "gym.v1.AdminService/GetCounters"))
        assert {s["stage"] for s in agent["stages"]} == {"model", "tools", "verify"}
        live = gym("profile", "weather", "--registry", run.registry, "--limit", "200")
        assert "WeatherEnv.verify" in live.stdout and "ncall" in live.stdout
    finally:
        run.process.send_signal(signal.SIGINT)
        run.process.wait(timeout=30)
    log = (profiles / "weather.log").read_text()
    header, *rows = log.splitlines()
    assert header.split() == ["name", "ncall", "tsub", "ttot", "tavg"]
    totals = [float(row.split()[-2]) for row in rows]
    assert totals == sorted(totals, reverse=True)
    verify_row = next(row for row in rows if row.split()[1] == "WeatherEnv.verify")
    assert verify_row.startswith(f"{REPO / 'servers/resources/weather/server.py'}:") or verify_row.startswith(
        "servers/resources/weather/server.py:"
    )
    assert int(verify_row.split()[2]) == 15
    assert (profiles / "policy_model.log").exists() and (profiles / "weather_agent.log").exists()


@pytest.mark.slow
def test_profiling_off_means_no_profile(tmp_path):
    run = start_run()
    try:
        done = gym("profile", "weather", "--registry", run.registry)
        assert "profiling is off" in done.stdout
        assert gym("profile", "nosuch", "--registry", run.registry).stdout.strip().endswith("no such server")
    finally:
        run.stop()


def test_status_without_a_running_config_says_so():
    done = gym("status", "--registry", "127.0.0.1:1")
    assert done.returncode == 1 and "is `gym-grpc run` up" in done.stderr


@pytest.mark.slow
def test_grpcurl_lists_the_admin_service(tmp_path):
    run = start_run()
    try:
        assert "gym.v1.AdminService" in grpcurl(run.servers["math"], "list")
    finally:
        run.stop()
