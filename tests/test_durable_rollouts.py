"""Durable rollouts: parked at a turn boundary and resumed elsewhere, resumed by the client on
its own when a server it needs is lost, tool calls that run once whatever happens, sessions
that are taken over, replayed, or reported lost.

The servers are real gRPC servers on loopback; where an agent must die as a process dies, it
runs in its own process and is SIGKILLed (`_agent_process`)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from asyncio.subprocess import PIPE
from collections.abc import Callable
from types import SimpleNamespace

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.batch import states as states_module
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.client import run_many as run_many_client
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.data import jsonl, record
from gym_grpc.model import ModelServer
from gym_grpc.resources import Session, tool
from gym_grpc.responses import assistant_message, final_text, new_id
from gym_grpc.rpc import protocol, transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server import run_many as run_many_server
from gym_grpc.testing import Calculator, Servers, calculator_task, call
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from tests.support import REPO, collect_args, eventually, read_rows, start_run, static_registry, worker_process
from tests.support import tool as installed
from tests.test_replicas import start_registry

ADDS = 3  # the model adds this many times, one call a turn, then answers
AGENT_CONFIG = {"model_server": "model", "resources_server": "calc"}


class Counter(Calculator):
    """The calculator, whose `add` also counts its runs server-wide (a side effect outside the
    session, as a tool that sends an email or moves money has) and can be held mid-call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.runs = 0
        self.entered = asyncio.Event()
        self.hold: asyncio.Event | None = None
        #: Called as each add begins (its run counted).
        self.on_add: Callable[[], None] = lambda: None

    @tool
    async def add(self, a: int, b: int, session: Session) -> int:
        """Add two integers."""
        self.runs += 1
        session.state["calls"] += 1
        self.on_add()
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()
        return a + b


class Replayable(Counter):
    session_recovery = "replay"


class AddingModel(ModelServer):
    """Calls `add` ADDS times (turn n adds n and 1), then answers with the last sum it saw.

    `gate`: a turn (model call, from 0) that waits for the event before it answers; `fail`:
    turns that fail once with UNAVAILABLE, as a model server whose engine went away."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("name", "model")
        super().__init__(**kwargs)
        self.calls = 0
        self.gate: tuple[int, asyncio.Event] | None = None
        self.fail: set[int] = set()
        self.reached = asyncio.Event()

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        items = params.input_items.items
        turn = sum(1 for i in items if i.WhichOneof("item") == "function_call")
        self.calls += 1
        if self.gate is not None and self.gate[0] == turn:
            self.reached.set()
            await self.gate[1].wait()
        if turn in self.fail:
            self.fail.discard(turn)
            raise errors.Unavailable(f"engine gone at turn {turn}", reason=errors.Reason.ENGINE_UNAVAILABLE)
        if turn < ADDS:
            output = [call("add", json.dumps({"a": turn, "b": 1}))]
        else:
            last = [i.function_call_output.output for i in items if i.WhichOneof("item") == "function_call_output"]
            output = [assistant_message(f"The sum is {last[-1]}.")]
        return r.Response(id=new_id("resp"), model="adding", status=r.RESPONSE_STATUS_COMPLETED, output=list(output))


def _task() -> task_pb2.Task:
    return calculator_task("Add.", expected_answer=str(ADDS))


def _adds(rollout: task_pb2.Rollout) -> list[str]:
    return [i.function_call.call_id for i in rollout.response.output if i.WhichOneof("item") == "function_call"]


async def _stack(servers: Servers, env: Counter, model: AddingModel, agents: int = 1):
    """The model, the environment and `agents` agents serving, and a client's registry."""
    peers = {"model": await servers.start(model), "calc": await servers.start(env)}
    started = []
    for index in range(agents):
        agent = SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name=f"agent{index}",
            registry=static_registry(**peers),
        )
        started.append(await servers.start(agent))
    return static_registry(**{f"agent{i}": a for i, a in enumerate(started)})


async def test_a_parked_rollout_resumes_on_another_agent_from_its_turn_and_keeps_its_session():
    env, model = Counter(name="calc"), AddingModel()
    release = asyncio.Event()
    model.gate = (1, release)  # the second model call waits: the run is parked while it does
    async with Servers() as servers:
        registry = await _stack(servers, env, model, agents=2)
        first, second = AgentClient(registry, "agent0"), AgentClient(registry, "agent1")
        try:
            running = asyncio.ensure_future(first.run(_task(), 60, policy_version=1))
            await asyncio.wait_for(model.reached.wait(), 30)
            assert first.park() == 1
            release.set()
            with pytest.raises(errors.RolloutParked) as parked:
                await running
            state = parked.value.state
            assert len(state.turns) == 2 and len(state.turns[1].tool_outputs) == 1  # parked before turn 2
            assert [a.ended for a in state.attempts] == ["parked"] and not state.attempts[0].turn_lost
            assert env.runs == 2 and len(env.sessions) == 1  # the session waits for the resume
            calls_before = model.calls

            # Resumed under the trainer's next version: the turns already made keep theirs.
            rollout = await second.run(_task(), 60, policy_version=2, rollout_id=parked.value.rollout_id, resume=state)
            # Closed by the attempt that finished, once its result went out.
            await eventually(lambda: not env.sessions, "the session closed")
        finally:
            await first.close()
            await second.close()
            await registry.close()
    assert rollout.reward == 1.0
    assert json.loads(rollout.verifier_fields_json) == {"tool_calls_seen": ADDS}  # one session, every add in it
    assert env.runs == ADDS and model.calls - calls_before == 2  # turns 2 and 3; none made again
    assert rollout.model_calls == ADDS + 1 and len(_adds(rollout)) == ADDS
    # Each turn keeps the version it was sampled under: a trainer masks across the resume.
    versions = [i.function_call.policy_version for i in rollout.response.output if i.HasField("function_call")]
    assert versions == [1, 1, 2]
    assert rollout.policy_version == 2
    one, two = rollout.attempts
    assert one.agent.startswith("agent0/") and two.agent.startswith("agent1/")
    assert (one.first_turn, two.first_turn) == (0, 2)
    assert one.session_id == two.session_id and not two.session_replayed and not two.ended
    row = record.build({}, rollout)
    assert [a["agent"].split("/")[0] for a in row["attempts"]] == ["agent0", "agent1"]
    assert row["attempts"][0]["ended"] == "parked" and record.turns_regenerated(row) == 0


async def _one_rollout(env: Counter, model: AddingModel) -> task_pb2.Rollout:
    """One rollout of the task through an agent in front of `model` and `env`."""
    async with Servers() as servers:
        registry = await _stack(servers, env, model)
        client = AgentClient(registry, "agent0")
        try:
            return await client.run(_task(), 60)
        finally:
            await client.close()
            await registry.close()


async def test_a_rollout_run_to_its_end_by_one_agent_lists_no_attempts():
    env, model = Counter(name="calc"), AddingModel()
    rollout = await _one_rollout(env, model)
    assert rollout.reward == 1.0 and not rollout.attempts
    assert "attempts" not in record.build({}, rollout) and env.runs == ADDS


class ClosingLate(SimpleAgent):
    """Closes a finished rollout's session only once a seed has been refused for the environment's
    cap: the next rollout's seed reaches the environment before that close, as it may when the
    caller starts the next rollout the moment the result comes (the close goes out after it)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.refused = asyncio.Event()
        seed = self.resources.seed_session

        async def seed_session(*args):
            try:
                return await seed(*args)
            except errors.ResourceExhausted:
                self.refused.set()
                raise

        self.resources.seed_session = seed_session

    async def _close(self, resources, session_id) -> None:
        await self.refused.wait()
        await super()._close(resources, session_id)


async def test_a_session_still_closing_after_its_result_does_not_cost_the_next_rollout_its_seat():
    """One rollout at a time against an environment that holds one session: the second rollout's
    seed is refused while the first's session is still closing, waits for that close and is seeded."""
    env, model = Counter({"max_sessions": 1}, name="calc"), AddingModel()
    async with Servers() as servers:
        peers = {"model": await servers.start(model), "calc": await servers.start(env)}
        agent = ClosingLate({"model_server": "model", "resources_server": "calc"}, registry=static_registry(**peers))
        registry = static_registry(agent=await servers.start(agent))
        client = AgentClient(registry, "agent")
        try:
            rollouts = [await client.run(_task(), 60) for _ in range(2)]
            await eventually(lambda: not env.sessions, "the last session closed")
        finally:
            await client.close()
            await registry.close()
    assert agent.refused.is_set()  # the race was run: the second seed did meet the cap
    assert [rollout.reward for rollout in rollouts] == [1.0, 1.0]
    assert agent.counters.sessions_not_closed == 0


async def test_a_rollout_whose_model_server_fails_mid_rollout_is_resumed_with_only_that_turn_made_again():
    env, model = Counter(name="calc"), AddingModel()
    model.fail = {2}  # the third model call fails, once, after two adds
    rollout = await _one_rollout(env, model)
    assert rollout.reward == 1.0 and env.runs == ADDS
    assert json.loads(rollout.verifier_fields_json) == {"tool_calls_seen": ADDS}  # the session was kept
    one, two = rollout.attempts
    assert one.ended.startswith("UNAVAILABLE: ") and "engine gone at turn 2" in one.ended
    assert one.turn_lost and two.first_turn == 2 and two.session_id == one.session_id
    assert model.calls == ADDS + 2  # every turn once, and turn 2 twice
    assert record.turns_regenerated(record.build({}, rollout)) == 1


async def test_a_tool_call_sent_again_under_its_key_runs_once_and_answers_what_it_answered():
    env = Counter(name="calc")
    env.hold = asyncio.Event()
    async with Servers() as servers:
        running = await servers.start(env)
        client = ResourcesClient(static_registry(calc=running), "calc")
        try:
            await client.seed_session("s", _task())
            add = call("add", '{"a": 2, "b": 3}').function_call
            first = asyncio.ensure_future(client.call_tool("s", add, key="r/0/0", attempt=1))
            await asyncio.wait_for(env.entered.wait(), 30)
            first.cancel()  # its caller goes away mid-call: the call goes on, and is recorded
            again = asyncio.ensure_future(client.call_tool("s", add, key="r/0/0", attempt=2))
            env.hold.set()
            assert (await again).output == "5"
            assert (await client.call_tool("s", add, key="r/0/0", attempt=2)).output == "5"
            assert env.runs == 1
            assert (await client.call_tool("s", add, key="r/0/1", attempt=2)).output == "5"
            assert (await client.call_tool("s", add)).output == "5"  # no key: no record
            assert env.runs == 3
            with pytest.raises(errors.GymError) as stale:  # attempt 2 took the session over
                await client.call_tool("s", add, key="r/1/0", attempt=1)
            assert stale.value.reason == errors.Reason.STALE_ATTEMPT
            assert stale.value.code == grpc.StatusCode.FAILED_PRECONDITION and env.runs == 3
            with pytest.raises(errors.GymError) as older:
                await client.resume_session("s", 1)
            assert older.value.reason == errors.Reason.STALE_ATTEMPT
            with pytest.raises(errors.GymError) as gone:
                await client.resume_session("never-seeded", 2)
            assert gone.value.reason == errors.Reason.SESSION_NOT_OPEN
        finally:
            await client.registry.close()


def _lost_session_state(turns: int) -> task_pb2.RolloutState:
    """A rollout parked after `turns` adds whose session no environment holds any more."""
    state = task_pb2.RolloutState()
    for turn in range(turns):
        add = call("add", json.dumps({"a": turn, "b": 1}))
        done = state.turns.add(response=r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=[add]))
        done.tool_outputs.add(call_id=add.function_call.call_id, output=str(turn + 1))
    state.attempts.add(agent="gone", session_id="closed-long-ago", ended="parked")
    return state


@pytest.mark.parametrize("environment", [Counter, Replayable])
async def test_a_resumed_rollout_whose_session_is_gone_replays_it_when_the_environment_can_and_fails_typed_when_not(
    environment,
):
    env, model = environment(name="calc"), AddingModel()
    async with Servers() as servers:
        registry = await _stack(servers, env, model)
        client = AgentClient(registry, "agent0")
        try:
            if environment is Counter:
                with pytest.raises(errors.GymError) as lost:
                    await client.run(_task(), 60, rollout_id="r", resume=_lost_session_state(2))
                assert lost.value.reason == errors.Reason.SESSION_LOST
                assert lost.value.code == grpc.StatusCode.FAILED_PRECONDITION
                assert "cannot restore sessions" in lost.value.message and env.runs == 0 and model.calls == 0
                return
            rollout = await client.run(_task(), 60, rollout_id="r", resume=_lost_session_state(2))
            with pytest.raises(errors.GymError) as diverged:  # the recorded outputs are not what add gives
                wrong = _lost_session_state(2)
                wrong.turns[1].tool_outputs[0].output = "41"
                await client.run(_task(), 60, rollout_id="r2", resume=wrong)
            assert diverged.value.reason == errors.Reason.SESSION_LOST and "did not give back" in diverged.value.message
        finally:
            await client.close()
            await registry.close()
    assert rollout.reward == 1.0 and json.loads(rollout.verifier_fields_json) == {"tool_calls_seen": ADDS}
    assert rollout.attempts[-1].session_replayed and rollout.attempts[-1].session_id != "closed-long-ago"
    assert model.calls == 2  # turn 2 and the answer: the replayed turns were not generated again


async def _agents(servers: Servers, env: Counter, model: AddingModel, count: int = 1, **config):
    """The model, the environment and `count` agents all named "agent" serving (`config` added to
    theirs): (the agents' Running servers, the registry they reach the others by, for the test to close)."""
    peers = static_registry(model=await servers.start(model), calc=await servers.start(env))
    config = {**AGENT_CONFIG, **config}
    agents = [await servers.start(SimpleAgent(config, name="agent", registry=peers)) for _ in range(count)]
    return agents, peers


class HoldingProxy:
    """A TCP proxy on loopback in front of one server, which can hold back everything the server
    sends (the client reads none of it) or the client sends, and cut every connection at once: a
    connection lost with a message written but not yet read. A stand-in for the network: on
    loopback, the kernel delivers what a live process wrote, and the window in which a dying agent's
    last message is lost is too short to aim a test at."""

    def __init__(self, upstream: str) -> None:
        #: The server a new connection reaches.
        self.upstream = upstream
        #: Hold back what the server sends, from now on.
        self.holding = False
        self.held = bytearray()
        #: Hold back what the client sends (the server reads none of it), from now on; how many bytes.
        self.holding_requests = False
        self.held_requests = 0
        self._streams: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        """Listen on a free port; the proxy's address."""
        self._server = await asyncio.start_server(self._connected, "127.0.0.1", 0)
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _connected(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.upstream.rsplit(":", 1)
        upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port))
        self._streams += [writer, upstream_writer]
        await asyncio.gather(
            self._pipe(reader, upstream_writer, held=False),
            self._pipe(upstream_reader, writer, held=True),
            return_exceptions=True,  # a connection cut ends both
        )

    async def _pipe(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, held: bool) -> None:
        while data := await source.read(65536):
            if held and self.holding:
                self.held += data
                continue
            if not held and self.holding_requests:
                self.held_requests += len(data)
                continue
            sink.write(data)
            await sink.drain()

    def cut(self) -> None:
        """Reset every connection (what was held is lost with them) and hold nothing more."""
        for stream in self._streams:
            stream.transport.abort()
        self._streams.clear()
        self.held.clear()
        self.holding = self.holding_requests = False

    async def close(self) -> None:
        self.cut()
        self._server.close()
        await self._server.wait_closed()


async def test_a_result_written_but_never_read_is_resumed_and_verified_in_its_session():
    """The agent writes a durable rollout's result, and the connection is lost before the client
    reads it. The agent keeps the session open until the client says it read the result (protocol
    1.16), so the resume on the agent the client reaches next verifies the rollout in it. An agent
    that closed the session once the result was written failed that resume SESSION_LOST."""
    env, model = Counter(name="calc"), AddingModel()
    release = asyncio.Event()
    model.gate = (ADDS, release)  # the answer waits while the proxy starts holding
    async with Servers() as servers:
        (first, second), peers = await _agents(servers, env, model, 2)
        proxy = HoldingProxy(first.address)
        registry = Registry(static={"agent": await proxy.start()})
        client = AgentClient(registry, "agent")
        try:
            running = asyncio.ensure_future(client.run(_task(), 60))
            await asyncio.wait_for(model.reached.wait(), 30)
            proxy.holding = True
            release.set()
            # The verifier's fields are in the result, and only there: the result was written.
            await eventually(lambda: b"tool_calls_seen" in proxy.held, "the result written")
            assert len(env.sessions) == 1  # the client has not said it read the result
            proxy.upstream = second.address
            proxy.cut()
            rollout = await asyncio.wait_for(running, 60)
            await eventually(lambda: not env.sessions, "the session closed once the client read the result")
        finally:
            await client.close()
            await registry.close()
            await proxy.close()
            await peers.close()
    assert rollout.reward == 1.0 and json.loads(rollout.verifier_fields_json) == {"tool_calls_seen": ADDS}
    one, two = rollout.attempts
    assert one.ended.startswith("UNAVAILABLE") and two.session_id == one.session_id and not two.session_replayed
    assert env.runs == ADDS and model.calls == ADDS + 2  # the answer generated again; no add run again


async def test_runs_on_a_call_whose_connection_is_reset_under_a_write_are_resumed():
    """The connection to the agent is reset while a RunMany write waits in gRPC's core (the proxy
    holds back what the client sends, so HTTP/2's flow control stops the write), three times.
    grpc.aio then fails the write and ends the call INTERNAL ("Internal error from Core") where the
    call was lost (UNAVAILABLE). The client must resume the call's runs, as after UNAVAILABLE: when
    it took INTERNAL for the agent's answer, this test failed 12 runs of 12, about 220 runs lost each
    time, and so did 2 of 4 runs of the SIGKILLed agent's test below on a loaded machine."""
    env, model = Counter(name="calc"), AddingModel()
    env.hold = asyncio.Event()  # each run waits in its first add: on the call when it is reset
    task = calculator_task("Add. " + "x" * 100_000, expected_answer=str(ADDS))  # 100 kB a run
    size = task.ByteSize()
    async with Servers() as servers:
        (agent,), peers = await _agents(servers, env, model)
        proxy = HoldingProxy(agent.address)
        registry = Registry(static={"agent": await proxy.start()})
        client = AgentClient(registry, "agent")
        runs: list[asyncio.Future[task_pb2.Rollout]] = []

        async def reset_under_a_write() -> None:
            env.entered.clear()
            flooded = asyncio.Event()

            async def flood() -> None:  # a run every 2 ms
                while not flooded.is_set():
                    runs.append(asyncio.ensure_future(client.run(task, 60)))
                    await asyncio.sleep(0.002)

            flooder = asyncio.ensure_future(flood())
            await asyncio.wait_for(env.entered.wait(), 30)  # the call is open, its runs reach the agent
            proxy.holding_requests = True
            held, sent = proxy.held_requests, len(runs)
            # 2 MiB of runs more than reached the proxy since: the client's writer waits.
            await eventually(
                lambda: (len(runs) - sent) * size > proxy.held_requests - held + 2**21,
                "runs submitted that the client cannot write",
            )
            proxy.cut()
            flooded.set()
            await flooder

        try:
            for _ in range(3):
                await reset_under_a_write()
            env.hold.set()
            results = await asyncio.wait_for(asyncio.gather(*runs, return_exceptions=True), 120)
        finally:
            env.hold.set()
            await client.close()
            await registry.close()
            await proxy.close()
            await peers.close()
    failed = collections.Counter(f"{type(e).__name__}: {e}"[:160] for e in results if isinstance(e, BaseException))
    assert not failed, failed
    assert all(rollout.reward == 1.0 for rollout in results)
    resumed = [rollout for rollout in results if rollout.attempts]
    assert resumed and all(rollout.attempts[0].ended.startswith("UNAVAILABLE") for rollout in resumed)


def _durable_item(run_id: int, acknowledge: bool, turns: bool = False) -> agent_pb.RunManyItem:
    run = agent_pb.RunRequest(task=_task(), rollout_id=f"rollout-{run_id}")
    return agent_pb.RunManyItem(
        id=run_id, run=run, timeout_seconds=30, durable=True, acknowledge_result=acknowledge, acknowledge_turns=turns
    )


async def _results_of(call, *run_ids: int) -> list[agent_pb.RunManyResult]:
    """Read `call`'s replies up to the results of every run of `run_ids`; those results in that order."""
    results: dict[int, agent_pb.RunManyResult] = {}
    while not results.keys() >= set(run_ids):
        reply = await call.read()
        assert reply is not grpc.aio.EOF, f"the call ended with the results of {sorted(results)} of {run_ids}"
        results |= {result.id: result for result in reply.results}
    return [results[run_id] for run_id in run_ids]


@contextlib.asynccontextmanager
async def _run_many_call(env: Counter, model: AddingModel, **config):
    """An agent over `model` and `env` (`config` added to its), and a RunMany call to it through the
    generated stub, as a client in any language makes one: (the agent's Running server, the call)."""
    async with Servers() as servers:
        (agent,), peers = await _agents(servers, env, model, **config)
        try:
            async with transport.open_channel(agent.address) as channel:
                yield agent, agent_grpc.AgentServiceStub(channel).RunMany(timeout=60)
        finally:
            await peers.close()


@pytest.mark.parametrize("acknowledge", [True, False], ids=["acknowledged", "not_acknowledged"])
async def test_a_durable_runs_session_closes_once_its_client_says_it_read_the_result_or_once_written(acknowledge):
    """Over the wire, as a client in any language: with `acknowledge_result` the session waits for
    `received_ids`; without it (a client older than 1.16) it is closed once the result is written."""
    env = Counter(name="calc")
    async with _run_many_call(env, AddingModel()) as (agent, call):
        await call.write(agent_pb.RunManyRequest(runs=[_durable_item(7, acknowledge)]))
        (result,) = await _results_of(call, 7)
        assert result.rollout.reward == 1.0
        if acknowledge:
            assert len(env.sessions) == 1 and not agent.app._closing  # no close started
            await call.write(agent_pb.RunManyRequest(received_ids=[7]))
        await eventually(lambda: not env.sessions, "the session closed")
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


async def test_a_durable_runs_tool_calls_wait_until_its_client_has_read_the_turn_that_asked_for_them():
    """Over the wire (protocol 1.17): each turn that calls `add` comes in a checkpoint marked
    `acknowledge`, and the agent makes the call only once the client says it read it
    (`checkpoints_read`). Here the client does not say so until a second run on the call, which does
    not ask to acknowledge turns, has made its three adds and ended: the first run's add has not
    begun by then. An agent that made the call at once could die with the turn unsent: the run then
    began that turn again, from its prompt and in a new session, and the call ran twice (3 and 12
    rollouts of 60 so, in 2 of 6 runs of a probe of the SIGKILLed agent's test below, loaded)."""
    env = Counter(name="calc")
    client = {"read": 0, "marked": 0}

    async def replies_until_result_of(run_id: int, acknowledge: bool) -> agent_pb.RunManyResult:
        while True:
            reply = await call.read()
            assert reply is not grpc.aio.EOF
            client["read"] += len(reply.checkpoints)
            marked = sum(checkpoint.acknowledge for checkpoint in reply.checkpoints)
            client["marked"] += marked
            if marked and acknowledge:
                await call.write(agent_pb.RunManyRequest(checkpoints_read=client["read"]))
            result = next((result for result in reply.results if result.id == run_id), None)
            if result is not None:
                return result

    async with _run_many_call(env, AddingModel()) as (_, call):
        waits, goes_on = _durable_item(1, False, turns=True), _durable_item(2, False, turns=False)
        await call.write(agent_pb.RunManyRequest(runs=[waits, goes_on]))
        other = await replies_until_result_of(2, acknowledge=False)
        assert other.rollout.reward == 1.0
        assert env.runs == ADDS  # the second run's; the first waits in its first turn
        assert client["marked"] == 1  # that turn, read and not yet said to be
        at_each_add: list[tuple[int, int]] = []  # (the first run's adds begun, this one included; its turns read)
        env.on_add = lambda: at_each_add.append((env.runs - ADDS, client["marked"]))
        await call.write(agent_pb.RunManyRequest(checkpoints_read=client["read"]))
        first = await replies_until_result_of(1, acknowledge=True)
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    assert first.rollout.reward == 1.0
    assert client["marked"] == ADDS  # each turn of the first run that calls add; not its answer
    assert at_each_add == [(1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("who", ["client_older_than_1_17", "agent_reads_no_more", "client_closed_its_side"])
async def test_a_durable_run_whose_client_cannot_say_it_read_its_turns_goes_on_without_waiting(who):
    """A client that does not acknowledge turns gets no checkpoint marked; one that does, on a call
    the agent no longer reads (it holds as many runs as it may, `run_many_max_runs`; or its client
    closed its side), could say it read them only in requests nobody reads: its run goes on
    without waiting, as an older client's does. None of them may hang."""
    env = Counter(name="calc")
    config = {"run_many_max_runs": 1} if who == "agent_reads_no_more" else {}
    async with _run_many_call(env, AddingModel(), **config) as (_, call):
        item = _durable_item(3, False, turns=who != "client_older_than_1_17")
        await call.write(agent_pb.RunManyRequest(runs=[item]))
        if who == "client_closed_its_side":
            await call.done_writing()
        marked, result = 0, None
        while result is None:
            reply = await asyncio.wait_for(call.read(), 30)
            assert reply is not grpc.aio.EOF
            marked += sum(checkpoint.acknowledge for checkpoint in reply.checkpoints)
            result = next(iter(reply.results), None)
        if who != "client_closed_its_side":
            await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
    assert result.rollout.reward == 1.0 and env.runs == ADDS
    assert marked == (0 if who == "client_older_than_1_17" else ADDS)


async def test_a_run_waiting_for_its_turn_to_be_read_is_not_let_go_by_the_end_of_the_requests_alone(monkeypatch):
    """A run waits for its client to read the turn whose tool calls come next; the call's requests
    end, and the call is cancelled after (as grpc.aio ends a call whose client process died: its
    requests end as cleanly as a client's close, and the cancel follows a moment later, as a
    throwaway loop of SIGKILLed clients showed each time). The run must not go on in between: it
    would make the turn's tool calls for a turn its client never had (1 run of 50 of the killed
    collector's test below had a tool call made twice so). Here `serve` is driven directly, with a
    run that only waits, so that the moment between the two is as long as the test makes it; the
    agent lets such runs go on only once the call outlived its requests by HALF_CLOSED_SECONDS."""
    monkeypatch.setattr(run_many_server, "HALF_CLOSED_SECONDS", 3600.0)
    asked, went_on = asyncio.Event(), []

    async def run(request: agent_pb.RunRequest, context, link: run_many_server.RunLink) -> agent_pb.RunResponse:
        link.checkpoint(0, acknowledge=True)
        asked.set()
        await link.turn_read()
        went_on.append(request.rollout_id)
        return agent_pb.RunResponse()

    async def requests():
        yield agent_pb.RunManyRequest(runs=[_durable_item(1, True, turns=True)])
        await asked.wait()  # then the requests end, the turn unread

    agent = SimpleNamespace(stopping=asyncio.Event(), name="agent", config=SimpleNamespace())
    replies = run_many_server.serve(requests(), run, "ipv4:127.0.0.1:1", agent)
    reading = asyncio.ensure_future(replies.__anext__())
    await asked.wait()
    for _ in range(200):  # loop turns, not time: the run went on within a few when let go at once
        await asyncio.sleep(0)
    assert not went_on, "the run went on as the requests ended"
    reading.cancel()  # as gRPC cancels the call of a client that died
    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
        await reading
    await replies.aclose()
    assert not went_on


async def test_an_agent_that_stops_closes_the_sessions_of_results_not_yet_acknowledged():
    """A graceful stop ends the call OK once its results are written: no acknowledgement can come
    after, and the sessions are closed rather than left to the environment's idle time-out."""
    env = Counter(name="calc")
    async with _run_many_call(env, AddingModel()) as (agent, call):
        await call.write(agent_pb.RunManyRequest(runs=[_durable_item(1, True), _durable_item(2, True)]))
        results = await _results_of(call, 1, 2)
        assert [result.rollout.reward for result in results] == [1.0, 1.0] and len(env.sessions) == 2
        await agent.stop(grace=30)  # the agent's stop waits for the closes it started
        assert not env.sessions
        assert await call.read() is grpc.aio.EOF and await call.code() == grpc.StatusCode.OK


EXITING_CLIENT = """\
import asyncio
import os
import sys

from gym_grpc.client.stubs import AgentClient
from gym_grpc.rpc.registry import Registry
from gym_grpc.testing import calculator_task


async def main():
    client = AgentClient(Registry(static={"agent": sys.argv[1]}), "agent")
    task = calculator_task("Add.", expected_answer=sys.argv[2])
    rollouts = await asyncio.gather(*(client.run(task, 60) for _ in range(int(sys.argv[3]))))
    print(*(rollout.reward for rollout in rollouts), flush=True)
    os._exit(0)  # no close, no end of the event loop: a script killed right after its rollouts


asyncio.run(main())
"""


@pytest.mark.slow
async def test_a_client_process_that_exits_right_after_its_rollouts_leaves_no_session_open():
    """A script that runs its rollouts and exits without closing its client has still said it read
    every result, so the agent closes the sessions rather than keep them until the environment's idle
    time-out: the last `run` to return on a call returns once the agent confirmed it read the
    acknowledgements (protocol 1.18), the earlier ones once theirs are written. Six client
    processes, one after the other, of one and of three rollouts at once. A race, so a net with
    holes: when `run` waited only for the write (1.16), processes of three lost an acknowledgement
    often enough that this test failed 1 run in 6 to 8 beside two busy processes; when it did not
    wait at all, 3 runs in 4."""
    env, model = Counter(name="calc"), AddingModel()
    async with Servers() as servers:
        (agent,), peers = await _agents(servers, env, model)
        try:
            for count in (1, 3) * 3:
                client = await asyncio.create_subprocess_exec(
                    sys.executable, "-c", EXITING_CLIENT, agent.address, str(ADDS), str(count), stdout=PIPE, stderr=PIPE
                )
                out, err = await client.communicate()
                assert out.decode().split() == ["1.0"] * count, err.decode()
            await eventually(lambda: not env.sessions, "every client's session closed")
        finally:
            await peers.close()


async def test_a_request_that_asks_is_answered_once_read_its_acknowledgements_read_by_then():
    """Over the wire (protocol 1.18): a request with `confirm_received` is answered in the agent's
    next reply with how many such requests it has read on the call; the `received_ids` it carried
    were read first, so the session's close has begun (or ended) by the time the answer comes."""
    env = Counter(name="calc")
    async with _run_many_call(env, AddingModel()) as (agent, call):
        await call.write(agent_pb.RunManyRequest(runs=[_durable_item(7, True)]))
        (result,) = await _results_of(call, 7)
        assert result.rollout.reward == 1.0 and len(env.sessions) == 1
        for asked in (1, 2):
            await call.write(agent_pb.RunManyRequest(received_ids=[7] if asked == 1 else [], confirm_received=True))
            reply = await call.read()
            assert reply.received_confirmed == asked
            assert agent.app._closing or not env.sessions  # the close began before the answer went out
        await eventually(lambda: not env.sessions, "the session closed")
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK


@pytest.mark.parametrize("rollouts", [1, 3])
async def test_the_last_rollout_on_a_call_returns_once_the_agent_has_read_every_acknowledgement(rollouts, monkeypatch):
    """`run` returns a durable rollout once its acknowledgement is written; the one that leaves its
    call with no run in flight asks the agent to confirm it read it, and returns only then (1.18). So
    when the last of several rollouts at once returns, the agent has read every acknowledgement, and
    only one request asked. Without the confirmation the agent reads them after `run` returns: a
    process that exits then can take them with it (the exiting-client test above)."""
    read: list[int] = []
    asked: list[int] = []
    received, confirm = run_many_server._Runs.received, run_many_server._Runs.confirm_received
    monkeypatch.setattr(
        run_many_server._Runs, "received", lambda runs, run_id: (read.append(run_id), received(runs, run_id))
    )
    monkeypatch.setattr(run_many_server._Runs, "confirm_received", lambda runs: (asked.append(1), confirm(runs)))
    env, model = Counter(name="calc"), AddingModel()
    async with Servers() as servers:
        client = AgentClient(await _stack(servers, env, model), "agent0")
        rollouts_read = await asyncio.gather(*(client.run(_task()) for _ in range(rollouts)))
        assert [rollout.reward for rollout in rollouts_read] == [1.0] * rollouts
        assert len(read) == rollouts and len(asked) == 1
        await client.close()
        await client.registry.close()


@pytest.mark.parametrize("agent", ["older_than_1_18", "never_answers"])
async def test_a_rollout_whose_agent_does_not_confirm_its_acknowledgement_still_returns(agent, monkeypatch):
    """An agent older than 1.18 is not asked (its handshake says its version); one that is asked and
    never answers (a replica of an older version behind the same name, a process that hangs) delays
    the rollout by ACKNOWLEDGED_SECONDS at most: the rollout in hand is returned, never held."""
    asked: list[int] = []
    confirm = run_many_server._Runs.confirm_received
    if agent == "older_than_1_18":  # it would answer: it is not asked
        monkeypatch.setattr(protocol, "VERSION", (1, 17))
        monkeypatch.setattr(run_many_server._Runs, "confirm_received", lambda runs: (asked.append(1), confirm(runs)))
    else:
        monkeypatch.setattr(run_many_server._Runs, "confirm_received", lambda runs: asked.append(1))
        monkeypatch.setattr(run_many_client, "ACKNOWLEDGED_SECONDS", 0.2)
    env, model = Counter(name="calc"), AddingModel()
    async with Servers() as servers:
        client = AgentClient(await _stack(servers, env, model), "agent0")
        rollout = await asyncio.wait_for(client.run(_task()), 30)
        assert rollout.reward == 1.0
        assert len(asked) == (0 if agent == "older_than_1_18" else 1)
        await eventually(lambda: not env.sessions, "the session closed")  # the acknowledgement was sent all the same
        await client.close()
        await client.registry.close()


async def test_a_resume_the_agent_cannot_use_is_refused_naming_the_field():
    env, model = Counter(name="calc"), AddingModel()
    async with Servers() as servers:
        registry = await _stack(servers, env, model)
        client = AgentClient(registry, "agent0")
        try:
            state = _lost_session_state(2)
            state.turns[0].tool_outputs.add(output="an output for a call nobody made")
            with pytest.raises(errors.GymError) as bad:
                await client.run(_task(), 60, rollout_id="r", resume=state)
            assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "resume.turns[0].tool_outputs: 2 outputs for 1 function calls" in bad.value.message
        finally:
            await client.close()
            await registry.close()


def _agent_process(registry: str) -> tuple[subprocess.Popen, str]:
    """A SimpleAgent in its own process, as `gym-grpc run` starts one; its address."""
    entrypoint = f"{REPO}/servers/agents/simple_agent/agent.py:SimpleAgent"
    return worker_process("agent", entrypoint, {"model_server": "model", "resources_server": "calc"}, registry)


async def _runs_in(address: str) -> int:
    async with transport.open_channel(address) as channel:
        counters = await admin_grpc.AdminServiceStub(channel).GetCounters(admin_pb.GetCountersRequest(), timeout=10)
    return sum(m.in_flight for m in counters.methods if m.method == "Run")


@pytest.mark.slow
async def test_a_tool_with_a_counted_side_effect_runs_once_per_call_across_an_agent_killed_in_the_call():
    env, model = Counter(name="calc"), AddingModel()
    env.hold = asyncio.Event()  # the first add is held in the environment while its agent dies
    async with Servers() as servers:
        registry_server = await start_registry(servers)
        for name, app in (("model", model), ("calc", env)):
            running = await servers.start(app)
            registry_server.app.servicer.add(reg.ServerInfo(name=name, addresses=[running.address]))
        agents = [_agent_process(registry_server.address) for _ in range(2)]
        try:
            addresses = [address for _, address in agents]
            registry_server.app.servicer.add(reg.ServerInfo(name="agent", addresses=addresses))
            registry = Registry(registry_server.address)
            client = AgentClient(registry, "agent")
            try:
                running = asyncio.ensure_future(client.run(_task(), 120))
                await asyncio.wait_for(env.entered.wait(), 60)
                holder = [i for i, address in enumerate(addresses) if await _runs_in(address)]
                assert len(holder) == 1, holder
                doomed = agents[holder[0]][0]
                doomed.send_signal(signal.SIGKILL)
                doomed.wait(30)
                env.hold.set()  # the add the dead agent asked for finishes now, its caller gone
                rollout = await asyncio.wait_for(running, 120)
            finally:
                await client.close()
                await registry.close()
        finally:
            for process, _ in agents:
                process.kill()
                process.wait(30)
    assert rollout.reward == 1.0 and final_text(rollout.response) == f"The sum is {ADDS}."
    assert env.runs == len(_adds(rollout)) == ADDS  # each add ran once, the one in flight included
    assert json.loads(rollout.verifier_fields_json) == {"tool_calls_seen": ADDS}
    one, two = rollout.attempts
    assert one.agent.startswith("agent/") and two.agent.startswith("agent/") and one.agent != two.agent
    assert one.ended.startswith("UNAVAILABLE") and not one.turn_lost  # it died in a tool call, not the model's
    assert two.first_turn == 1 and two.session_id == one.session_id
    assert model.calls == ADDS + 1  # no turn generated twice


DOUBLES = """\
import asyncio
import json
from pathlib import Path

from gym_grpc.model import ModelServer
from gym_grpc.resources import ResourcesServer, Session, Verification, tool
from gym_grpc.responses import assistant_message, new_id
from gym_grpc.testing import call
from gym_grpc.v1 import responses_pb2 as r


#: Made by the test once it has killed the agent.
RELEASE = Path(__file__).with_name("release")
#: A line for each add begun, in any session: what a tool with an effect outside its session leaves.
ADDS = Path(__file__).with_name("adds")
#: Made by the first add held: a rollout is then in the agent, in a tool call, until the kill.
HELD = Path(__file__).with_name("held")


class SlowCounter(ResourcesServer):
    scored = 0

    async def seed_session(self, session: Session) -> None:
        session.state["runs"] = 0

    @tool
    async def add(self, a: int, b: int, session: Session) -> int:
        \"\"\"Add two integers, slowly: most of a rollout's time is spent here. Once ten rollouts are
        scored, an add waits until RELEASE is made (saying so with HELD): the test kills the agent
        once one does, so that rollout is in the agent then, however loaded the machine.\"\"\"
        session.state["runs"] += 1
        with ADDS.open("a") as adds:
            adds.write(session.id + "\\n")
        if SlowCounter.scored >= 10 and not RELEASE.exists():
            HELD.touch()
        while SlowCounter.scored >= 10 and not RELEASE.exists():
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.3)
        return a + b

    async def verify(self, session: Session, response: r.Response) -> Verification:
        SlowCounter.scored += 1
        return Verification(reward=1.0, fields={"runs": session.state.get("runs", -1)})


class Adding(ModelServer):
    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        turn = sum(1 for i in params.input_items.items if i.WhichOneof("item") == "function_call")
        item = call("add", json.dumps({"a": turn, "b": 1})) if turn < 3 else assistant_message("Done.")
        return r.Response(id=new_id("resp"), status=r.RESPONSE_STATUS_COMPLETED, output=[item])
"""


def _slow_counter_config(tmp_path, restart: bool):
    """A configuration of SlowCounter, Adding and a SimpleAgent over them (restarted by the runner
    when it dies, with `restart`), a process each: an agent that dies alone leaves its sessions."""
    doubles = tmp_path / "durable_doubles.py"
    doubles.write_text(DOUBLES)
    config = tmp_path / "durable.yaml"
    config.write_text(
        "layout: per_server\n"
        "servers:\n"
        f"  calc: {{entrypoint: '{doubles}:SlowCounter'}}\n"
        f"  model: {{entrypoint: '{doubles}:Adding'}}\n"
        f"  agent: {{entrypoint: '{REPO}/servers/agents/simple_agent/agent.py:SimpleAgent',"
        f" restart: {str(restart).lower()}, config: {{model_server: model, resources_server: calc}}}}\n"
    )
    return config


def _collect_until_an_add_is_held(run, tmp_path, output) -> tuple[list[str], subprocess.Popen]:
    """`gym-grpc collect` of 60 rollouts, 20 at once, into `output`, once ten rows are written and an
    add is held (SlowCounter holds each add once ten rollouts are scored): its command, its process."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"responses_create_params": {"input": "Add three times."}}) + "\n")
    command = [installed("gym-grpc"), *collect_args(run.registry, "agent", tasks, output)]
    command += ["--num-repeats", "60", "--max-in-flight", "20", "--no-progress"]
    collect = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not output.exists() or len(read_rows(output)) < 10 or not (tmp_path / "held").exists():
        assert collect.poll() is None and time.monotonic() < deadline, "10 rows, or an add held, never came"
        time.sleep(0.05)
    return command, collect


@pytest.mark.slow
def test_an_agent_restarted_mid_collection_resumes_its_rollouts_and_runs_each_tool_call_once(tmp_path):
    """`gym-grpc run` with `restart: true` on the agent, `gym-grpc collect` in flight, the agent's
    process SIGKILLed once ten rollouts are written and one waits in a tool call (held there once ten
    are scored, until the kill): the runner starts it again on its port, and the collector resumes
    every rollout there. Every add ran once, counted across sessions too. Before protocol 1.17 an
    agent made a turn's tool calls before its caller had the turn: a run whose turn died unsent with
    the agent began that turn again, in a new session, and its add ran twice (this test failed 4 of 10
    runs so, with six busy processes beside it). Killed at the tenth row alone, the agent could hold
    only rollouts that had just begun, none yet known to the collector (1 run of 16, loaded): they
    are sent again as new, and none is resumed."""
    output = tmp_path / "out.jsonl"
    run = start_run(configs=(_slow_counter_config(tmp_path, restart=True),))
    try:
        (agent_pid,) = run.pids("agent")
        _, collect = _collect_until_an_add_is_held(run, tmp_path, output)
        os.kill(agent_pid, signal.SIGKILL)
        (tmp_path / "release").touch()
        _, stderr = collect.communicate(timeout=600)
    finally:
        run.stop()
    assert collect.returncode == 0, stderr
    assert "restarting 'agent'" in run.log()
    rows = read_rows(output)
    assert len(rows) == 60 and not output.with_suffix(".failures.jsonl").exists()
    for row in rows:
        adds = [item for item in row["response"]["output"] if item["type"] == "function_call"]
        assert row["runs"] == len(adds) == 3, row  # every add ran once, in a session that lived on
    sessions = collections.Counter((tmp_path / "adds").read_text().split())
    assert sum(sessions.values()) == 3 * 60, f"{sum(sessions.values())} adds in {len(sessions)} sessions"
    resumed = [row for row in rows if "attempts" in row]
    print(f"agent restarted: {len(resumed)} of 60 rollouts resumed")
    assert resumed, "no rollout was in flight in the agent that died"
    for row in resumed:
        assert row["attempts"][0]["ended"].startswith("UNAVAILABLE"), row["attempts"]


async def test_a_rollout_whose_row_was_not_written_keeps_its_session_and_the_next_run_resumes_it(tmp_path, monkeypatch):
    """`collect` stopped by its output as it writes a rollout's row (a full disk): the agent was not
    told the rollout came, so its session stays, and the next run resumes the rollout in it from its
    last turn, each add made once. When the agent was told as the rollout came, the session closed
    then, and the next run made every add again in a new one (as a collector killed between the two
    did). The full disk is a stand-in: the output's appender raises the OutputError a full disk
    makes (test_cli's full-disk test has a real one)."""
    env, model = Counter(name="calc"), AddingModel()
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"responses_create_params": {"input": "Add."}, "expected_answer": str(ADDS)}) + "\n")
    output = tmp_path / "out.jsonl"
    append = jsonl.Appender.append

    def full(appender: jsonl.Appender, row: dict) -> None:
        if appender.path == output:
            raise errors.OutputError(f"cannot write {output}: No space left on device")
        append(appender, row)

    async with Servers() as servers:
        registry = await _stack(servers, env, model)
        options = CollectOptions(input=tasks, output=output, agent="agent0", progress=False)
        monkeypatch.setattr(jsonl.Appender, "append", full)
        with pytest.raises(errors.OutputError):
            await collect(registry, options, log=io.StringIO())
        monkeypatch.undo()
        assert env.runs == ADDS and len(env.sessions) == 1, "the session was closed with its row unwritten"
        calls = model.calls
        summary = await collect(registry, options, log=io.StringIO())
        await eventually(lambda: not env.sessions, "the session closed once the row was written")
        await registry.close()
    assert summary.done == 1 and env.runs == ADDS
    (row,) = read_rows(output)
    first, second = row["attempts"]
    assert first["ended"] == states_module.STOPPED and second["session_id"] == first["session_id"]
    # Its last turn was in the file: nothing is generated again, its answer is verified in the session.
    assert second["first_turn"] == ADDS + 1 and model.calls == calls


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGKILL, signal.SIGINT], ids=["killed", "interrupted"])
def test_a_collector_stopped_mid_collection_is_resumed_by_the_next_run_from_its_states_file(tmp_path, stop):
    """`gym-grpc collect` stopped once ten rollouts are written and one waits in a tool call (held
    there once ten are scored), then run again. Killed (SIGKILL: its sessions live on in the
    environment), the next run resumes every rollout its states file holds, in its session, from its
    last turn: each add ran once. Interrupted (Ctrl-C: the collector
    cancels its runs, and the agent closes their sessions), the rollouts whose session is gone start
    again from their prompts. Either way every row is written, and the states file goes once the run
    ends. Before the states file, a killed collector's rollouts in flight all began again."""
    output = tmp_path / "out.jsonl"
    states = output.with_name("out.states")
    run = start_run(configs=(_slow_counter_config(tmp_path, restart=False),))
    try:
        command, collect = _collect_until_an_add_is_held(run, tmp_path, output)
        collect.send_signal(stop)
        _, stderr = collect.communicate(timeout=60)
        assert collect.returncode == (-signal.SIGKILL if stop == signal.SIGKILL else 130), stderr
        assert stop == signal.SIGKILL or f"and the rollouts in flight in {states}" in stderr
        written = len(read_rows(output))
        assert states.exists() and written < 60
        (tmp_path / "release").touch()
        again = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    finally:
        run.stop()
    assert again.returncode == 0, again.stderr
    assert "were in flight when the last run stopped: those not in the output go on from" in again.stderr
    rows = read_rows(output)
    assert len(rows) == 60 and not output.with_suffix(".failures.jsonl").exists()
    assert not states.exists()
    for row in rows:
        adds = [item for item in row["response"]["output"] if item["type"] == "function_call"]
        assert row["runs"] == len(adds) == 3, row  # each in one session, whole
    resumed = [row for row in rows[written:] if "attempts" in row]
    print(f"collector {signal.Signals(stop).name}: {len(resumed)} of {60 - written} rollouts resumed")
    if stop == signal.SIGKILL:
        # Each add ran once: no rollout began again after a tool call of a turn its collector did not
        # have, nor after its result came with its row not yet written (1 run of 32 under load had
        # one such, until the agent was told of a result only once its row was written).
        sessions = collections.Counter((tmp_path / "adds").read_text().split())
        assert len(sessions) == 60 and set(sessions.values()) == {3}, f"{sum(sessions.values())} adds: {sessions}"
        assert resumed, "no rollout was resumed"
        for row in resumed:
            first, second = row["attempts"]
            assert first["ended"] == states_module.STOPPED and second["session_id"] == first["session_id"]
        assert any(row["attempts"][1]["first_turn"] >= 1 for row in resumed), "none went on past its prompt"
