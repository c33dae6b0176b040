"""Servers of one `process:` group call each other in-process: the caller cannot tell the
difference from a gRPC call (copies, errors, deadlines, cancels, context) except by speed,
and `gym-grpc run` serves, lists, restarts and stops the group as one process."""

import asyncio
import json
import os
import signal
import subprocess
import time

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv
from gym_grpc.client import run_many
from gym_grpc.client.stubs import ModelClient, ResourcesClient
from gym_grpc.client.training import GymClient
from gym_grpc.launch.config import ConfigError, load_config
from gym_grpc.policy_version import requested
from gym_grpc.responses import final_text
from gym_grpc.rpc import in_process, transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import serve
from gym_grpc.testing.doubles import Calculator, ScriptedModel, calculator_task, call, say
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import responses_pb2 as r
from tests.support import (
    WEATHER,
    EchoModel,
    connections_from,
    cpu_ticks,
    listening_pids,
    read_rows,
    run_status,
    start_run,
    static_registry,
    tool,
)

GROUP = [f"servers.{name}.process=rollout" for name in ("policy_model", "weather", "weather_agent")]


def _port(run, server: str) -> int:
    """The port `gym-grpc run` lists for `server`."""
    return int(run.servers[server].rsplit(":", 1)[1])


def _in_process(registry: Registry, **servers) -> Registry:
    """`registry`, with the given running servers called in-process (as a group's worker sets it up)."""
    registry.in_process.update({name: running.in_process for name, running in servers.items()})
    return registry


def _params(text: str = "hi", **fields) -> r.CreateParams:
    params = r.CreateParams(**fields)
    params.input_items.items.add().message.CopyFrom(r.Message(role=r.ROLE_USER, text=text))
    return params


async def _weather_rollouts(start, grouped: bool) -> tuple[list, int, bool]:
    """Weather rollouts at temperature 0 through an agent whose model and environment are
    called over gRPC or in-process; the rollouts, the model's CreateResponse calls, and
    whether the agent opened a channel to the model server."""
    model = await start(LocalPolicyModel(name="model"))
    env = await start(WeatherEnv(name="weather"))
    registry = static_registry(model=model, weather=env)
    if grouped:
        _in_process(registry, model=model, weather=env)
    agent = await start(
        SimpleAgent({"model_server": "model", "resources_server": "weather"}, name="agent", registry=registry)
    )
    rows = [json.loads(line) for line in WEATHER.read_text().splitlines()]
    for row in rows:
        row["responses_create_params"]["temperature"] = 0
    client = static_registry(agent=agent)
    try:
        async with GymClient("agent", client) as gym:
            results = [await gym.run(row) for row in rows]
    finally:
        await client.close()
    calls = sum(model.app.counters.methods["CreateResponse"].by_status.values())
    return results, calls, registry.opened("model") is not None


async def test_a_rollout_in_process_is_the_rollout_over_grpc_without_a_channel(start):
    over_grpc, calls_grpc, channel_grpc = await _weather_rollouts(start, grouped=False)
    local, calls_local, channel_local = await _weather_rollouts(start, grouped=True)
    assert channel_grpc and not channel_local  # in-process: the agent never connected to the model server
    assert calls_grpc == calls_local > 0  # the model server handled (and counted) the same calls either way
    for a, b in zip(over_grpc, local, strict=True):
        assert a.reward == b.reward
        assert [t.prompt_token_ids for t in a.turns] == [t.prompt_token_ids for t in b.turns]
        assert [t.generation_token_ids for t in a.turns] == [t.generation_token_ids for t in b.turns]
        assert [t.generation_log_probs for t in a.turns] == [t.generation_log_probs for t in b.turns]
    assert 1.0 in {res.reward for res in local}


async def test_the_callee_gets_a_copy_of_the_request_and_the_caller_a_copy_of_the_reply():
    kept = r.Response(id="resp_kept", status=r.RESPONSE_STATUS_COMPLETED, output=say("kept"))
    received = []

    async def create_response(request: model_pb.CreateResponseRequest, context) -> r.Response:
        received.append(request)
        request.params.temperature = 1.5  # a callee that changes what it was given
        return kept  # and answers with an object it keeps

    server = in_process.InProcessServer()
    server.methods["/m"] = grpc.unary_unary_rpc_method_handler(
        create_response,
        request_deserializer=model_pb.CreateResponseRequest.FromString,
        response_serializer=r.Response.SerializeToString,
    )
    request = model_pb.CreateResponseRequest(params=_params("hello", temperature=0.25))
    reply = await server.call("/m", request, 5.0)
    assert request.params.temperature == 0.25  # the caller's request is its own
    reply.output.add().CopyFrom(say("added by the caller")[0])
    assert final_text(kept) == "kept" and len(kept.output) == 1  # the callee's object is its own
    request.params.input_items.items[0].message.text = "changed after the call"
    assert received[0].params.input_items.items[0].message.text == "hello"


class _Refusing(ScriptedModel):
    """Refuses every call with the error it is given."""

    def __init__(self, error: Exception) -> None:
        super().__init__([])
        self.error = error

    async def create_response(self, params, session_id):
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        errors.InvalidArgument(
            "temperature: the Responses API takes 0 to 2", field="params.temperature", reason=errors.Reason.TOOL_FAILED
        ),
        errors.Unavailable("the engine is down", metadata={"engine": "http://engine"}),
        RuntimeError("a bug in the model server"),  # INTERNAL, its class only
    ],
    ids=["invalid-argument", "unavailable", "bug"],
)
async def test_a_failed_call_raises_the_error_a_grpc_call_raises(start, error):
    model = await start(_Refusing(error))
    outcomes = []
    for registry in (static_registry(model=model), _in_process(Registry(), model=model)):
        with pytest.raises(errors.GymError) as failed:
            await ModelClient(registry, "model").create_response(_params())
        e = failed.value
        outcomes.append((type(e), e.code, e.message, e.reason, e.field, e.metadata))
        await registry.close()
    over_grpc, local = outcomes
    assert local == over_grpc
    assert local[5]["callee"] == "model" and local[5]["callee_method"] == "CreateResponse"


async def test_the_deadline_cancels_the_callee_and_fails_the_caller_with_deadline_exceeded(start):
    model = await start(EchoModel(delay=600))
    client = ModelClient(_in_process(Registry(), model=model), "model", timeout=0.2)
    with pytest.raises(errors.DeadlineExceeded):
        await client.create_response(_params())
    assert model.app.cancelled == 1 and model.app.active == 0
    assert model.app.counters.methods["CreateResponse"].by_status == {"DEADLINE_EXCEEDED": 1}


async def test_a_cancelled_caller_cancels_the_callee(start):
    model = await start(EchoModel(delay=600))
    client = ModelClient(_in_process(Registry(), model=model), "model")
    task = asyncio.ensure_future(client.create_response(_params()))
    while not model.app.active:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert model.app.cancelled == 1 and model.app.active == 0
    assert model.app.counters.methods["CreateResponse"].by_status == {"CANCELLED": 1}


async def test_the_handler_sees_the_time_left_of_the_callers_deadline(start):
    seen = []

    class Timing(ScriptedModel):
        async def create_response(self, params, session_id):
            seen.append(transport.timeout_for(None))
            return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=say("ok"))

    model = await start(Timing([]))
    await ModelClient(_in_process(Registry(), model=model), "model", timeout=30).create_response(_params())
    assert seen and 0 < seen[0] <= 30


async def test_the_callers_context_variables_stay_with_the_caller(start):
    seen = []

    class Reading(ScriptedModel):
        async def create_response(self, params, session_id):
            seen.append(requested.get())
            requested.set(99)  # a callee that sets one does not change the caller's either
            return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=say("ok"))

    model = await start(Reading([]))
    client = ModelClient(_in_process(Registry(), model=model), "model")
    token = requested.set(7)
    try:
        await client.create_response(_params())
        assert requested.get() == 7
    finally:
        requested.reset(token)
    assert seen == [None]  # the version travels in the request (CreateResponseRequest.policy_version)


async def test_tool_mistakes_and_failures_come_back_as_over_grpc(start):
    env = await start(Calculator(name="calc"))
    task = calculator_task("2 + 3?", expected_answer=5)
    results = []
    for registry in (static_registry(calc=env), _in_process(Registry(), calc=env)):
        client = ResourcesClient(registry, "calc")
        await client.seed_session("s", task)
        outcomes = [
            await client.call_tool("s", call("add", '{"a": 2, "b": 3}').function_call),
            await client.call_tool("s", call("divide", "{}").function_call),
            await client.call_tool("s", call("add", '{"a": "two"}').function_call),
            await client.call_tool("s", call("explode", "{}").function_call),
        ]
        await client.close_session("s")
        results.append(outcomes)
        await registry.close()
    over_grpc, local = results
    assert local == over_grpc
    assert [x.reason for x in local] == [None, "TOOL_NOT_FOUND", "TOOL_ARGUMENTS_INVALID", "TOOL_FAILED"]


async def test_a_sessions_calls_pinned_to_a_worker_of_this_process_stay_in_process():
    """A worker that shares its port with others (num_workers) pins its sessions to a port it
    serves alone (SeedSessionResponse.replica); the calls its own process pins there skip gRPC too."""
    env = await serve(Calculator(name="calc"), reuse_port=True)
    registry = _in_process(Registry(), calc=env)
    try:
        assert env.own_port not in (0, env.port) and env.app.replica == f"127.0.0.1:{env.own_port}"
        client = ResourcesClient(registry, "calc")
        await client.seed_session("s", calculator_task("2 + 3?", expected_answer=5))
        assert client.replica_of("s") == env.app.replica
        for _ in range(3):
            assert not (await client.call_tool("s", call("add", '{"a": 2, "b": 3}').function_call)).error
        verified = await client.verify("s", calculator_task("2 + 3?", expected_answer=5), r.Response(output=say("5")))
        assert json.loads(verified.fields_json)["tool_calls_seen"] == 3
        assert connections_from([os.getpid()], [env.own_port]) == 0  # none opened to this process's own port
    finally:
        await registry.close()
        await env.stop(grace=0)


async def test_a_method_the_server_does_not_have_is_unimplemented(start):
    model = await start(ScriptedModel([say("ok")]))
    with pytest.raises(Exception) as failed:
        await model.in_process.call("/gym.v1.ModelService/NoSuchMethod", _params(), 5.0)
    assert failed.value.code().name == "UNIMPLEMENTED"
    assert set(model.in_process.methods) >= {"/gym.v1.ModelService/CreateResponse"}
    assert in_process.PEER == "in-process"


async def test_a_collection_through_a_grouped_agent_keeps_every_rollout(start, tmp_path):
    model = await start(EchoModel(delay=0.001))
    env = await start(Calculator(name="calc"))
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=_in_process(Registry(), model=model, calc=env),
        )
    )
    tasks = tmp_path / "tasks.jsonl"
    rows = [{"responses_create_params": {"input": f"say {i}"}, "expected_answer": str(i)} for i in range(200)]
    tasks.write_text("".join(json.dumps(row) + "\n" for row in rows))
    registry = static_registry(agent=agent)
    out = tmp_path / "out.jsonl"
    summary = await collect(registry, CollectOptions(agent="agent", input=tasks, output=out, max_in_flight=64))
    await registry.close()
    assert summary.failed == 0
    assert sorted(row["reward"] for row in read_rows(out)) == [1.0] * 200  # each echo holds its own number


def test_config_refuses_a_group_whose_servers_disagree_on_workers_or_restart(tmp_path):
    config = tmp_path / "c.yaml"
    for extra, key in (("num_workers: 2", "num_workers"), ("restart: true", "restart")):
        config.write_text(
            f"servers:\n  a: {{entrypoint: 'x.py:A', process: p}}\n  b: {{entrypoint: 'x.py:B', process: p, {extra}}}\n"
        )
        with pytest.raises(ConfigError, match=rf"servers\.b\.{key}: .*servers\.a\.{key} is .*process 'p'"):
            load_config([config])
    config.write_text("ray: {address: local}\nservers:\n  a: {entrypoint: 'x.py:A', process: p}\n")
    with pytest.raises(ConfigError, match=r"servers\.a\.process: under Ray"):
        load_config([config])


def _model_ports(run) -> list[int]:
    """The policy model's port and each of its workers' own."""
    return [_port(run, "policy_model"), *(int(a.rsplit(":", 1)[1]) for a in run.worker_addresses("policy_model"))]


@pytest.mark.slow
def test_gym_grpc_run_serves_a_group_from_one_process_that_restarts_as_one(tmp_path):
    """The quickstart with the weather agent, its environment and the policy in one process:
    status lists the three with one pid, a collection goes through without a connection to the
    grouped model server, and a killed group comes back whole."""
    run = start_run(*GROUP, *(f"servers.{n}.restart=true" for n in ("policy_model", "weather", "weather_agent")))
    try:
        table = run.log()
        assert "healthy" in table and "(3 processes)" in table
        assert sum("(in process 'rollout')" in line for line in table.splitlines()) == 3
        _, before = run_status(run.registry)
        pids = {before[name]["pid"] for name in ("policy_model", "weather", "weather_agent")}
        assert len(pids) == 1 and before["math"]["pid"] not in pids
        out = tmp_path / "out.jsonl"
        args = ["collect", "--registry", run.registry, "--agent", "weather_agent", "--input", str(WEATHER)]
        args += ["--output", str(out), "--num-repeats", "4", "--no-progress"]
        done = subprocess.run([tool("gym-grpc"), *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert len(read_rows(out)) == 4 * len(WEATHER.read_text().splitlines())
        # Over gRPC the agent would hold a connection to the model server for its lifetime.
        assert connections_from(pids, _model_ports(run)) == 0
        os.kill(pids.pop(), signal.SIGKILL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            _, after = run_status(run.registry)
            new = {after[name].get("pid") for name in ("policy_model", "weather", "weather_agent")}
            if all(after[n]["health"] == "serving" for n in ("policy_model", "weather", "weather_agent")) and (
                len(new) == 1 and new != {before["weather"]["pid"]}
            ):
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the group did not come back: {after}")
        out.unlink()
        done = subprocess.run([tool("gym-grpc"), *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    finally:
        run.stop()
    log = run.log()
    assert "process 'rollout' (servers 'policy_model', 'weather', 'weather_agent') restarted" in log


@pytest.mark.slow
def test_a_group_with_num_workers_runs_rollouts_in_every_worker_and_calls_in_process(tmp_path):
    """The group in two worker processes on its ports (the layout bench/nemo_gym_peer.py
    measures): both workers run rollouts, each with in-process calls to its own model server."""
    workers = [f"servers.{n}.num_workers=2" for n in ("policy_model", "weather", "weather_agent")]
    run = start_run(*GROUP, *workers)
    try:
        pids = listening_pids(_port(run, "weather_agent"))
        assert len(pids) == 2 and pids == listening_pids(_port(run, "policy_model"))
        before = {pid: cpu_ticks(pid) for pid in pids}
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text("".join(WEATHER.read_text() for _ in range(50)))
        out = tmp_path / "out.jsonl"
        args = ["collect", "--registry", run.registry, "--agent", "weather_agent", "--input", str(tasks)]
        # More in flight than one worker is given before the next (run_many.PACK): both take runs.
        args += ["--output", str(out), "--no-progress", "--max-in-flight", str(4 * run_many.PACK)]
        done = subprocess.run([tool("gym-grpc"), *args], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert len(read_rows(out)) == len(tasks.read_text().splitlines())
        used = {pid: cpu_ticks(pid) - before[pid] for pid in pids}
        assert all(ticks > 0 for ticks in used.values()), used  # the collector's connections reach both
        assert connections_from(pids, _model_ports(run)) == 0
    finally:
        run.stop()
