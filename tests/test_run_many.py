"""AgentService.RunMany: many runs over one call, each ending as Run would have ended it.

Real servers on loopback: the simple agent, a model that answers with the
prompt after a delay (and fails on "fail"), the calculator environment. The
first tests speak the wire through the generated stub, as a client in any
language would; the last ones go through `AgentClient`, which sends its
rollouts over RunMany when the agent serves it.
"""

import asyncio
import collections
import json
import math
import random
import time

import grpc
import pytest
from grpc_status import rpc_status

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.client import run_many as _run_many_client
from gym_grpc.client.stubs import AgentClient
from gym_grpc.cpu_pool import CpuPool
from gym_grpc.data.rows import task_from_row
from gym_grpc.responses import input_items, message_text
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.server import run_many as _run_many_server
from gym_grpc.testing import Servers
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from tests.support import MATH, Calculator, EchoModel, call, eventually, say, start_run, static_registry, task
from tests.test_replicas import replicated


async def _agent(start, model: EchoModel, calculator: Calculator | None = None):
    """The simple agent over `model` and the calculator (`calculator`, or a new one); (its Running, a
    registry naming it "agent")."""
    served_model = await start(model)
    env = await start(calculator or Calculator(name="calc"))
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=static_registry(model=served_model, calc=env),
        )
    )
    return agent, static_registry(agent=agent)


def _item(run_id: int, text: str, timeout: float = 30.0, **data) -> agent_pb.RunManyItem:
    return agent_pb.RunManyItem(id=run_id, run=agent_pb.RunRequest(task=task(text, **data)), timeout_seconds=timeout)


async def _results(call) -> dict[int, agent_pb.RunManyResult]:
    """The results of the replies still to come on `call`, by run id."""
    results = {}
    while (reply := await call.read()) is not grpc.aio.EOF:
        results |= {result.id: result for result in reply.results}
    return results


async def test_runs_sent_over_one_call_come_back_each_under_its_id(start):
    agent, _ = await _agent(start, EchoModel(delay=0.01))
    async with transport.open_channel(agent.address) as channel:
        call = agent_grpc.AgentServiceStub(channel).RunMany(timeout=30)
        await call.write(
            agent_pb.RunManyRequest(runs=[_item(1, "7", expected_answer=7), _item(2, "8", expected_answer=9)])
        )
        await call.write(agent_pb.RunManyRequest(runs=[_item(30, "30", expected_answer=30)]))
        await call.done_writing()
        results = await _results(call)
        assert await call.code() == grpc.StatusCode.OK
    assert {i: r.rollout.reward for i, r in results.items()} == {1: 1.0, 2: 0.0, 30: 1.0}
    assert all(r.rollout.model_calls == 1 and r.rollout.response.output for r in results.values())


async def test_each_reply_says_how_busy_the_agents_process_and_its_check_pools_were(start, monkeypatch):
    """RunManyResponse.load: the agent process's CPU and its CPU pools' share of time on checks, over
    the interval (LOAD_SECONDS, at least) that ended at the reply. A pool worker kept on a check
    through the interval makes it busy; once it has been idle for a whole interval, it is not."""
    monkeypatch.setattr(_run_many_server, "LOAD_SECONDS", 0.2)
    monkeypatch.setattr(_run_many_server, "_LOAD", _run_many_server._Load())  # an interval from now
    agent, _ = await _agent(start, EchoModel(delay=0.01))
    pool = CpuPool("t", workers=1)
    await pool.start()
    await pool.run(time.sleep, 0)  # its worker serves: the check below begins as soon as it is sent
    try:
        async with transport.open_channel(agent.address) as channel:
            call = agent_grpc.AgentServiceStub(channel).RunMany(timeout=30)

            async def load_after(run_id: int) -> agent_pb.WorkerLoad:
                await call.write(agent_pb.RunManyRequest(runs=[_item(run_id, "7", expected_answer=7)]))
                reply = await call.read()
                assert [result.id for result in reply.results] == [run_id]
                return reply.load

            # Each reply after a wait longer than LOAD_SECONDS ends an interval and begins the next.
            await load_after(1)
            checking = asyncio.ensure_future(pool.run(time.sleep, 0.5))
            await asyncio.sleep(0.3)
            during = await load_after(2)  # the check ran through most of this interval
            await checking
            await asyncio.sleep(0.3)
            await load_after(3)  # the interval the check ended in
            await asyncio.sleep(0.3)
            after = await load_after(4)  # an interval after it
            await call.done_writing()
            assert await call.code() == grpc.StatusCode.OK
    finally:
        pool.close()
    assert during.cpu > 0 and during.checks > 0, during
    assert after.cpu > 0 and after.checks == 0, after


async def test_a_failed_run_ends_as_run_would_end_it_and_the_others_go_on(start):
    agent, _ = await _agent(start, EchoModel(delay=0.01))
    async with transport.open_channel(agent.address) as channel:
        stub = agent_grpc.AgentServiceStub(channel)
        bad = agent_pb.RunRequest(task=task_pb2.Task())  # no input
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Run(bad, timeout=30)
        call = stub.RunMany(timeout=30)
        items = [agent_pb.RunManyItem(id=1, run=bad), _item(2, "2", expected_answer=2)]
        await call.write(agent_pb.RunManyRequest(runs=items))
        await call.done_writing()
        results = await _results(call)
    assert results[2].rollout.reward == 1.0
    error = results[1].error
    status = rpc_status.from_call(unary.value)
    assert (error.code, error.message) == (unary.value.code().value[0], unary.value.details())
    assert list(error.details) == list(status.details)  # ErrorInfo and BadRequest, as Run sent them
    assert errors.field_of(unary.value) == "task.responses_create_params.input"


async def test_a_run_past_its_timeout_fails_with_deadline_exceeded_and_stops_downstream(start):
    model = EchoModel(delay=30)
    agent, _ = await _agent(start, model)
    async with transport.open_channel(agent.address) as channel:
        call = agent_grpc.AgentServiceStub(channel).RunMany(timeout=30)
        await call.write(agent_pb.RunManyRequest(runs=[_item(1, "slow", timeout=0.3)]))
        await call.done_writing()
        results = await _results(call)
    assert results[1].error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    await eventually(lambda: model.cancelled == 1, "the run cancelled at the model")


async def test_cancel_ids_cancel_one_run_and_leave_the_others(start):
    model = EchoModel(gate=asyncio.Event())
    agent, _ = await _agent(start, model)
    async with transport.open_channel(agent.address) as channel:
        call = agent_grpc.AgentServiceStub(channel).RunMany(timeout=30)
        await call.write(agent_pb.RunManyRequest(runs=[_item(1, "1", expected_answer=1), _item(2, "2")]))
        await eventually(lambda: model.active == 2, "both runs at the model")
        await call.write(agent_pb.RunManyRequest(cancel_ids=[2, 99]))  # 99 is not in flight: ignored
        await call.done_writing()
        results = {result.id: result for result in (await call.read()).results}  # run 1 waits on the gate
        # The cancel reaches the model server's call on its own; opened before, the gate would let
        # run 2's model call finish instead.
        await eventually(lambda: model.cancelled == 1, "run 2's model call cancelled")
        model.gate.set()
        results |= await _results(call)
        assert await call.code() == grpc.StatusCode.OK
    assert results[1].rollout.reward == 1.0
    assert results[2].error.code == grpc.StatusCode.CANCELLED.value[0]
    assert model.cancelled == 1


async def test_a_run_cancelled_in_the_request_that_starts_it_ends_cancelled_and_the_call_ends(start):
    """Its task is cancelled before it first runs (test_fuzz.py found the call then never ended)."""
    agent, _ = await _agent(start, EchoModel(delay=0.01))
    async with transport.open_channel(agent.address) as channel:
        call = agent_grpc.AgentServiceStub(channel).RunMany(timeout=30)
        runs = [_item(1, "1", expected_answer=1), _item(2, "2")]
        await call.write(agent_pb.RunManyRequest(runs=runs, cancel_ids=[2, 2]))  # a repeated id: ignored
        await call.done_writing()
        results = await _results(call)
        assert await call.code() == grpc.StatusCode.OK
    assert results[1].rollout.reward == 1.0
    assert results[2].error.code == grpc.StatusCode.CANCELLED.value[0]


def _random_requests(rng: random.Random) -> list[agent_pb.RunManyRequest]:
    """One to five requests over a few ids: runs good, bad (no input) and short of time, durable
    or not, and cancels and parks of those ids, each landing before, during or after its run."""
    requests = []
    for _ in range(rng.randint(1, 5)):
        request = agent_pb.RunManyRequest()
        for _ in range(rng.randint(0, 3)):
            run_id = rng.randint(0, 3)
            item = _item(run_id, str(run_id), timeout=rng.choice([30.0, 0.0, 0.001]), expected_answer=run_id)
            if rng.random() < 0.2:
                item.run.task.Clear()  # INVALID_ARGUMENT
            if rng.random() < 0.3:
                item.durable = True
                if rng.random() < 0.8:  # without one: INVALID_ARGUMENT
                    item.run.rollout_id = f"r{run_id}-{rng.random()}"
            request.runs.append(item)
        request.cancel_ids.extend(rng.randint(0, 3) for _ in range(rng.choice([0, 0, 1, 2])))
        request.park_ids.extend(rng.randint(0, 3) for _ in range(rng.choice([0, 0, 1])))
        requests.append(request)
    return requests


class AddingModel(EchoModel):
    """Calls add(n, 0) for the prompt n, then answers with the tool's output: two model calls with a
    tool call between them, so that a park, a cancel or a checkpoint can land at a turn boundary."""

    async def create_response(self, params, session_id):
        await asyncio.sleep(self.delay)
        last = input_items(params)[-1]
        if last.HasField("function_call_output"):
            return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=say(last.function_call_output.output))
        arguments = json.dumps({"a": int(message_text(last.message)), "b": 0})
        return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=[call("add", arguments)])


async def test_random_streams_of_runs_cancels_and_parks_end_with_one_result_a_run(start):
    """Whatever a call's requests hold, every run read gets one result and the call ends OK."""
    agent, _ = await _agent(start, AddingModel(delay=0.003))
    outcomes: collections.Counter[str] = collections.Counter()
    async with transport.open_channel(agent.address) as channel:
        stub = agent_grpc.AgentServiceStub(channel)
        for seed in range(150):
            rng = random.Random(seed)
            requests = _random_requests(rng)
            call = stub.RunMany(timeout=30)
            for request in requests:
                await call.write(request)
                if rng.random() < 0.5:
                    await asyncio.sleep(0.003)  # some runs under way before the next request
            await call.done_writing()
            results = [result async for reply in call for result in reply.results]
            assert await call.code() == grpc.StatusCode.OK, seed
            sent = collections.Counter(item.id for request in requests for item in request.runs)
            assert collections.Counter(result.id for result in results) == sent, (seed, requests, results)
            outcomes.update(result.WhichOneof("outcome") for result in results)
    # Each kind of end was reached: the streams test what they are meant to.
    assert None not in outcomes and min(outcomes[kind] for kind in ("rollout", "error", "parked")) >= 10, outcomes


async def test_random_callers_that_give_up_or_park_leave_no_run_and_no_session_behind(start):
    """AgentClient's side: rollouts whose callers cancel them (before they go out, or at any point
    after), run out of time or are parked, in rounds. Every caller gets its answer, and once a
    round is over the agent has no run left and the environment keeps only the parked runs' sessions."""
    model, env = AddingModel(delay=0.003), Calculator(name="calc")
    agent, registry = await _agent(start, model, env)
    client = AgentClient(registry, "agent")
    ends: collections.Counter[str] = collections.Counter()

    def methods() -> dict[str, admin_pb.MethodCounters]:
        return {m.method: m for m in agent.app.counters.to_proto().methods}

    try:
        for seed in range(40):
            rng = random.Random(seed)
            runs = [
                asyncio.ensure_future(client.run(task(str(i), expected_answer=i), rng.choice([30.0, 30.0, 0.004])))
                for i in range(rng.randint(1, 20))
            ]
            for run in runs:
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.choice([0, 0, 0.002, 0.006]))
                    run.cancel()
            if rng.random() < 0.3:
                await asyncio.sleep(0.004)
                client.park()
            async with asyncio.timeout(30):  # a caller never answered is a hang
                answers = await asyncio.gather(*runs, return_exceptions=True)
            for answer in answers:
                kind = type(answer).__name__
                assert kind in ("Rollout", "CancelledError", "DeadlineExceeded", "RolloutParked"), (seed, answer)
                ends[kind] += 1
            parked = sum(isinstance(answer, errors.RolloutParked) for answer in answers)
            await eventually(lambda: model.active == 0, f"seed {seed}: no model call left")
            await eventually(lambda: methods()["Run"].in_flight == 0, f"seed {seed}: no run left on the agent")
            await eventually(
                lambda parked=parked: len(env.sessions) == parked, f"seed {seed}: only the parked runs' sessions"
            )
            env.sessions.clear()  # the parked runs are not resumed
        await client.close()
        await eventually(lambda: methods()["RunMany"].in_flight == 0, "the client's calls ended")
        # The client's calls ended as it closed them, with no run left open on them: OK, not CANCELLED.
        assert set(methods()["RunMany"].calls_by_status) == {"OK"}, methods()["RunMany"]
        # A run's caller that gave up while it ran stopped it on the agent.
        assert methods()["Run"].calls_by_status["CANCELLED"] > 0, methods()["Run"]
    finally:
        await client.close()
        await registry.close()
    assert min(ends[kind] for kind in ("Rollout", "CancelledError", "DeadlineExceeded", "RolloutParked")) >= 5, ends


async def test_an_id_already_in_flight_fails_only_the_second_run(start):
    agent, _ = await _agent(start, EchoModel(delay=0.2))
    async with transport.open_channel(agent.address) as channel:
        call = agent_grpc.AgentServiceStub(channel).RunMany(timeout=30)
        await call.write(agent_pb.RunManyRequest(runs=[_item(5, "5", expected_answer=5), _item(5, "6")]))
        await call.done_writing()
        results = [result async for reply in call for result in reply.results]
    assert sorted(r.WhichOneof("outcome") for r in results) == ["error", "rollout"]
    failed = next(r for r in results if r.WhichOneof("outcome") == "error")
    assert (
        failed.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "already in flight" in failed.error.message
    )
    assert next(r for r in results if r.WhichOneof("outcome") == "rollout").rollout.reward == 1.0


async def test_cancelling_the_call_cancels_every_run_on_it_downstream(start):
    model = EchoModel(delay=30)
    agent, _ = await _agent(start, model)
    async with transport.open_channel(agent.address) as channel:
        call = agent_grpc.AgentServiceStub(channel).RunMany()
        await call.write(agent_pb.RunManyRequest(runs=[_item(i, str(i)) for i in range(3)]))
        await eventually(lambda: model.active == 3, "the runs at the model")
        call.cancel()
        await eventually(lambda: model.cancelled == 3, "the runs cancelled at the model")
    await eventually(lambda: agent.app.counters.to_proto().in_flight == 0, "nothing in flight at the agent")


async def test_a_message_that_does_not_parse_ends_the_call_with_invalid_argument(start):
    agent, _ = await _agent(start, EchoModel())
    async with transport.open_channel(agent.address) as channel:
        raw = channel.stream_stream(
            "/gym.v1.AgentService/RunMany",
            request_serializer=lambda data: data,
            response_deserializer=agent_pb.RunManyResponse.FromString,
        )
        call = raw(timeout=30)
        await call.write(b"\x0a\xff\xff\xff\xff")  # field 1, a length past the end
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await _results(call)
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert errors.reason_of(failed.value) == errors.Reason.REQUEST_NOT_PARSABLE


async def test_agent_client_sends_its_runs_over_run_many_each_counted_as_a_run(start):
    agent, registry = await _agent(start, EchoModel(delay=0.01))
    client = AgentClient(registry, "agent")
    rollouts = await asyncio.gather(*(client.run(task(str(i), expected_answer=i), timeout=30) for i in range(20)))
    assert [r.reward for r in rollouts] == [1.0] * 20
    counted = {m.method: m for m in agent.app.counters.to_proto().methods}
    assert counted["Run"].calls_by_status["OK"] == 20
    assert counted["RunMany"].in_flight == 1  # one call carried them all, and stays open for more
    await registry.close()


async def test_a_closed_agent_client_ends_its_calls_and_leaves_no_task_of_them_pending(start):
    """A task left pending outlives its event loop and is finalised wherever the garbage
    collector next runs (in CI: inside pytest's import of a module, which CPython 3.11 failed)."""
    agent, registry = await _agent(start, EchoModel(delay=0.01))
    client = AgentClient(registry, "agent")
    await client.run(task("7", expected_answer=7), timeout=30)
    calls = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.startswith("_Call.")]
    assert len(calls) == 2  # the call's sender and receiver
    await client.close()
    assert all(t.done() for t in calls)

    def in_flight() -> int:
        return next(m.in_flight for m in agent.app.counters.to_proto().methods if m.method == "RunMany")

    await eventually(lambda: in_flight() == 0, "the agent saw the call end")
    await registry.close()


async def test_agent_client_errors_are_those_of_run(start):
    agent, registry = await _agent(start, EchoModel(delay=0.01))
    client = AgentClient(registry, "agent")
    for bad in (task_pb2.Task(), task("fail")):  # a task with no input; a model that raises
        with pytest.raises(errors.GymError) as over_run_many:
            await client.run(bad, timeout=30)
        with pytest.raises(errors.GymError) as over_run:
            await client._call("Run", agent_pb.RunRequest(task=bad), 30)
        ours, theirs = over_run_many.value, over_run.value
        assert type(ours) is type(theirs) and ours.code == theirs.code
        assert (ours.message, ours.field, ours.reason, ours.metadata) == (
            theirs.message,
            theirs.field,
            theirs.reason,
            theirs.metadata,
        )
    assert ours.message.startswith("agent 'agent' Run: INTERNAL: model server 'model' CreateResponse: INTERNAL")
    await registry.close()


async def test_agent_client_caller_cancelled_or_past_its_deadline_stops_its_run_on_the_server(start):
    model = EchoModel(delay=30)
    agent, registry = await _agent(start, model)
    client = AgentClient(registry, "agent")
    waiting = asyncio.ensure_future(client.run(task("x"), timeout=60))
    await eventually(lambda: model.active == 1, "the run at the model")
    waiting.cancel()
    await eventually(lambda: model.cancelled == 1, "the run cancelled at the model")
    with pytest.raises(errors.DeadlineExceeded):
        await client.run(task("y"), timeout=0.3)
    await eventually(lambda: model.cancelled == 2, "the late run cancelled at the model")
    run_many = {m.method: m for m in agent.app.counters.to_proto().methods}["RunMany"]
    assert run_many.in_flight == 1 and not run_many.calls_by_status  # the call that carried them goes on
    await registry.close()


async def test_a_stopping_agent_starts_no_new_run_and_ends_the_call_once_its_runs_are_done(start):
    """A graceful stop (a scale-down, the end of `gym-grpc run`): the run in flight finishes, a
    run read after the stop began is answered UNAVAILABLE / SERVER_STOPPING and never started,
    and the call ends OK, so a run that has no result was never read."""
    model = EchoModel(gate=asyncio.Event())
    agent, _ = await _agent(start, model)
    async with transport.open_channel(agent.address) as channel:
        call = agent_grpc.AgentServiceStub(channel).RunMany(timeout=30)
        await call.write(agent_pb.RunManyRequest(runs=[_item(1, "1", expected_answer=1)]))
        await eventually(lambda: model.active == 1, "run 1 at the model")
        stopping = asyncio.ensure_future(agent.stop_serving(grace=30))
        await eventually(agent.app.stopping.is_set, "the agent stopping")
        await call.write(agent_pb.RunManyRequest(runs=[_item(2, "2")]))
        results = {result.id: result for result in (await call.read()).results}  # run 1 waits on the gate
        model.gate.set()
        results |= await _results(call)
        assert await call.code() == grpc.StatusCode.OK
        await stopping
    assert results[1].rollout.reward == 1.0
    refused = rpc_status.from_call(_run_many_client.run_error_as_call(results[2].error))
    assert results[2].error.code == grpc.StatusCode.UNAVAILABLE.value[0]
    assert errors.reason_of(_run_many_client.run_error_as_call(results[2].error)) == errors.Reason.SERVER_STOPPING
    assert refused.message == "agent 'agent' is stopping: the run was not started"
    assert len(model.requests) == 1  # run 2 never reached the model


async def test_agent_client_spreads_runs_over_replicas_and_moves_off_one_that_stops():
    """Two agent replicas behind one balanced channel (as `gym-grpc run --ray` lists them): the
    RunMany calls go to both. When one stops gracefully with runs in flight, those finish there,
    the runs sent to it meanwhile are refused unstarted and go to the other, as do the runs sent
    after; none fails."""
    async with Servers() as servers:
        model = await servers.start(EchoModel(delay=0.3))
        env = await servers.start(Calculator(name="calc"))
        peers = static_registry(model=model, calc=env)
        apps = [
            SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="agent", registry=peers)
            for _ in range(2)
        ]
        replicas, registry = await replicated(servers, "agent", apps)
        client = AgentClient(registry, "agent")

        def runs(count: int) -> list[asyncio.Future]:
            return [
                asyncio.ensure_future(client.run(task(str(i), expected_answer=i), timeout=30)) for i in range(count)
            ]

        try:
            first = await asyncio.gather(*runs(40))
            spread = [_counted(replica, "Run") for replica in replicas]
            assert sum(spread) == 40 and min(spread) >= 10, spread
            before = runs(40)
            await eventually(lambda: _in_flight(replicas[0], "Run") > 0, "runs on the first replica")
            stopping = asyncio.ensure_future(replicas[0].stop_serving(grace=30))
            await eventually(replicas[0].app.stopping.is_set, "the first replica stopping")
            during = runs(40)  # half of them go to the calls on the replica that is stopping
            await stopping  # it returns once its runs in flight are done
            stopped_with = _counted(replicas[0], "Run")
            after = runs(40)
            rollouts = [*first, *await asyncio.gather(*before, *during, *after)]
        finally:
            await registry.close()
        await peers.close()
    assert [r.reward for r in rollouts] == [1.0] * 160
    assert _counted(replicas[0], "Run") == stopped_with  # nothing reached it after it stopped
    assert _counted(replicas[1], "Run") == 160 - stopped_with


def _counted(server, method: str) -> int:
    counters = {m.method: m for m in server.app.counters.to_proto().methods}
    return sum(counters[method].calls_by_status.values()) if method in counters else 0


def _in_flight(server, method: str) -> int:
    counters = {m.method: m for m in server.app.counters.to_proto().methods}
    return counters[method].in_flight if method in counters else 0


async def _run_within(client: AgentClient, rollout_task: task_pb2.Task, slots: asyncio.Semaphore) -> None:
    async with slots:
        await client.run(rollout_task, timeout=120)


@pytest.mark.slow
async def test_runs_fill_one_worker_process_of_an_agent_while_it_has_room_and_spread_once_it_is_busy(monkeypatch):
    """An agent with `num_workers: 2` behind one port, the client's connections spread over both
    by the kernel: one RunMany call reaches each worker (asked with GetServerInfo which worker a
    connection reaches). While the first worker has room (fewer than PACK runs waiting, and its
    replies' WorkerLoad under BUSY), it runs every run and the second is not woken; with more than
    PACK in flight, or once its replies say it is busy, the second takes runs too.

    BUSY is set in this process, the client, to each end of its range, so that what is checked does
    not hang on how busy this machine makes the agent: never busy, then busy at any load reported
    (a reply without WorkerLoad would leave the second worker idle)."""
    run = start_run("servers.math_agent.num_workers=2")
    registry = Registry(run.registry)
    tasks = [task_from_row(json.loads(line)) for line in MATH.read_text().splitlines()] * 20
    runs: dict[str, list[int]] = {}
    try:
        for case, window, busy in (
            ("room", _run_many_client.PACK // 2, math.inf),
            ("past PACK", 4 * _run_many_client.PACK, math.inf),
            ("busy", _run_many_client.PACK // 2, 0.0),
        ):
            monkeypatch.setattr(_run_many_client, "BUSY", busy)
            before = await _counters_by_worker(run.servers["math_agent"], workers=2)
            client = AgentClient(registry, "math_agent")
            slots = asyncio.Semaphore(window)

            try:
                await asyncio.gather(*(_run_within(client, rollout_task, slots) for rollout_task in tasks))
            finally:
                await client.close()
            after = await _counters_by_worker(run.servers["math_agent"], workers=2)
            runs[case] = [_calls(after[w], "Run") - _calls(before[w], "Run") for w in (0, 1)]
            assert [_calls(after[w], "RunMany") - _calls(before[w], "RunMany") for w in (0, 1)] == [1, 1]
    finally:
        await registry.close()
        run.stop()
    assert runs["room"] == [len(tasks), 0], runs
    for case in ("past PACK", "busy"):
        assert sum(runs[case]) == len(tasks) and min(runs[case]) > 0, runs


async def _counters_by_worker(address: str, workers: int) -> dict[int, dict]:
    """Each worker process's counters by method, through fresh connections until every worker answered."""
    found: dict[int, dict] = {}
    for _ in range(200):
        async with transport.open_channel(address) as channel:  # a connection of its own
            stub = admin_grpc.AdminServiceStub(channel)
            info = await stub.GetServerInfo(admin_pb.GetServerInfoRequest(), timeout=10)
            counters = await stub.GetCounters(admin_pb.GetCountersRequest(), timeout=10)
        found.setdefault(info.worker, {m.method: m for m in counters.methods})
        if len(found) == workers:
            return found
    raise AssertionError(f"only workers {sorted(found)} answered")


def _calls(methods: dict, method: str) -> int:
    """Calls of `method` that ended, and those still running."""
    counted = methods.get(method)
    return 0 if counted is None else sum(counted.calls_by_status.values()) + counted.in_flight


async def test_agent_client_splits_runs_into_messages_an_agent_with_grpcs_default_limit_accepts(start, monkeypatch):
    """Thirty runs of 200 KB tasks at once, 6 MB in all, to an agent that accepts messages of up
    to 4 MiB (gRPC's default, as another implementation might keep): they go in several
    messages, and every run succeeds."""
    model = await start(EchoModel(delay=0.01))
    env = await start(Calculator(name="calc"))
    monkeypatch.setattr(transport, "MAX_MESSAGE_BYTES", 4 * 2**20)  # for the agent's server only
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=static_registry(model=model, calc=env),
        )
    )
    monkeypatch.undo()
    registry = static_registry(agent=agent)
    client = AgentClient(registry, "agent")
    padding = "x" * 200_000
    rollouts = await asyncio.gather(
        *(client.run(task(f"{i} {padding}", expected_answer=i), timeout=60) for i in range(30))
    )
    assert [r.reward for r in rollouts] == [1.0] * 30
    await registry.close()


class _FourMiBAgent(SimpleAgent):
    """An agent that takes messages of up to 4 MiB (gRPC's default, as another implementation
    might keep) and says so in its handshake."""

    def capabilities(self) -> admin_pb.Capabilities:
        capabilities = super().capabilities()
        capabilities.max_receive_message_bytes = 4 * 2**20
        return capabilities


async def test_a_run_larger_than_the_agent_takes_fails_alone_and_is_never_sent(start, monkeypatch):
    """A 5 MB run among ten small ones on the same RunMany call: it fails with INVALID_ARGUMENT
    naming the task and the agent's limit, before it is sent (sent, it would end the call and
    every run on it), and the ten succeed."""
    model = await start(EchoModel(delay=0.2))
    env = await start(Calculator(name="calc"))
    monkeypatch.setattr(transport, "MAX_MESSAGE_BYTES", 4 * 2**20)  # for the agent's server only
    agent = await start(
        _FourMiBAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=static_registry(model=model, calc=env),
        )
    )
    monkeypatch.undo()
    registry = static_registry(agent=agent)
    client = AgentClient(registry, "agent")
    small = [client.run(task(f"{i}", expected_answer=i), timeout=60) for i in range(10)]
    large = client.run(task("x" * 5_000_000, expected_answer=0), timeout=60)
    *rollouts, failed = await asyncio.gather(*small, large, return_exceptions=True)
    assert [r.reward for r in rollouts] == [1.0] * 10
    assert isinstance(failed, errors.InvalidArgument) and failed.field == "task"
    assert "over the 4,194,304 bytes a message to it may have" in failed.message
    await registry.close()
