"""The server side of AgentService.RunMany: many runs over one call.

Each run goes through the agent's own Run handler as a call of its own would
(`in_process.invoke`: its deadline, its counters and log line, its status and
error details), so that a result is exactly what Run would have answered.
Results go back as they come: the results that are ready by the time the
previous message has gone out go together in the next one (rpc/outbox.py).

The agent reads runs only while it can answer them: once a call has MAX_RUNS runs in flight
or waiting to be sent, or its results waiting to be sent reach MAX_UNSENT_BYTES (a client that
does not read them), it stops reading that call until they go out, and gRPC's flow control holds
the client's writes. So a client that sends 100,000 runs and reads nothing costs the agent a
bounded memory, not one that grows with what it sends.

The replies say how loaded the agent's process is (WorkerLoad: its CPU use and its CPU pools'
over the last second or more, measured as replies go out, so an idle agent spends nothing on
it), for a client that chooses between the agent's worker processes (client/run_many.py). Each
measurement goes out once on each call, in its next reply; the client keeps the last.

Every run read gets a result. So when the agent stops (gracefully: a scale-down,
the end of `gym-grpc run`), it answers each run it reads from then on with
UNAVAILABLE and reason SERVER_STOPPING, without starting it, finishes the runs
in flight and then ends the call OK: a run the client sent that has no result
then was never read, and can be sent again, as the one refused can, to another
replica (client/run_many.py does).

A durable run sent with RunManyItem.acknowledge_turns makes the tool calls of a turn only once its
client has the turn (RunLink.turn_read): the checkpoint that carries it is marked `acknowledge`, and
the client says how many checkpoints it has read (RunManyRequest.checkpoints_read). So an agent lost
before a turn reached its caller made none of that turn's tool calls, and the turn is generated again
on resume, rather than its calls made for a turn nobody has and then made again. A call the agent
has stopped reading (it holds as many runs as it may, or its client closed its side) brings no more
counts: its runs then go on without waiting, their tool calls made as without acknowledge_turns
(once the call outlived its requests by HALF_CLOSED_SECONDS, which tells a client that closed its
side from one that died).

A durable run's environment session is closed once its caller has the run's result
(RunLink.after_result): for a client that acknowledges its results (RunManyItem.acknowledge_result),
once it says it read it (RunManyRequest.received_ids); for one that does not, once the result is
written. Written is not read: the agent or its connection may be lost before the bytes arrive, and
the client then resumes the run, which is verified again in that session. A call that ends before
the client said so (it broke, or the client closed its side without saying) leaves such sessions
to the resume, or to the environment's idle time-out; a call the agent ends as it stops closes them,
its results all written before its status. A client that asks (RunManyRequest.confirm_received, as
its call falls idle) hears in the next reply that its request was read (received_confirmed), and
only then returns those results: its process may exit at once without losing the acknowledgement.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc
from grpc_status import rpc_status

from gym_grpc import errors
from gym_grpc.rpc import in_process
from gym_grpc.rpc.outbox import Outbox
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import task_pb2

if TYPE_CHECKING:
    from gym_grpc.server.serving import GymServer

#: Runs of one call in flight or with a result not sent yet, past which the agent stops reading it.
MAX_RUNS = 16_384

#: Bytes of one call's results not sent yet, past which the agent stops reading it.
MAX_UNSENT_BYTES = 64 * 2**20

#: Seconds a call must outlive the end of its requests before the runs that wait for a count from
#: its client go on without one (see `serve`): grpc.aio ends the requests of a call whose client died
#: just as it ends those of one whose client closed its side, a moment before it cancels the call.
HALF_CLOSED_SECONDS = 1.0

#: Seconds, at least, over which a reply's WorkerLoad is measured.
LOAD_SECONDS = 1.0


def _checks_busy(now: float) -> tuple[float, int]:
    """gym_grpc.cpu_pool.checks_busy, or none when no CpuPool was ever imported here: an agent that
    shares no process with an environment does not import it (a sixth of a second)."""
    pools = sys.modules.get("gym_grpc.cpu_pool")
    return pools.checks_busy(now) if pools is not None else (0.0, 0)


class _Load:
    """This process's load as the replies of all its RunMany calls tell it (WorkerLoad)."""

    def __init__(self) -> None:
        self._at = time.monotonic()
        self._cpu = time.process_time()
        self._checks = _checks_busy(self._at)[0]
        self.load = agent_pb.WorkerLoad()

    def now(self) -> agent_pb.WorkerLoad:
        """The load over the interval that ended last, measured anew once LOAD_SECONDS have passed."""
        now = time.monotonic()
        seconds = now - self._at
        if seconds >= LOAD_SECONDS:
            cpu = time.process_time()
            checks, workers = _checks_busy(now)
            # A pool closed since is no longer counted: its seconds are not, either (hence at least 0).
            busy = max(checks - self._checks, 0.0) / (seconds * workers) if workers else 0.0
            self.load = agent_pb.WorkerLoad(cpu=(cpu - self._cpu) / seconds, checks=busy)
            self._at, self._cpu, self._checks = now, cpu, checks
        return self.load


#: This process's load: its interval begins at import, the first is measured by the first reply past it.
_LOAD = _Load()


class RunLink:
    """What one run of a RunMany call shares with the agent running it: its checkpoints go out
    on the call (a durable run), a park request comes in, and the agent leaves its state here
    when it parks.

    The agent reads `park` at each turn boundary; `call_ended` tells a cancellation that
    ends the whole call (the client is gone, or its connection) from one of the run alone
    (its caller's cancel, its deadline): a durable run keeps its session after the first."""

    def __init__(self, runs: _Runs, run_id: int, durable: bool, acknowledged: bool, turns_acknowledged: bool) -> None:
        self._runs, self._id = runs, run_id
        self.durable = durable
        #: The client says when it read the run's result (RunManyItem.acknowledge_result).
        self.acknowledged = acknowledged
        #: The client says when it read a checkpoint marked `acknowledge` (RunManyItem.acknowledge_turns).
        self.turns_acknowledged = turns_acknowledged
        #: The checkpoints the call must have had read before the run goes on (see `turn_read`); 0: none.
        self._awaited = 0
        self.park = False
        self.call_ended = False
        #: What to do once the run's result has gone out (see `after_result`).
        self.after: list[Callable[[], object]] = []
        #: The state of the run, once it parked.
        self.parked: task_pb2.RolloutState | None = None

    def after_result(self, then: Callable[[], object]) -> None:
        """Call `then` once the caller has the run's result, not before: once it says so when it
        acknowledges results, else once the result has been written to the call. A durable run's
        session is closed then, so that an agent (or a connection) lost between the two leaves a
        session open, which the caller's resume of the run (the result never came) still needs."""
        self.after.append(then)

    def checkpoint(self, size: int, acknowledge: bool = False) -> agent_pb.RunCheckpoint:
        """A new checkpoint of the run (see RunCheckpoint), of about `size` bytes, to fill in at
        once: it is in the reply that goes out next (built there, not copied). With `acknowledge`
        (a turn whose tool calls come next; only for a client that acknowledges turns), `turn_read`
        then waits until the client has read it."""
        checkpoint, number = self._runs.checkpoint(self._id, size)
        if acknowledge:
            checkpoint.acknowledge = True
            self._awaited = number
        return checkpoint

    async def turn_read(self) -> None:
        """Once the client has read the last checkpoint marked `acknowledge` (at once when there is
        none, or the call no longer reads what the client says: see the module's docstring)."""
        if self._awaited:
            awaited, self._awaited = self._awaited, 0
            await self._runs.read(awaited)


#: The agent's Run handler: (request, context, link) -> reply.
Run = Callable[[agent_pb.RunRequest, Any, RunLink], Coroutine[Any, Any, agent_pb.RunResponse]]


def _from_status(error: errors.GymError) -> agent_pb.RunError:
    return agent_pb.RunError.FromString(error.status_proto().SerializeToString())


def _from_call(error: grpc.aio.AioRpcError) -> agent_pb.RunError:
    """The status a call ended with, details included (RunError has google.rpc.Status's fields)."""
    status = rpc_status.from_call(error)
    if status is not None:
        return agent_pb.RunError.FromString(status.SerializeToString())
    return agent_pb.RunError(code=error.code().value[0], message=error.details() or "")


class _Runs:
    """The runs of one RunMany call: those in flight, and the replies that hold the results not sent yet."""

    def __init__(self, run: Run, peer: str, agent: GymServer) -> None:
        self._run, self._peer, self._agent = run, peer, agent
        self.in_flight: dict[int, asyncio.Task[None]] = {}
        self.links: dict[int, RunLink] = {}
        #: What to do once each reply not sent yet has been written (RunLink.after_result), by id(reply).
        self._after: dict[int, tuple[agent_pb.RunManyResponse, list[Callable[[], object]]]] = {}
        #: What to do once the client says it read a run's result (RunLink.after_result), by run id.
        self._unread: dict[int, list[Callable[[], object]]] = {}
        self._cancelled: set[int] = set()
        self.replies: Outbox[agent_pb.RunManyResponse] = Outbox(agent_pb.RunManyResponse)
        #: Results in `replies`, not sent yet.
        self.unsent = 0
        self.changed = asyncio.Event()
        #: Set when a run ends or results go out: the reader may read more.
        self.room = asyncio.Event()
        #: The last process load a reply of this call carried (each measurement goes out once a call).
        self.load_sent: agent_pb.WorkerLoad | None = None
        #: Checkpoints put in the replies, and how many of them the client said it read.
        self._checkpoints = 0
        self._checkpoints_read = 0
        #: Runs waiting for the client to have read a checkpoint: (its number, future), soonest first. A
        #: number is one checkpoint's, awaited by its run alone, so no two are equal and futures are never compared.
        self._readers: list[tuple[int, asyncio.Future[None]]] = []
        #: The call's requests are read (see `listen`).
        self._listening = True
        #: Requests read that asked for an answer (RunManyRequest.confirm_received).
        self._confirm_asked = 0

    def full(self) -> bool:
        """Whether the call holds as many runs, or results not sent, as it may (see the module's docstring)."""
        most = getattr(self._agent.config, "run_many_max_runs", MAX_RUNS)  # an agent's config may not say
        return len(self.in_flight) + self.unsent >= most or self.replies.size >= MAX_UNSENT_BYTES

    def take(self) -> agent_pb.RunManyResponse:
        """The oldest reply, to send."""
        reply = self.replies.take()
        self.unsent -= len(reply.results)
        self.room.set()
        return reply

    def sent(self, reply: agent_pb.RunManyResponse) -> None:
        """`reply` was written: do what its runs wait for (RunLink.after_result)."""
        for then in self._after.pop(id(reply), (reply, []))[1]:
            then()

    def received(self, run_id: int) -> None:
        """The client read the result of run `run_id`: do what the run waits for (nothing when it waits
        for nothing: a run that failed, a stateless environment, an id of no run)."""
        for then in self._unread.pop(run_id, ()):
            then()

    def stopped(self) -> None:
        """The agent ends the call as it stops: every result was written before the call's status."""
        for run_id in list(self._unread):
            self.received(run_id)

    def start(self, item: agent_pb.RunManyItem) -> None:
        if self._agent.stopping.is_set():
            stopping = errors.Unavailable(
                f"agent {self._agent.name!r} is stopping: the run was not started", reason=errors.Reason.SERVER_STOPPING
            )
            self._result(item.id).error.CopyFrom(_from_status(stopping))
            return
        if item.id in self.in_flight:
            error = errors.InvalidArgument(f"runs.id: {item.id} is already in flight on this call", field="runs.id")
            self._result(item.id).error.CopyFrom(_from_status(error))
            return
        durable = item.durable
        link = RunLink(self, item.id, durable, durable and item.acknowledge_result, durable and item.acknowledge_turns)
        self.links[item.id] = link
        task = self.in_flight[item.id] = asyncio.ensure_future(self._one(item, link))
        task.add_done_callback(functools.partial(self._ended, item.id))

    def cancel(self, run_id: int) -> None:
        task = self.in_flight.get(run_id)
        if task is not None:
            self._cancelled.add(run_id)
            task.cancel()

    def park(self, run_id: int) -> None:
        link = self.links.get(run_id)
        if link is not None:
            link.park = True

    def checkpoint(self, run_id: int, size: int) -> tuple[agent_pb.RunCheckpoint, int]:
        """A new checkpoint of a run, in the reply that is filling (so before the run's result), and its
        number on the call (from 1): the replies go out in order, so the client reads them in it."""
        self.changed.set()
        self._checkpoints += 1
        return self.replies.filling(size).checkpoints.add(id=run_id), self._checkpoints

    async def read(self, number: int) -> None:
        """Once the client says it read `number` checkpoints or more, or the call is no longer read."""
        if number <= self._checkpoints_read or not self._listening:
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._readers, (number, future))
        await future

    def checkpoints_read(self, count: int) -> None:
        """The client says it read `count` checkpoints: the runs that waited for as many go on."""
        self._checkpoints_read = max(self._checkpoints_read, count)
        while self._readers and self._readers[0][0] <= self._checkpoints_read:
            future = heapq.heappop(self._readers)[1]
            if not future.done():  # its run may have been cancelled while it waited
                future.set_result(None)

    def confirm_received(self) -> None:
        """The client asked to hear that its request was read: the next reply says so."""
        self._confirm_asked += 1
        self.replies.filling().received_confirmed = self._confirm_asked
        self.changed.set()

    def listen(self, listening: bool) -> None:
        """The call's requests are read again, or no longer (it holds as many runs as it may, or the
        client closed its side): while they are not, no count can come, and the runs that wait for
        one go on (see the module's docstring)."""
        self._listening = listening
        if not listening:
            for _, future in self._readers:
                if not future.done():
                    future.set_result(None)
            self._readers.clear()

    async def _one(self, item: agent_pb.RunManyItem, link: RunLink) -> None:
        def run(request: agent_pb.RunRequest, context: Any) -> Coroutine[Any, Any, agent_pb.RunResponse]:
            return self._run(request, context, link)

        try:
            # The run's trace context as the metadata of a call of its own would carry it.
            metadata = tuple(item.trace_context.items()) if item.trace_context else ()
            reply = await in_process.invoke(run, item.run, item.timeout_seconds or None, self._peer, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            self._result(item.id).error.CopyFrom(_from_call(e))
        else:
            if link.parked is not None:
                self._result(item.id, link.parked.ByteSize()).parked.CopyFrom(link.parked)
            else:
                self._result(item.id, reply.rollout.ByteSize()).rollout.CopyFrom(reply.rollout)

    def _ended(self, run_id: int, task: asyncio.Task[None]) -> None:
        """A run's task is done: the result of a run its caller cancelled, and the run's bookkeeping.
        Here rather than in `_one`, whose body never runs when the run is cancelled before its task
        first steps (a cancel in the same request as its run): that run too gets its result."""
        by_caller = run_id in self._cancelled
        self._cancelled.discard(run_id)
        if task.cancelled() and by_caller:  # else the call is ending: nobody is left to tell
            self._result(run_id).error.CopyFrom(_from_status(errors.Cancelled("the run was cancelled by its caller")))
        del self.in_flight[run_id]
        del self.links[run_id]
        self.room.set()
        self.changed.set()  # the call may end once no run is in flight

    def _result(self, run_id: int, size: int = 0) -> agent_pb.RunManyResult:
        """A new result, of about `size` bytes, in the reply that is filling; what the run waits
        to do once it is written goes with that reply."""
        self.changed.set()
        self.unsent += 1
        reply = self.replies.filling(size)
        link = self.links.get(run_id)
        if link is not None and link.after:
            if link.acknowledged:
                self._unread[run_id] = link.after
            else:
                self._after.setdefault(id(reply), (reply, []))[1].extend(link.after)
        return reply.results.add(id=run_id)

    def cancel_all(self) -> None:
        for link in self.links.values():
            link.call_ended = True
        for task in self.in_flight.values():
            task.cancel()


async def serve(
    requests: AsyncIterator[agent_pb.RunManyRequest], run: Run, peer: str, agent: GymServer
) -> AsyncIterator[agent_pb.RunManyResponse]:
    """The replies of one RunMany call: start each run the requests bring through `run` (the
    agent's Run handler, called as from `peer`), yield the results as they come, and end once
    the client has closed its side, or the `agent` is stopping, and every run has ended.
    Ending early (the call cancelled, the client gone) cancels every run in flight."""
    runs = _Runs(run, peer, agent)

    async def read() -> None:
        try:
            async for request in requests:
                if request.checkpoints_read:
                    runs.checkpoints_read(request.checkpoints_read)
                for run_id in request.received_ids:  # before the runs: an id may be used again
                    runs.received(run_id)
                for item in request.runs:
                    runs.start(item)
                for run_id in request.cancel_ids:
                    runs.cancel(run_id)
                for run_id in request.park_ids:
                    runs.park(run_id)
                if request.confirm_received:
                    runs.confirm_received()
                if runs.full():  # read no more until runs end and their results go out
                    runs.listen(False)
                    while runs.full():
                        runs.room.clear()
                        await runs.room.wait()
                    runs.listen(True)
        finally:
            runs.changed.set()
        # The client closed its side, or died: the requests end alike, and a dead client's call is
        # cancelled a moment later, its runs with it. Released at once, a run waiting for its turn to be
        # read would make that turn's tool calls in that moment, for a turn its client never had (1 run
        # in 50 of a killed collector's test made one so). A call still alive after HALF_CLOSED_SECONDS
        # was closed: no count can come, and the runs go on.
        asyncio.get_running_loop().call_later(HALF_CLOSED_SECONDS, runs.listen, False)

    reader = asyncio.ensure_future(read())
    stopping = asyncio.ensure_future(agent.stopping.wait())
    stopping.add_done_callback(lambda _: runs.changed.set())
    try:
        while True:
            if runs.replies:
                reply = runs.take()
                load = _LOAD.now()
                if load is not runs.load_sent:  # a new measurement: the client keeps it until the next
                    reply.load.CopyFrom(load)
                    runs.load_sent = load
                yield reply
                runs.sent(reply)
                continue
            if reader.done():
                reader.result()  # a request that could not be read ends the call with its error
            if (reader.done() or stopping.done()) and not runs.in_flight:
                if not reader.done():
                    runs.stopped()
                return
            runs.changed.clear()
            await runs.changed.wait()
    finally:
        reader.cancel()
        stopping.cancel()
        runs.cancel_all()
        if runs.in_flight:
            await asyncio.wait(runs.in_flight.values())
