"""Retries toward engines: per failure class, Retry-After, the budget, the startup wait, the counters.

The engine is gym_grpc/testing/fake_engine.py, a real aiohttp server speaking vLLM's wire
format, behind the real vLLM model server."""

import asyncio
import io
import json
import logging
import socket
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.client.stubs import ModelClient
from gym_grpc.data import rows
from gym_grpc.engines.http import Engine
from gym_grpc.engines.link import EngineError
from gym_grpc.engines.retries import retry_after_seconds
from gym_grpc.engines.settings import EngineSettings
from gym_grpc.launch import observe
from gym_grpc.rpc import transport
from gym_grpc.testing.fake_engine import FakeEngine, Turn
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import responses_pb2 as r
from tests.corpus import nemo_gym_file
from tests.support import Calculator, eventually, static_registry

FAST = {"backoff_seconds": 0.01, "max_backoff_seconds": 0.05}


@pytest.fixture
async def engines():
    started: list[FakeEngine] = []

    async def make(sock: socket.socket | None = None) -> FakeEngine:
        fake = FakeEngine([Turn(content="5")])
        await fake.start(sock)
        started.append(fake)
        return fake

    yield make
    for fake in started:
        await fake.stop()


@pytest.fixture
def unopened():
    """A port that refuses connections until an engine starts on it: bound, not listening."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    yield sock
    sock.close()


def _url(sock: socket.socket) -> str:
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


async def _model(start, base_url: str, **config):
    server = await start(VLLMModel({"base_url": base_url, "model": "policy", **FAST, **config}, name="model"))
    return server, ModelClient(static_registry(model=server), "model")


def _request() -> model_pb.CreateResponseRequest:
    request = model_pb.CreateResponseRequest(session_id="s")
    request.params.input_items.items.add().message.CopyFrom(r.Message(role=r.ROLE_USER, text="What is 2 + 3?"))
    return request


async def test_a_collect_started_before_its_engine_is_ready_loses_no_rollouts(
    start, engines, unopened, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="gym_grpc.engines")
    model, client = await _model(start, _url(unopened), startup_wait_seconds=120, max_retries=1)
    env = await start(Calculator())
    peers = static_registry(model=model, calc=env)
    agent = await start(
        SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="agent", registry=peers)
    )
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"responses_create_params": {"input": "2 + 3?"}, "expected_answer": 5}) + "\n")
    registry = static_registry(agent=agent)
    options = CollectOptions(input=tasks, output=tmp_path / "out.jsonl", agent="agent", num_repeats=8, progress=False)
    collecting = asyncio.create_task(collect(registry, options, log=io.StringIO()))
    # More refused connections than max_retries allows: only the startup wait keeps the rollouts alive.
    await eventually(lambda: model.app.counters.retries["connect"] > 8 * 2 or collecting.done(), "refused connects")
    assert not collecting.done()
    await engines(unopened.dup())  # the engine owns its copy of the socket
    summary = await asyncio.wait_for(collecting, 60)
    assert (summary.done, summary.failed) == (8, 0)
    messages = [rec.getMessage() for rec in caplog.records]
    assert sum("does not answer yet" in m and "startup_wait_seconds" in m for m in messages) == 1
    assert sum("answered after" in m for m in messages) == 1
    await registry.close()
    await peers.close()
    await client.registry.close()


async def test_an_engine_that_never_starts_fails_after_the_startup_wait(start, unopened):
    model, client = await _model(start, _url(unopened), startup_wait_seconds=0.5, max_retries=1)
    with pytest.raises(errors.Unavailable) as error:
        await client._call("CreateResponse", _request(), timeout=60)
    assert "the engine never answered" in error.value.message
    assert "gave up after 1 connect retries" in error.value.message
    assert model.app.counters.retries["connect"] >= 2  # waited during startup, then one retry
    await client.registry.close()


async def test_retries_are_bounded_per_failure_class_and_counted(start, engines):
    fake = await engines()
    fake.fail_next = [503, 503, 429, 429, 429]
    model, client = await _model(start, fake.base_url, max_retries=0, retries={"server_error": 2, "rate_limited": 3})
    response = await client.create_response(_request().params, "s")
    assert response.output and len(fake.requests) == 6  # five retries, more than either class allows
    async with transport.open_channel(model.address) as channel:
        counters = await admin_grpc.AdminServiceStub(channel).GetCounters(admin_pb.GetCountersRequest(), timeout=10)
    assert dict(counters.retries) == {"server_error": 2, "rate_limited": 3}
    [row] = await observe.status(static_registry(model=model), interval=0.1)
    assert row["retries"] == {"server_error": 2, "rate_limited": 3}
    header, line, engine = observe.format_status([row]).splitlines()  # the engine's own line: no /metrics here
    assert line[header.index("retries") : header.index("retries") + 7].strip() == "5"
    assert engine.startswith(f"  engine {fake.base_url}: load not read: GET ") and "HTTP 404" in engine

    fake.fail_next = [503, 503, 503]
    with pytest.raises(errors.Unavailable) as error:
        await client.create_response(_request().params, "s")
    assert "HTTP 503" in error.value.message and "gave up after 2 server_error retries" in error.value.message
    assert len(fake.requests) == 9
    await client.registry.close()


async def test_an_http_500_is_retried_as_a_server_error_and_the_last_one_names_it(engines):
    """vLLM answers 500 ("EngineCore encountered an issue") to the requests in flight when its
    engine core dies: a restarted engine can still answer them, and if none does, the call is
    UNAVAILABLE (transient), not INTERNAL (a bug)."""
    fake = await engines()
    fake.fail_next = [500]
    settings = EngineSettings(base_url=fake.base_url, model="policy", retries={"server_error": 2}, **FAST)
    engine = Engine(fake.base_url, settings)
    body = {"model": "policy", "messages": [{"role": "user", "content": "2 + 3?"}]}
    try:
        answer = await engine.post("/chat/completions", body)
        assert answer["choices"][0]["message"]["content"] == "5" and len(fake.requests) == 2
        assert engine.counters.retries["server_error"] == 1
        fake.fail_next = [500, 500, 500]
        with pytest.raises(errors.Unavailable) as error:
            await engine.post("/chat/completions", body)
        assert "HTTP 500: injected 500" in error.value.message
        assert "gave up after 2 server_error retries" in error.value.message
        fake.fail_next = [501]  # not worth retrying: the engine's answer
        with pytest.raises(EngineError) as refused:
            await engine.post("/chat/completions", body)
        assert refused.value.code == grpc.StatusCode.INTERNAL and len(fake.requests) == 6
    finally:
        await engine.close()


async def test_a_retry_after_is_waited_for(start, engines, caplog):
    caplog.set_level(logging.WARNING, logger="gym_grpc.engines")
    fake = await engines()
    fake.fail_next, fake.retry_after = [503], "1"
    _, client = await _model(start, fake.base_url)
    response = await client.create_response(_request().params, "s")
    assert response.output and len(fake.requests) == 2
    [retry] = [rec.getMessage() for rec in caplog.records if "retrying" in rec.getMessage()]
    assert "(Retry-After 1 s)" in retry and "retrying in 1.00 s" in retry
    await client.registry.close()


async def test_a_retry_after_past_the_callers_deadline_fails_at_once_naming_it(start, engines):
    fake = await engines()
    fake.fail_next, fake.retry_after = [429], "3600"
    _, client = await _model(start, fake.base_url)
    with pytest.raises(errors.Unavailable) as error:
        await client._call("CreateResponse", _request(), timeout=30)
    assert "HTTP 429" in error.value.message and "Retry-After 3600 s" in error.value.message
    assert "after the caller's deadline" in error.value.message
    assert len(fake.requests) == 1
    await client.registry.close()


async def test_a_storm_longer_than_the_retry_budget_ends_with_the_budget(start, engines):
    fake = await engines()
    fake.fail_next = [503] * 100_000
    _, client = await _model(start, fake.base_url, retries={"server_error": 100_000}, retry_budget_seconds=0.5)
    with pytest.raises(errors.Unavailable) as error:
        await client._call("CreateResponse", _request(), timeout=60)
    assert "retry budget (retry_budget_seconds: 0.5)" in error.value.message
    await client.registry.close()


def test_retry_after_is_read_as_seconds_or_as_an_http_date():
    assert retry_after_seconds("7") == 7.0
    assert retry_after_seconds(None) is None and retry_after_seconds("soon") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: at once
    later = format_datetime(datetime.now(UTC) + timedelta(hours=1), usegmt=True)
    assert 3500 < retry_after_seconds(later) <= 3600


async def test_a_nemo_gym_rows_metadata_extra_body_seed_reaches_the_engine(start, fake_engine):
    """NeMo Gym's `num_repeats_add_seed` writes each rollout's seed into metadata.extra_body (its evalplus rows)."""
    line = nemo_gym_file("resources_servers/evalplus/data/example_rollouts.jsonl").splitlines()[0]
    params = rows.task_from_row(json.loads(line)).responses_create_params
    assert params.metadata["extra_body"] == '{"seed": 0}'
    fake = await fake_engine([Turn(content="ok")])
    _, model = await _model(start, fake.base_url, api_key="sk-test")
    await model.create_response(params, "s")
    sent = fake.requests[0]
    assert "seed" in sent and sent["seed"] == 0
    assert (sent["temperature"], sent["max_tokens"]) == (1.0, 16384)
    assert "metadata" not in sent and "extra_body" not in sent
    await model.registry.close()


@pytest.mark.parametrize(
    "body, expected",
    [
        (b'{"id": "x", "logprob": -0.5}', {"id": "x", "logprob": -0.5}),
        # What orjson refuses and Python's json reads: engines get liberal parsing.
        (b'{"logprob": NaN, "floor": -Infinity}', None),
    ],
)
async def test_an_engine_answer_is_read_as_json_reads_it(body, expected):
    from aiohttp import web

    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    engine = Engine(f"http://127.0.0.1:{port}/v1", EngineSettings(base_url=[f"http://127.0.0.1:{port}/v1"], model="m"))
    try:
        got = await engine.post("/chat/completions", {"messages": [], "logit_bias": {1: 2.0}})
    finally:
        await engine.close()
        await runner.cleanup()
    if expected is None:
        assert got["logprob"] != got["logprob"] and got["floor"] == float("-inf")  # NaN, -inf
    else:
        assert got == expected


@pytest.mark.parametrize(("keepalive", "connections"), [(30.0, 1), (0.05, 2)])
async def test_an_idle_connection_is_kept_for_keepalive_seconds_and_no_longer(keepalive, connections):
    """Two requests 0.5 s apart on a real aiohttp server that never closes a connection itself: one
    connection when keepalive_seconds outlasts the gap (the next batch after a trainer's step reuses
    the last one's), a new one when it does not (under the engine's own keep-alive)."""
    from aiohttp import web

    peers: set[int] = set()

    async def answer(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.add(request.transport.get_extra_info("peername")[1])
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app, keepalive_timeout=3600)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
    engine = Engine(url, EngineSettings(base_url=[url], model="m", keepalive_seconds=keepalive))
    try:
        await engine.post("/chat/completions", {"messages": []})
        await asyncio.sleep(0.5)
        await engine.post("/chat/completions", {"messages": []})
    finally:
        await engine.close()
        await runner.cleanup()
    assert len(peers) == connections
