"""The agent role: a server that runs rollouts, whole (Run) or step by step (RunStream).

`AgentServer` is the base: implement `run`. `ToolLoopAgent` is the usual
agent, ready to serve or to extend: call the model, run the tools it called,
feed the outputs back, until it answers; then verify. A custom agent
subclasses it and overrides a hook (`first_request`, `call_model`,
`call_tool`) instead of writing the loop again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar

import grpc
from pydantic import Field

from gym_grpc import errors, policy_version
from gym_grpc.client import stubs
from gym_grpc.client.stubs import ModelClient, ResourcesClient, ToolResult
from gym_grpc.data import jsonl, record, rows
from gym_grpc.responses import function_calls, input_items, new_id, tool_error_output
from gym_grpc.server import run_many, validation
from gym_grpc.server.serving import GymServer, ServerConfig, rpc_method
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

log = logging.getLogger("gym_grpc.agent")

#: Seconds a session close may take; it runs whatever ended the rollout, past its deadline too.
CLOSE_TIMEOUT = 5.0


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


class AgentConfig(ServerConfig):
    """Settings every agent has; an agent's own Config extends it."""

    run_many_max_runs: int = Field(
        run_many.MAX_RUNS,
        ge=1,
        description="runs one RunMany call may hold (in flight, or with a result not sent yet) before the "
        "agent stops reading it until some go out (flow control for a client that does not read)",
    )


class AgentServer(GymServer):
    """Base of an agent. Implement run; reach other servers through self.registry."""

    role = reg.SERVER_ROLE_AGENT
    Config: ClassVar[type[ServerConfig]] = AgentConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._closing: set[asyncio.Task[None]] = set()

    async def run(self, task: task_pb2.Task, events: RolloutEvents, *, verify: bool = True) -> task_pb2.Rollout:
        """Roll the task out to the end, reporting steps to `events`, and return it
        verified; without `verify`, unverified (reward 0, verification_skipped)."""
        raise NotImplementedError(f"{type(self).__name__} must implement run")

    async def close_session(self, resources: ResourcesClient, session_id: str) -> None:
        """Close a rollout's session on `resources`, whatever ended the rollout.

        The close runs in a task of its own, within CLOSE_TIMEOUT and not the rollout's deadline,
        and a cancellation of the caller does not cut it off: a rollout past its deadline is
        cancelled as the close starts, and over RunMany both the run's deadline and the client's
        cancel of it reach the rollout (two cancellations), which a plain `await` in a `finally`
        would not survive. The caller waits for the close unless it is cancelled while it does. A
        session that cannot be closed is logged and counted (GetCounters.sessions_not_closed); the
        environment closes it at its idle time-out."""
        closing = asyncio.ensure_future(self._close(resources, session_id))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        await asyncio.shield(closing)

    async def _close(self, resources: ResourcesClient, session_id: str) -> None:
        try:
            await resources.close_session(session_id, timeout=CLOSE_TIMEOUT)
        except errors.GymError as e:
            self.counters.sessions_not_closed += 1
            log.warning("%s: could not close session %s: %s", self.name, session_id, e.message)

    async def stop(self) -> None:
        if self._closing:  # the sessions of the last rollouts, closing; each within CLOSE_TIMEOUT
            await asyncio.wait(self._closing)
        await super().stop()

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
        asked = request.policy_version if request.HasField("policy_version") else None
        token = policy_version.requested.set(asked)  # every model call of the rollout carries it
        try:
            rollout = await self.app.run(request.task, events, verify=not request.skip_verification)
        finally:
            policy_version.requested.reset(token)
        if asked is not None:
            rollout.policy_version = asked
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
        run = agent_pb.RunRequest(
            task=task,
            skip_verification=request.skip_verification,
            policy_version=request.policy_version if request.HasField("policy_version") else None,
        )
        rollout = await self._roll_out(run, RolloutEvents())
        return agent_pb.RunJsonResponse(rollout_json=rows.dumps(record.build(row, rollout)))

    @rpc_method
    async def RunMany(
        self, requests: AsyncIterator[agent_pb.RunManyRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[agent_pb.RunManyResponse]:
        async for reply in run_many.serve(requests, self.Run, context.peer(), self.app):
            yield reply

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


class ToolLoopConfig(AgentConfig):
    model_server: str = Field(description="name of the model server to call")
    resources_server: str = Field(description="name of the resources server (environment)")
    max_steps: int = Field(10, ge=1, description="most model calls in one rollout")
    model_call_timeout_seconds: float | None = Field(
        None,
        gt=0,
        description="most seconds one model call may take; null: what is left of the rollout's deadline "
        f"({stubs.DEFAULT_TIMEOUT:g} s when the rollout has none)",
    )


def _add_usage(total: r.Usage, usage: r.Usage) -> None:
    total.input_tokens += usage.input_tokens
    total.output_tokens += usage.output_tokens
    total.total_tokens += usage.total_tokens
    total.input_tokens_details.cached_tokens += usage.input_tokens_details.cached_tokens
    total.input_tokens_details.cache_write_tokens += usage.input_tokens_details.cache_write_tokens
    total.output_tokens_details.reasoning_tokens += usage.output_tokens_details.reasoning_tokens


class ToolLoopAgent(AgentServer):
    """The multi-turn tool loop.

    Call the model; run every function call it made against the resources
    server, in order, and feed the outputs back; repeat until the model answers
    without calling a tool, its output is cut short, or `max_steps` model calls
    were made. Then verify and close the session. (A stateless environment, as
    DescribeTools says, gets no SeedSession and CloseSession.) A tool's failure
    (unknown tool, arguments that are not JSON, an exception in the tool) goes
    back to the model as the tool's output; only a failing server fails the rollout.

    Hooks to override: `first_request` (edit the first model request),
    `call_model` (one model call) and `call_tool` (one tool call).
    """

    Config = ToolLoopConfig
    config: ToolLoopConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model = ModelClient(
            self.registry, self.config.model_server, timeout=self.config.model_call_timeout_seconds
        )
        self.resources = ResourcesClient(self.registry, self.config.resources_server)
        self._stateless: bool | None = None
        self._describing = asyncio.Lock()

    def references(self) -> dict[str, str]:
        return {"model": self.config.model_server, "resources": self.config.resources_server}

    # --- hooks ----------------------------------------------------------------------

    def first_request(self, request: model_pb.CreateResponseRequest, task: task_pb2.Task) -> None:
        """Hook: edit the first model request in place (a system message, sampling settings).
        `request.params.input_items.items` is the conversation; later turns append to it."""

    async def call_model(self, request: model_pb.CreateResponseRequest, step: int) -> r.Response:
        """Hook: one model call, step 0, 1, ... up to max_steps - 1."""
        return await self.model.send(request)

    async def call_tool(self, session_id: str, call: r.FunctionCall, step: int) -> ToolResult:
        """Hook: one tool call; an error ToolResult goes back to the model as the tool's output."""
        return await self.resources.call_tool(session_id, call)

    # --- the loop -------------------------------------------------------------------

    async def _environment_is_stateless(self) -> bool:
        """Asked once: a stateless environment needs no SeedSession and CloseSession."""
        if self._stateless is None:
            async with self._describing:
                if self._stateless is None:
                    self._stateless = (await self.resources.describe_tools()).stateless
        return self._stateless

    async def run(self, task: task_pb2.Task, events: RolloutEvents, *, verify: bool = True) -> task_pb2.Rollout:
        started = time.monotonic()
        session_id = uuid.uuid4().hex
        stateful = not await self._environment_is_stateless()
        try:
            if stateful:  # a seed cut off by the deadline may still have opened it: closed below either way
                await self.resources.seed_session(session_id, task)
            rollout = await self._rollout(session_id, task, events, verify)
        finally:
            if stateful:
                await self.close_session(self.resources, session_id)
        rollout.timings.total_seconds = time.monotonic() - started
        return rollout

    async def _rollout(
        self, session_id: str, task: task_pb2.Task, events: RolloutEvents, verify: bool
    ) -> task_pb2.Rollout:
        # Built in place: the request is sent every turn and grows, and copying it,
        # the final response or the timings again would cost per turn and per rollout.
        request = model_pb.CreateResponseRequest(session_id=session_id)
        params = request.params
        params.CopyFrom(task.responses_create_params)
        if params.WhichOneof("input") == "input_text":
            params.input_items.items.extend(input_items(params))  # replaces the text
        self.first_request(request, task)
        conversation = params.input_items.items
        rollout = task_pb2.Rollout(stop_reason=task_pb2.STOP_REASON_MAX_STEPS)
        final, timings = rollout.response, rollout.timings
        final.status = r.RESPONSE_STATUS_COMPLETED
        step = 0
        for step in range(self.config.max_steps):
            began = time.monotonic()
            response = await self.call_model(request, step)
            seconds = time.monotonic() - began
            timings.model_seconds += seconds
            events.model_call(step, response, seconds)
            if step == 0:
                final.CopyFrom(response)  # the model's envelope: id, echoed parameters, keys we do not model
            else:
                final.model, final.status = response.model, response.status
                _add_usage(final.usage, response.usage)
                final.output.extend(response.output)
            conversation.extend(response.output)
            if response.status == r.RESPONSE_STATUS_INCOMPLETE:
                final.incomplete_details.CopyFrom(response.incomplete_details)
                rollout.stop_reason = task_pb2.STOP_REASON_INCOMPLETE
                break
            calls = function_calls(response)
            if not calls:
                rollout.stop_reason = task_pb2.STOP_REASON_FINAL_MESSAGE
                break
            for call in calls:
                began = time.monotonic()
                result = await self.call_tool(session_id, call, step)
                seconds = time.monotonic() - began
                timings.tools_seconds += seconds
                output = tool_call_output(call, result)
                events.tool_call(step, call, output, result.error, seconds)
                item = r.Item(function_call_output=output)
                final.output.append(item)
                conversation.append(item)
        rollout.model_calls = step + 1
        return await self.verified(session_id, task, rollout, events, verify)

    async def verified(
        self, session_id: str, task: task_pb2.Task, rollout: task_pb2.Rollout, events: RolloutEvents, verify: bool
    ) -> task_pb2.Rollout:
        """The rollout with its verdict from the resources server, or marked unverified without `verify`."""
        if not verify:
            rollout.verification_skipped = True
            return rollout
        began = time.monotonic()
        verdict = await self.resources.verify(session_id, task, rollout.response)
        rollout.timings.verify_seconds = time.monotonic() - began
        fields_json = rows.json_text(verdict, "fields")  # passed on as text, never parsed here
        events.verification(verdict.reward, fields_json, rollout.timings.verify_seconds, verdict.reward_components)
        rollout.reward = verdict.reward
        rollout.verifier_fields_json = fields_json
        rollout.reward_components.update(verdict.reward_components)
        return rollout


def tool_call_output(call: r.FunctionCall, result: ToolResult) -> r.FunctionCallOutput:
    """The output item that answers `call` with `result`, as the model sees it (an error marked)."""
    return r.FunctionCallOutput(
        id=new_id("fco"),
        call_id=call.call_id,
        output=tool_error_output(result.output) if result.error else result.output,
        status=r.ITEM_STATUS_COMPLETED,
    )
