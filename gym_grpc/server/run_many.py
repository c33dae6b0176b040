"""The server side of AgentService.RunMany: many runs over one call.

Each run goes through the agent's own Run handler as a call of its own would
(`in_process.invoke`: its deadline, its counters and log line, its status and
error details), so that a result is exactly what Run would have answered.
Results go back as they come: the results that are ready by the time the
previous message has gone out go together in the next one (rpc/outbox.py).

Every run read gets a result. So when the agent stops (gracefully: a scale-down,
the end of `gym-grpc run`), it answers each run it reads from then on with
UNAVAILABLE and reason SERVER_STOPPING, without starting it, finishes the runs
in flight and then ends the call OK: a run the client sent that has no result
then was never read, and can be sent again, as the one refused can, to another
replica (client/run_many.py does).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc
from grpc_status import rpc_status

from gym_grpc import errors
from gym_grpc.rpc import in_process
from gym_grpc.rpc.outbox import Outbox
from gym_grpc.v1 import agent_service_pb2 as agent_pb

if TYPE_CHECKING:
    from gym_grpc.server.serving import GymServer

#: The agent's Run handler: (request, context) -> reply.
Run = Callable[[agent_pb.RunRequest, Any], Coroutine[Any, Any, agent_pb.RunResponse]]


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
        self._cancelled: set[int] = set()
        self.replies: Outbox[agent_pb.RunManyResponse] = Outbox(agent_pb.RunManyResponse)
        self.changed = asyncio.Event()

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
        self.in_flight[item.id] = asyncio.ensure_future(self._one(item))

    def cancel(self, run_id: int) -> None:
        task = self.in_flight.get(run_id)
        if task is not None:
            self._cancelled.add(run_id)
            task.cancel()

    async def _one(self, item: agent_pb.RunManyItem) -> None:
        try:
            reply = await in_process.invoke(self._run, item.run, item.timeout_seconds or None, self._peer)
        except grpc.aio.AioRpcError as e:
            self._result(item.id).error.CopyFrom(_from_call(e))
        except asyncio.CancelledError:
            if item.id not in self._cancelled:
                raise  # the call is ending: nobody is left to tell
            self._cancelled.discard(item.id)
            self._result(item.id).error.CopyFrom(_from_status(errors.Cancelled("the run was cancelled by its caller")))
        else:
            self._result(item.id, reply.rollout.ByteSize()).rollout.CopyFrom(reply.rollout)
        finally:
            del self.in_flight[item.id]

    def _result(self, run_id: int, size: int = 0) -> agent_pb.RunManyResult:
        """A new result, of about `size` bytes, in the reply that is filling."""
        self.changed.set()
        return self.replies.filling(size).results.add(id=run_id)

    def cancel_all(self) -> None:
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
                for item in request.runs:
                    runs.start(item)
                for run_id in request.cancel_ids:
                    runs.cancel(run_id)
        finally:
            runs.changed.set()

    reader = asyncio.ensure_future(read())
    stopping = asyncio.ensure_future(agent.stopping.wait())
    stopping.add_done_callback(lambda _: runs.changed.set())
    try:
        while True:
            if runs.replies:
                yield runs.replies.take()
                continue
            if reader.done():
                reader.result()  # a request that could not be read ends the call with its error
            if (reader.done() or stopping.done()) and not runs.in_flight:
                return
            runs.changed.clear()
            await runs.changed.wait()
    finally:
        reader.cancel()
        stopping.cancel()
        runs.cancel_all()
        if runs.in_flight:
            await asyncio.wait(runs.in_flight.values())
