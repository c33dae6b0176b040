"""The agent role: a server that runs rollouts, whole (Run) or step by step (RunStream)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc

from gym_grpc import errors
from gym_grpc.data import jsonl, record, rows
from gym_grpc.server import validation
from gym_grpc.server.serving import GymServer, rpc_method
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2


class RolloutEvents:
    """Where an agent reports the steps of a rollout. For Run nobody listens
    and reporting costs nothing; for RunStream each step becomes an event."""

    def __init__(self, queue: asyncio.Queue[agent_pb.RunStreamResponse | None] | None = None) -> None:
        self._queue = queue
        self._started = time.monotonic()
        self._sequence = 0

    def _put(self, event: agent_pb.RunStreamResponse) -> None:
        assert self._queue is not None
        event.sequence = self._sequence
        event.elapsed_seconds = time.monotonic() - self._started
        self._sequence += 1
        self._queue.put_nowait(event)

    def model_call(self, step: int, response: r.Response, seconds: float) -> None:
        if self._queue is not None:
            event = agent_pb.ModelCallEvent(step=step, response=response, seconds=seconds)
            self._put(agent_pb.RunStreamResponse(model_call=event))

    def tool_call(
        self, step: int, call: r.FunctionCall, output: r.FunctionCallOutput, error: bool, seconds: float
    ) -> None:
        if self._queue is not None:
            event = agent_pb.ToolCallEvent(step=step, call=call, output=output, error=error, seconds=seconds)
            self._put(agent_pb.RunStreamResponse(tool_call=event))

    def verification(
        self, reward: float, fields_json: str, seconds: float, components: Mapping[str, float] | None = None
    ) -> None:
        if self._queue is not None:
            event = agent_pb.VerificationEvent(
                reward=reward, fields_json=fields_json, seconds=seconds, reward_components=components or {}
            )
            self._put(agent_pb.RunStreamResponse(verification=event))


class AgentServer(GymServer):
    """Base of an agent. Implement run; reach other servers through self.registry."""

    role = reg.SERVER_ROLE_AGENT

    async def run(self, task: task_pb2.Task, events: RolloutEvents, *, verify: bool = True) -> task_pb2.Rollout:
        """Roll the task out to the end, reporting steps to `events`, and return it
        verified; without `verify`, unverified (reward 0, verification_skipped)."""
        raise NotImplementedError(f"{type(self).__name__} must implement run")

    def add_services(self, server: grpc.aio.Server) -> list[str]:
        agent_grpc.add_AgentServiceServicer_to_server(_AgentServicer(self), server)
        return [agent_pb.DESCRIPTOR.services_by_name["AgentService"].full_name]


class _AgentServicer(agent_grpc.AgentServiceServicer):
    def __init__(self, app: AgentServer) -> None:
        self.app = app

    async def _roll_out(
        self, request: agent_pb.RunRequest | agent_pb.RunStreamRequest, events: RolloutEvents
    ) -> task_pb2.Rollout:
        validation.check_task(request.task, "task")
        rollout = await self.app.run(request.task, events, verify=not request.skip_verification)
        self.app.counters.rollout(rollout.timings)
        return rollout

    @rpc_method
    async def Run(self, request: agent_pb.RunRequest, context: Any) -> agent_pb.RunResponse:
        return agent_pb.RunResponse(rollout=await self._roll_out(request, RolloutEvents()))

    @rpc_method
    async def RunJson(self, request: agent_pb.RunJsonRequest, context: Any) -> agent_pb.RunJsonResponse:
        try:
            row = jsonl.parse_line(request.row_json.encode())
        except ValueError as e:
            raise errors.InvalidArgument(f"row_json: {e}", field="row_json") from None
        task = rows.task_from_row(row)  # a RowError is an INVALID_ARGUMENT naming the row's field
        run = agent_pb.RunRequest(task=task, skip_verification=request.skip_verification)
        rollout = await self._roll_out(run, RolloutEvents())
        return agent_pb.RunJsonResponse(rollout_json=rows.dumps(record.build(row, rollout)))

    @rpc_method
    async def RunStream(
        self, request: agent_pb.RunStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb.RunStreamResponse]:
        queue: asyncio.Queue[agent_pb.RunStreamResponse | None] = asyncio.Queue()
        events = RolloutEvents(queue)
        # The rollout runs as its own task so that events stream while it runs. It
        # never sees the call's context: when the call ends early (cancel, deadline,
        # a client that died) the task is cancelled and awaited here, before grpc
        # releases the call.
        rollout = asyncio.ensure_future(self._roll_out(request, events))
        rollout.add_done_callback(lambda _: queue.put_nowait(None))  # after every event it reported
        try:
            while (event := await queue.get()) is not None:
                yield event
            events._put(agent_pb.RunStreamResponse(rollout=rollout.result()))  # result() re-raises its error
            last = queue.get_nowait()
            assert last is not None  # the rollout event just put
            yield last
        finally:
            rollout.cancel()
            await asyncio.wait([rollout])
            if not rollout.cancelled():
                rollout.exception()  # retrieved: a failure the client never saw is not logged as lost
