"""The client side of AgentService.RunMany: many rollouts over a few long calls.

`AgentClient.run` sends its rollouts here when the agent serves RunMany: a
few long RunMany calls (one on each worker process of the agent, or on each
replica), each run a message on one of them. A grpc.aio server takes up new
calls one at a time, several turns of its event loop each, and with many
rollouts in flight that is what they wait for; a message on a call that is
open already costs a fraction of it (docs/performance.md).

What a caller gets is what a unary Run gives: the rollout, or the error its
call would have ended with (code, message, reason, field); a deadline per run,
sent with it and kept here too; a cancelled caller cancels its run on the
server. A call that breaks (the agent died, its connection given up) fails the
runs it carried as it would have failed their unary calls, and the next run
opens another call, which waits for the agent like any call to a server that
answered before. An agent that stops gracefully starts none of the runs it
reads from then on (SERVER_STOPPING) and ends the call once its runs in flight
are done: the runs it did not start go out again on another call, which
reaches another replica where there is one, as a new unary call would.

Where a run goes. Between replicas (and processes that do not say which
worker they are), to the one with the fewest runs waiting, so that every
replica carries as many, and the runs that replace a reply's results go out
together. Between the worker processes behind one address (a group run by a
worker per core), the workers are filled in turn: a run goes to the first
worker with room, one that has fewer than PACK runs waiting and whose last
reply said it was not busy (WorkerLoad: under BUSY of a core, and under BUSY
of its CPU pools' capacity); when no worker has room, to the one with the
fewest. A light load then wakes one process, not every worker for its share
of each burst of messages, which costs as much per wake-up for a fraction of
the work; a worker whose core or whose checks are busy is given no more than
its share (docs/running.md#layout-grouped-or-per_server).

Durable runs (an agent that resumes rollouts, Capabilities.resumable_rollouts):
each run carries a rollout id and is sent `durable`, and the client keeps the
state its checkpoints describe. When the run fails because something it needs
went away (UNAVAILABLE: the agent replica, its model server or engine, the call
itself), it is sent again with that state to resume from (RunRequest.resume),
on the next call (another replica where there is one), up to `resume_attempts`
times within its deadline: only the turn in flight is generated again, and the
tool calls already made are answered from the environment's records. A turn
whose tool calls the agent makes next is acknowledged once read (RunManyRequest.checkpoints_read),
and the agent makes them only then: an agent lost before the turn arrived made none of them. Each
durable run's result is acknowledged once read (RunManyRequest.received_ids),
and returned once that is written: ahead of any run sent after it, and before
the client closes its side of the call. The agent keeps the run's session open
until then, for the resume of a result written but lost with its agent or its
connection. A caller that keeps its runs' progress (Progress) acknowledges a
rollout itself, once it has kept it: a caller that stops between the two
resumes the run in its session. Written is what grpc.aio says: framed for the
connection's next write, not on the socket yet, so a process that exits at once
could take the acknowledgement with it. Hence the acknowledgements sent as a
call falls idle (no other run of it waits) ask the agent to confirm them (confirm_received,
protocol 1.18), and their runs return once it has: a caller that exits right
after its last rollouts has told the agent. Runs that return while others are
in flight on the call do not wait for that; a process that exits then loses
those runs anyway.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Protocol

import grpc

from gym_grpc import errors, images, tracing
from gym_grpc.data import rollout_state
from gym_grpc.rpc import transport
from gym_grpc.rpc.in_process import status_error
from gym_grpc.rpc.outbox import Outbox
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import task_pb2

METHOD = "RunMany"

#: Runs waiting on one worker process of a replica past which the next worker behind its address is
#: given runs, however idle the first says it is (see the module's docstring); the only bound for an
#: agent older than protocol 1.15, which does not say.
PACK = 64

#: A worker whose last reply said it used this share of a core or more, or of its CPU pools' capacity
#: (WorkerLoad), is busy: it gets no more than its share of runs (see the module's docstring).
BUSY = 0.5

#: Seconds a connection has to say which worker process it reaches.
PROBE_SECONDS = 5.0

#: How many times a run the agent did not start (it was stopping) is sent again, on another call.
RESENDS = 3

#: Seconds a closing client waits for the agent to end a RunMany call it gave up (see _Call.end).
END_SECONDS = 2.0

#: Seconds a run that has its rollout waits, at most, for its acknowledgement to be written or confirmed
#: (_Call.acknowledged): an agent that never answers (a replica older than 1.18 behind the same name,
#: or one whose process hangs, its flow control holding the write) delays the rollout by this much, and
#: the session then stays to its idle time-out.
ACKNOWLEDGED_SECONDS = 2.0

#: How many times a durable run lost to a server or engine that went away is resumed, unless told.
RESUME_ATTEMPTS = 7

#: Seconds before the n-th resume of a run (from 1): RESUME_BACKOFF * 2**(n-1), at most RESUME_BACKOFF_MAX.
#: Short: what failed is retried by the servers themselves (an engine's requests retry for seconds).
RESUME_BACKOFF = 0.25
RESUME_BACKOFF_MAX = 4.0


class Progress(Protocol):
    """What a durable run's caller keeps of it as it goes, outside this process (a file: see
    batch/states.py), so that a caller that dies can resume it. `flush` is called before the client
    tells the agent it read a checkpoint that asked (`acknowledge`: a turn whose tool calls come
    next), so that the turn is kept before they may run."""

    def attempt(self, rollout_id: str, base: task_pb2.RolloutState) -> None:
        """An attempt of the run `rollout_id` is sent, to go on from `base` (empty: from the prompt)."""

    def checkpoint(self, data: bytes) -> None:
        """A checkpoint of the attempt came (a RunCheckpoint, serialized)."""

    @property
    def flush(self) -> Callable[[], None]:
        """Keep what was given so far. Called once for each distinct (equal) callable among the runs
        of a reply that asked: runs whose progress goes to one place share it."""

    def result(self, acknowledge: Callable[[], None]) -> None:
        """The attempt's rollout came. The agent keeps the run's session until `acknowledge` is called
        (then it closes it): call it once the rollout is kept where a caller that stops finds it (the
        collector: its row written), so that a caller stopped before resumes the run in its session.
        Never called (the caller stopped first), it leaves the session to that resume, or to the
        environment's idle time-out."""


class _NotStarted(Exception):
    """The agent did not start the run: it was stopping. It can go to another call."""


class _Parked(Exception):
    """The agent parked the run, as asked: its state."""

    def __init__(self, state: task_pb2.RolloutState) -> None:
        super().__init__("parked")
        self.state = state


def _lost(error: Exception) -> bool:
    """Whether a run failed because something it needed went away (UNAVAILABLE): worth resuming."""
    if isinstance(error, grpc.aio.AioRpcError):
        return error.code() == grpc.StatusCode.UNAVAILABLE
    return isinstance(error, errors.GymError) and error.code == grpc.StatusCode.UNAVAILABLE


#: What grpc.aio makes a call's status when one of its operations fails in gRPC's core (a write on a
#: connection that was reset under it), in place of the status the call ended with.
_CORE_FAILED = "Internal error from Core"


def _as_lost(error: grpc.aio.AioRpcError) -> grpc.aio.AioRpcError:
    """A RunMany call's failure, as the lost call it is when grpc.aio made it INTERNAL for a failed write.

    When the agent dies or its connection is reset while a message is written on the call, grpc.aio
    fails the write and ends the call INTERNAL "Internal error from Core", hiding the status it
    ended with (UNAVAILABLE: 5 of 20 bidirectional calls whose server was SIGKILLed mid-write, in a
    throwaway loop). The call was lost, not refused: its runs are resumed as after UNAVAILABLE. An
    agent's own INTERNAL carries other details (and ours, an ErrorInfo)."""
    if error.code() != grpc.StatusCode.INTERNAL or error.details() != _CORE_FAILED:
        return error
    return status_error(
        grpc.StatusCode.UNAVAILABLE,
        f"the call broke as a message was written on it (grpc.aio: {_CORE_FAILED}: {error.debug_error_string()})",
    )


def _status_text(error: Exception) -> str:
    """A failure as an attempt's `ended` says it: "CODE: message"."""
    if isinstance(error, grpc.aio.AioRpcError):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, errors.GymError):
        return f"{error.code.name}: {error.message}"
    return str(error)


#: (a failed call's error, or None when its connection gave up on the peer; the method; the
#: connection) -> the GymError a caller gets: `AgentClient._error`.
ErrorOf = Callable[[grpc.aio.AioRpcError | None, str, transport.Connection], Awaitable[errors.GymError]]


def run_error_as_call(error: agent_pb.RunError) -> grpc.aio.AioRpcError:
    """A run's failure as the error its unary Run call would have raised, details included
    (RunError's bytes are a google.rpc.Status's)."""
    code = next((c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN)
    return status_error(code, error.message, (("grpc-status-details-bin", error.SerializeToString()),))


class _Call:
    """One RunMany call on one connection: the runs on it that wait for a result, and the
    runs and cancellations not sent yet (in its outbox)."""

    def __init__(self, connection: transport.Connection, error_of: ErrorOf, confirms: bool = False) -> None:
        self.connection = connection
        self._error_of = error_of
        #: The agent answers RunManyRequest.confirm_received (protocol 1.18).
        self._confirms = confirms
        self._ids = itertools.count()
        self.waiting: dict[int, asyncio.Future[task_pb2.Rollout]] = {}
        #: Each durable run on it: the state it began from and the checkpoints it sent since,
        #: serialized (compact; a checkpoint kept as a message would keep its whole reply).
        self.progress: dict[int, tuple[task_pb2.RolloutState, list[bytes]]] = {}
        #: The durable runs whose caller keeps their progress too (RunMany.run's `progress`).
        self._observers: dict[int, Progress] = {}
        #: Durable runs whose result has not come yet: it is acknowledged once read, whether or not
        #: its caller still waits for it (the agent keeps its session open until then).
        self._unread: set[int] = set()
        #: Durable runs whose rollout came to a caller that keeps it (Progress.result): acknowledged
        #: once that caller says it kept it.
        self._held: set[int] = set()
        #: Acknowledgements not written yet, or not confirmed yet, by run id: each future is done once
        #: its message is written, or confirmed read when it asked (confirm_received).
        self._acknowledging: dict[int, asyncio.Future[None]] = {}
        #: Messages sent with confirm_received: (their number from 1, their received_ids), oldest first.
        self._confirming: collections.deque[tuple[int, list[int]]] = collections.deque()
        self._confirms_asked = 0
        #: The checkpoints read on the call, all runs' (RunManyRequest.checkpoints_read).
        self._checkpoints_read = 0
        self._outbox: Outbox[agent_pb.RunManyRequest] = Outbox(agent_pb.RunManyRequest)
        self._wake = asyncio.Event()
        #: No more runs go on it: it ends once the runs on it have.
        self.closing = False
        #: Its last reply said its process is busy (WorkerLoad past BUSY): fill it no further.
        self.busy = False
        self.ended = False
        wait = connection.wait
        self._call = connection.stub(agent_grpc.AgentServiceStub).RunMany(wait_for_ready=wait)
        if wait:
            connection.waiting(self._call)  # cancelled if the peer is given up
        # Both held here: the event loop keeps only weak references to tasks.
        self._sender = asyncio.ensure_future(self._send())
        self._receiver = asyncio.ensure_future(self._receive())

    def submit(
        self, run: agent_pb.RunRequest, timeout: float | None, durable: bool = False, progress: Progress | None = None
    ) -> tuple[int, asyncio.Future[task_pb2.Rollout]]:
        run_id = next(self._ids)
        future = self.waiting[run_id] = asyncio.get_running_loop().create_future()
        item = self._outbox.filling(run.ByteSize()).runs.add(
            id=run_id,
            run=run,
            timeout_seconds=timeout or 0.0,
            durable=durable,
            acknowledge_result=durable,
            acknowledge_turns=durable,
        )
        trace = tracing.carrier()  # each run its own: the runs of a call belong to different traces
        if trace:
            item.trace_context.update(trace)
        if durable:
            self.progress[run_id] = (run.resume, [])
            self._unread.add(run_id)
            if progress is not None:
                progress.attempt(run.rollout_id, run.resume)
                self._observers[run_id] = progress
        self._wake.set()
        return run_id, future

    def state_of(self, run_id: int) -> task_pb2.RolloutState | None:
        """The state a durable run reached, from the checkpoints it sent (None: not durable)."""
        progress = self.progress.get(run_id)
        if progress is None:
            return None
        base, checkpoints = progress
        return rollout_state.build(base, map(agent_pb.RunCheckpoint.FromString, checkpoints))

    def forget(self, run_id: int) -> None:
        """Keep nothing more of a run's progress (its attempt on this call is over)."""
        self.progress.pop(run_id, None)
        self._observers.pop(run_id, None)

    def park(self, run_id: int) -> None:
        """Ask the agent to park a run at its next turn boundary (nothing when it ended)."""
        if run_id in self.waiting and not self.ended:
            self._outbox.filling().park_ids.append(run_id)
            self._wake.set()

    def cancel(self, run_id: int) -> None:
        """Stop a run on the server whose caller no longer waits for it (nothing when it ended)."""
        if self.waiting.pop(run_id, None) is not None and not self.ended:
            self._outbox.filling().cancel_ids.append(run_id)
            self._wake.set()

    def close(self) -> None:
        """Send no more runs: the call ends once the runs on it have."""
        self.closing = True
        self._wake.set()

    async def end(self) -> None:
        """End the call (runs still on it fail, cancelled) and wait for its tasks: a task left
        pending outlives its event loop and is finalised wherever the collector runs.

        Ended as a caller that gives up, not as a peer that is lost: the runs still on it and the
        cancels not sent yet go out as cancels, and the client closes its side, so that the agent
        knows each run was given up (and closes its session) rather than lost with the call (a
        durable run's session would then be kept for a resume that never comes). The call is
        cancelled once the agent ended it, or after END_SECONDS."""
        if not self.ended:
            self._outbox.filling().cancel_ids.extend(self.waiting)
            self._held.clear()  # their callers stopped before keeping them: the sessions stay for a resume
            self.close()
            await asyncio.wait([self._receiver], timeout=END_SECONDS)
        self._call.cancel()
        await asyncio.gather(self._sender, self._receiver, return_exceptions=True)

    def _acknowledge(self, reply: agent_pb.RunManyResponse) -> None:
        """Say that the results of durable runs in `reply` were read, before their callers (who may
        send the next runs at once) hear of them: the agent then closes their sessions. A rollout
        whose caller keeps it (Progress.result) is acknowledged once that caller says it kept it."""
        received = []
        for result in reply.results:
            run_id = result.id
            if run_id not in self._unread:
                continue
            self._unread.discard(run_id)
            observer = self._observers.get(run_id)
            future = self.waiting.get(run_id)
            if observer is None or future is None or future.done() or result.WhichOneof("outcome") != "rollout":
                received.append(run_id)
            else:
                self._held.add(run_id)
                observer.result(functools.partial(self._kept, run_id))
        if received:
            message = self._outbox.filling()
            message.received_ids.extend(received)
            ended = reply.results
            if self._confirms and len(self.waiting) <= len(ended) and {r.id for r in ended}.issuperset(self.waiting):
                message.confirm_received = True  # the call falls idle (see the module's docstring)
            loop = asyncio.get_running_loop()
            self._acknowledging.update((run_id, loop.create_future()) for run_id in received)
            # The bound on their runs' wait (see ACKNOWLEDGED_SECONDS): one timer a reply, not a timed wait a run.
            loop.call_later(ACKNOWLEDGED_SECONDS, self._done_acknowledging, received)
            self._wake.set()

    async def acknowledged(self, run_id: int) -> None:
        """Once the acknowledgement of run `run_id`'s result is written, or confirmed read when it
        was sent as the call fell idle (at once when it has none, or the call ended): a caller that
        exits right after its last rollout, without closing the client, has then told the agent,
        which closes the session rather than keep it until the environment's idle time-out."""
        future = self._acknowledging.get(run_id)
        if future is not None:
            await future  # done by ACKNOWLEDGED_SECONDS at the latest (see _acknowledge)

    def _kept(self, run_id: int) -> None:
        """The caller of run `run_id` kept its rollout (Progress.result): tell the agent."""
        if run_id in self._held:
            self._held.discard(run_id)
            if not self.ended:
                self._outbox.filling().received_ids.append(run_id)
                self._wake.set()

    def _done_acknowledging(self, run_ids: Iterable[int]) -> None:
        for run_id in run_ids:
            future = self._acknowledging.pop(run_id, None)
            if future is not None and not future.done():  # its caller may have given up on it
                future.set_result(None)

    async def _send(self) -> None:
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._outbox:
                    message = self._outbox.take()
                    if message.confirm_received:  # done once the agent says it read it, which may come first
                        self._confirms_asked += 1
                        self._confirming.append((self._confirms_asked, list(message.received_ids)))
                    await self._call.write(message)
                    if not message.confirm_received:
                        self._done_acknowledging(message.received_ids)
                if self.closing and not self._unread and not self._held:  # after the last acknowledgement
                    await self._call.done_writing()
                    return
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            return  # the call ended: _receive tells the runs why

    async def _receive(self) -> None:
        error: grpc.aio.AioRpcError | None = None
        try:
            async for reply in self._call:
                self.connection.answered()
                if reply.HasField("load"):
                    self.busy = reply.load.cpu >= BUSY or reply.load.checks >= BUSY
                asked = False
                flushes: set[Callable[[], None]] = set()
                for checkpoint in reply.checkpoints:
                    progress = self.progress.get(checkpoint.id)
                    if progress is not None:
                        data = checkpoint.SerializeToString()
                        progress[1].append(data)
                        observer = self._observers.get(checkpoint.id)
                        if observer is not None:
                            observer.checkpoint(data)
                            flushes.add(observer.flush)
                    asked = asked or checkpoint.acknowledge
                self._checkpoints_read += len(reply.checkpoints)
                if asked:  # a run waits to make its tool calls until the agent hears this
                    for flush in flushes:
                        flush()  # before checkpoints_read, below, can go out
                    self._outbox.filling().checkpoints_read = self._checkpoints_read
                    self._wake.set()
                while self._confirming and self._confirming[0][0] <= reply.received_confirmed:
                    self._done_acknowledging(self._confirming.popleft()[1])
                if self._unread:
                    self._acknowledge(reply)
                for result in reply.results:
                    future = self.waiting.pop(result.id, None)
                    if future is None or future.done():
                        continue  # its caller gave up on it
                    outcome = result.WhichOneof("outcome")
                    if outcome == "rollout":
                        response = result.rollout.response
                        if result.id in self.progress and images.has_references(response.output):
                            # A durable run's tool images came in its checkpoints, not again in its result.
                            images.from_checkpoints(response, self.state_of(result.id))
                        future.set_result(result.rollout)
                        continue
                    if outcome == "parked":
                        future.set_exception(_Parked(result.parked))
                        continue
                    failed = run_error_as_call(result.error)
                    if errors.reason_of(failed) == errors.Reason.SERVER_STOPPING:
                        self.close()
                        future.set_exception(_NotStarted())
                    else:
                        future.set_exception(failed)
        except grpc.aio.AioRpcError as e:
            error = _as_lost(e)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # stopped here
            # The call was cancelled under it: its connection gave up on the peer, or closed.
            error = None if self.connection.given_up else status_error(grpc.StatusCode.CANCELLED, "Locally cancelled")
        finally:
            self.ended = True
            self._sender.cancel()
            for acknowledging in self._acknowledging.values():
                if not acknowledging.done():
                    acknowledging.set_result(None)
            self._acknowledging.clear()
            self._confirming.clear()
        if not self.waiting:
            return
        if error is None and not self.connection.given_up:
            failure: Exception = _NotStarted()  # ended OK: the agent answers every run it read
        else:
            failure = await self._error_of(error, METHOD, self.connection)
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(failure)
        self.waiting.clear()


async def _process_of(connection: transport.Connection) -> tuple[str, int] | None:
    """The server process a connection reaches (its instance and worker), or None when it does not say."""
    try:
        info = await connection.stub(admin_grpc.AdminServiceStub).GetServerInfo(
            admin_pb.GetServerInfoRequest(), timeout=PROBE_SECONDS, wait_for_ready=connection.wait
        )
    except grpc.aio.AioRpcError:
        return None
    return (info.instance_id, info.worker) if info.instance_id else None


class RunMany:
    """The RunMany calls of one agent client: one on each worker process of the agent (or on
    each connection, when the agent does not say which process a connection reaches), and
    on a channel balanced over several replicas one per replica (gRPC's round_robin gives
    each new call the next replica); opened on first use, and again when one ended."""

    def __init__(
        self,
        connections: Callable[[], Awaitable[list[transport.Connection]]],
        error_of: ErrorOf,
        confirms: bool = False,
    ) -> None:
        self._connections = connections
        self._error_of = error_of
        #: The agent answers RunManyRequest.confirm_received (protocol 1.18).
        self._confirms = confirms
        self._calls: dict[tuple[transport.Connection, int], _Call] = {}
        #: The slots by replica (the workers behind one address, in order), or each slot alone.
        self._groups: list[list[tuple[transport.Connection, int]]] = []
        self._pool: list[transport.Connection] | None = None
        self._opening: asyncio.Future[None] | None = None
        self._next = 0

    async def _open(self, connections: list[transport.Connection]) -> None:
        """Take a new pool (the agent's replicas changed): where the calls go, and the calls on
        connections it no longer has end with the runs on them.

        Several worker processes behind one port (`num_workers`) each got some of the
        connections from the kernel: one call on each worker is enough, and a few full
        messages cost less than many small ones, so a connection per worker is kept (asked
        with GetServerInfo which one it reaches). On a channel balanced over replicas, gRPC
        gives each new call the next replica: a call per replica on each connection."""
        slots = [(c, i) for c in connections for i in range(c.address.count(",") + 1)]
        groups = [[slot] for slot in slots]  # each slot alone: spread, as over replicas
        if len(connections) > 1 and len(slots) == len(connections):
            reached = await asyncio.gather(*map(_process_of, connections))
            known = [process for process in reached if process is not None]
            if len(known) == len(reached):
                one_each = {process: connection for process, connection in zip(known, connections, strict=True)}
                # The workers behind one address (one port) are one replica's, to be filled in turn.
                by_address: dict[str, list[tuple[int, transport.Connection]]] = {}
                for (_, worker), connection in one_each.items():
                    by_address.setdefault(connection.address, []).append((worker, connection))
                groups = [[(connection, 0) for _, connection in sorted(workers)] for workers in by_address.values()]
                slots = [slot for group in groups for slot in group]
        self._pool, self._groups = connections, groups
        for slot in [slot for slot in self._calls if slot not in slots]:
            self._calls.pop(slot).close()

    async def _call_for_next_run(self) -> _Call:
        """The call the next run goes on (see the module's docstring): on the replica with the
        fewest runs waiting (ties go round them), the first of its workers' calls with room
        (fewer than PACK waiting, not busy), else the one with the fewest. The fewest waiting is
        where results just came back, so that the runs that replace them go out together, in one
        message."""
        connections = await self._connections()
        while connections is not self._pool:
            if self._opening is None:
                self._opening = asyncio.ensure_future(self._open(connections))
            opening = self._opening
            try:
                await asyncio.shield(opening)
            finally:
                if opening.done() and self._opening is opening:
                    self._opening = None
            connections = await self._connections()
        groups = self._groups
        self._next = (self._next + 1) % len(groups)
        best: list[_Call] = []
        fewest = 0
        for group in itertools.chain(groups[self._next :], groups[: self._next]):
            calls = [self._open_call(slot) for slot in group]
            waiting = sum(len(call.waiting) for call in calls)
            if not best or waiting < fewest:
                best, fewest = calls, waiting
        assert best  # the registry gives at least one connection
        return next((call for call in best if len(call.waiting) < PACK and not call.busy), None) or min(
            best, key=lambda call: len(call.waiting)
        )

    def _open_call(self, slot: tuple[transport.Connection, int]) -> _Call:
        """The call of `slot`, a new one when it has none open that takes runs."""
        call = self._calls.get(slot)
        if call is None or call.ended or call.closing:
            if call is not None and call.ended and not call.closing:
                self._pool = None  # a worker died: the next run asks again which connection reaches which
            call = self._calls[slot] = _Call(slot[0], self._error_of, self._confirms)
        return call

    def park(self) -> int:
        """Ask the agent to park every run in flight at its next turn boundary: each one's `run`
        raises RolloutParked with the state to resume it from. How many were asked."""
        asked = 0
        for call in self._calls.values():
            for run_id in list(call.waiting):
                call.park(run_id)
                asked += 1
        return asked

    async def close(self) -> None:
        """End every call (the client is closing)."""
        calls, self._calls, self._pool = list(self._calls.values()), {}, None
        await asyncio.gather(*(call.end() for call in calls))

    async def run(
        self,
        request: agent_pb.RunRequest,
        timeout: float | None,
        resume_attempts: int = 0,
        progress: Progress | None = None,
    ) -> task_pb2.Rollout:
        """One run: its rollout. With `resume_attempts` (the agent resumes rollouts; `request`
        has a rollout_id), the run is durable and resumed that many times at most when it is
        lost; `progress` is told each attempt and checkpoint of it. A failed run raises the
        AioRpcError its unary call would have raised; a call that broke under it, the GymError of
        that call; a run parked by `park`, RolloutParked."""
        durable = resume_attempts > 0
        started = time.monotonic()
        deadline = None if timeout is None else started + timeout
        resends = resumes = 0
        try:
            async with asyncio.timeout(timeout):
                while True:
                    call = await self._call_for_next_run()
                    left = None if deadline is None else max(deadline - time.monotonic(), 1e-3)  # 0 means none
                    # The last attempt allowed is not durable: the agent closes its session if it fails too.
                    run_id, result = call.submit(request, left, durable and resumes < resume_attempts, progress)
                    try:
                        rollout = await result
                        break
                    except _NotStarted:
                        resends += 1
                        if resends > RESENDS:
                            raise status_error(
                                grpc.StatusCode.UNAVAILABLE, f"the agent was stopping, each of {1 + RESENDS} times"
                            ) from None
                        continue
                    except _Parked as parked:
                        raise errors.RolloutParked(request.rollout_id, parked.state) from None
                    except (grpc.aio.AioRpcError, errors.GymError) as e:
                        if not durable or not _lost(e) or resumes >= resume_attempts:
                            raise
                        failure: Exception = e
                        state = call.state_of(run_id)
                    finally:
                        call.cancel(run_id)  # when still waiting: its caller gave up (cancelled, or past its deadline)
                        call.forget(run_id)
                    resumes += 1
                    await asyncio.sleep(min(RESUME_BACKOFF * 2 ** (resumes - 1), RESUME_BACKOFF_MAX))
                    _resume_from(request, state, failure, time.monotonic() - started)
        except TimeoutError:
            raise status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        await call.acknowledged(run_id)  # past the deadline's reach: the rollout is in hand
        return rollout


def _resume_from(
    request: agent_pb.RunRequest, state: task_pb2.RolloutState | None, failure: Exception, elapsed: float
) -> None:
    """Make `request` resume from `state`, what the lost attempt left (`failure` ended it); when the
    client has no checkpoint of that attempt, the request goes again as it was: the attempt made no tool
    call (it makes them once its client has their turn), and the session it may have opened, unknown
    here, is left to the environment's idle time-out."""
    before = len(request.resume.attempts)
    if state is None or len(state.attempts) <= before:
        return
    rollout_state.end_attempt(state, before, _status_text(failure))
    state.elapsed_seconds = elapsed
    request.resume.CopyFrom(state)
