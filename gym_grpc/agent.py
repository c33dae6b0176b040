"""The agent role: a server that runs rollouts, whole (Run) or step by step (RunStream).

`AgentServer` is the base: implement `run`. `ToolLoopAgent` is the usual
agent, ready to serve or to extend: call the model, run the tools it called,
feed the outputs back, until it answers; then verify. A custom agent
subclasses it and overrides a hook (`first_request`, `call_model`,
`call_tool`) instead of writing the loop again.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar

import grpc
from pydantic import Field

from gym_grpc import errors, images, policy_version, tracing
from gym_grpc.client import stubs
from gym_grpc.client.stubs import ModelClient, ResourcesClient, ToolResult
from gym_grpc.data import jsonl, record, rollout_state, rows
from gym_grpc.responses import function_calls, input_items, new_id, tool_error_output
from gym_grpc.server import run_many, validation
from gym_grpc.server.serving import GymServer, ServerConfig, rpc_method
from gym_grpc.token_budget import TokenBudget
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

log = logging.getLogger("gym_grpc.agent")

#: Seconds a session close may take; it runs whatever ended the rollout, past its deadline too.
CLOSE_TIMEOUT = 5.0


class RolloutEvents:
    """Where an agent reports the steps of a rollout. For Run nobody listens
    and reporting costs nothing; for RunStream each step becomes an event. Each
    model call and tool call is a turn boundary of the attempt, too (Attempt)."""

    def __init__(
        self, queue: asyncio.Queue[agent_pb.RunStreamResponse | None] | None = None, attempt: Attempt | None = None
    ) -> None:
        self._queue = queue
        self._started = time.monotonic()
        self._sequence = 0
        #: The attempt at the rollout this run is (a first one, unless it resumes one).
        self.attempt = attempt or Attempt("")

    def _put(self, event: agent_pb.RunStreamResponse) -> None:
        assert self._queue is not None
        event.sequence = self._sequence
        event.elapsed_seconds = time.monotonic() - self._started
        self._sequence += 1
        self._queue.put_nowait(event)

    def model_call(self, step: int, response: r.Response, seconds: float) -> None:
        self.attempt.new_turn(step, response, seconds)
        if self._queue is not None:
            event = agent_pb.ModelCallEvent(step=step, response=response, seconds=seconds)
            self._put(agent_pb.RunStreamResponse(model_call=event))

    def tool_call(
        self, step: int, call: r.FunctionCall, output: r.FunctionCallOutput, error: bool, seconds: float
    ) -> None:
        self.attempt.tool_output(step, output, seconds)
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


class _Parked(Exception):
    """Raised by an agent's loop at a turn boundary when its run was asked to park."""


class Attempt:
    """One attempt at a rollout, as the agent running it sees it: the rollout's id, which
    attempt this is, the state it resumes from (`resume`, empty for a first attempt), and
    (over RunMany) the link to its caller.

    The agent reports each turn boundary here (`begin`, `new_turn`, `tool_output`). A durable
    run's checkpoint is built in the reply that carries it to the caller; the attempt keeps
    only references to what it reported (the model's responses, the tool outputs), from which
    it builds the state should the run be parked: a checkpoint kept would keep its whole reply,
    other runs' rollouts with it, in memory."""

    def __init__(
        self, rollout_id: str, resume: task_pb2.RolloutState | None = None, link: run_many.RunLink | None = None
    ) -> None:
        self.rollout_id = rollout_id or uuid.uuid4().hex
        self.resume = resume if resume is not None else task_pb2.RolloutState()
        self.link = link
        #: 1 for the first attempt.
        self.number = len(self.resume.attempts) + 1
        #: Its session is open and its caller told (`begin`): from then on a lost attempt may keep it.
        self.began = False
        #: Its turns' tool calls wait until the caller has the turn (`turn_kept`): a durable run whose client
        #: acknowledges turns, with an environment session, where the calls leave their effects.
        self._turns_kept = False
        self._reported: list[_Reported] = []
        self._started = time.monotonic()

    @property
    def durable(self) -> bool:
        return self.link is not None and self.link.durable

    def tool_key(self, turn: int, call: int) -> str:
        """The idempotency key of a tool call (CallToolRequest.idempotency_key)."""
        return f"{self.rollout_id}/{turn}/{call}"

    def _report(self, index: int, what: _Reportable, seconds: float, acknowledge: bool = False) -> None:
        if self.link is None:
            return  # a unary Run: nobody can park or resume it, nothing to keep
        reported = (index, what, seconds)
        self._reported.append(reported)
        if self.link.durable:
            _fill(self.link.checkpoint(what.ByteSize(), acknowledge), *reported)

    def begin(self, record: task_pb2.RolloutAttempt) -> None:
        """The attempt began, with its session open (none for a stateless environment)."""
        self.began = True
        self._turns_kept = bool(record.session_id) and self.link is not None and self.link.turns_acknowledged
        self._report(0, record, 0.0)

    def new_turn(self, index: int, response: r.Response, seconds: float) -> None:
        self._report(index, response, seconds, self._turns_kept and bool(function_calls(response)))

    async def turn_kept(self) -> None:
        """Before a tool call: once the caller of a durable run has the turn that asked for it (at once
        for any other run, and for a client older than protocol 1.17). An agent lost before then made
        none of the turn's tool calls, and the attempt that resumes the run generates the turn again:
        the calls are never made for a turn the caller lost, then made once more for the new one."""
        if self.link is not None:
            await self.link.turn_read()

    def tool_output(self, index: int, output: r.FunctionCallOutput, seconds: float) -> None:
        self._report(index, output, seconds)

    def park_if_asked(self) -> None:
        """At a turn boundary: raise _Parked, with the state left on the link, when the caller asked."""
        if self.link is not None and self.link.park:
            checkpoints = [_fill(agent_pb.RunCheckpoint(), *reported) for reported in self._reported]
            state = rollout_state.build(self.resume, checkpoints)
            rollout_state.end_attempt(state, len(self.resume.attempts), rollout_state.PARKED)
            state.elapsed_seconds += time.monotonic() - self._started
            self.link.parked = state
            raise _Parked

    def keeps_session(self, error: BaseException) -> bool:
        """Whether a run that ends with `error` leaves its environment session open, for the
        attempt that resumes it: a parked run does, and a durable one lost to a server or
        engine that went away (UNAVAILABLE), or to its call ending under it."""
        if isinstance(error, _Parked):
            return True
        if not self.durable or not self.began:
            return False
        if isinstance(error, asyncio.CancelledError):
            return self.link is not None and self.link.call_ended
        return isinstance(error, errors.GymError) and error.code == grpc.StatusCode.UNAVAILABLE


#: What an attempt reports: its record, a model response (a new turn) or a tool output.
_Reportable = task_pb2.RolloutAttempt | r.Response | r.FunctionCallOutput
#: What an attempt reported: (turn index, what, seconds).
_Reported = tuple[int, _Reportable, float]


def _fill(checkpoint: agent_pb.RunCheckpoint, index: int, what: _Reportable, seconds: float) -> agent_pb.RunCheckpoint:
    """`checkpoint` made to say what was reported (see RunCheckpoint in agent_service.proto)."""
    if isinstance(what, task_pb2.RolloutAttempt):
        checkpoint.attempt.CopyFrom(what)
    elif isinstance(what, r.Response):
        checkpoint.turn_index = index
        checkpoint.turn.response.CopyFrom(what)
        checkpoint.turn.model_seconds = seconds
    else:
        checkpoint.turn_index = index
        checkpoint.turn.tool_outputs.add().CopyFrom(what)
        checkpoint.turn.tools_seconds = seconds
    return checkpoint


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
    #: Its run honours `events.attempt`: it resumes from `attempt.resume`, reports each turn
    #: boundary and parks when asked (Capabilities.resumable_rollouts). ToolLoopAgent does.
    resumable: ClassVar[bool] = False

    def capabilities(self) -> admin_pb.Capabilities:
        capabilities = super().capabilities()
        capabilities.resumable_rollouts = self.resumable
        return capabilities

    @property
    def agent_id(self) -> str:
        """Who ran an attempt (RolloutAttempt.agent): the replica's address, else name and instance."""
        return self.replica or f"{self.name}/{self.instance_id}"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._closing: set[asyncio.Task[None]] = set()

    async def run(self, task: task_pb2.Task, events: RolloutEvents, *, verify: bool = True) -> task_pb2.Rollout:
        """Roll the task out to the end, reporting steps to `events`, and return it
        verified; without `verify`, unverified (reward 0, verification_skipped)."""
        raise NotImplementedError(f"{type(self).__name__} must implement run")

    async def seed_session(
        self, resources: ResourcesClient, session_id: str, task: task_pb2.Task
    ) -> res_pb.Episode | None:
        """Open a rollout's session on `resources` (ResourcesClient.seed_session).

        A durable run's session is closed once its caller has the result (RunLink.after_result), so
        its caller may start the next rollout while that close is on its way: a caller that keeps
        as many rollouts in flight as the environment's `max_sessions` would see the seed refused
        for sessions this agent has already let go of. So a seed refused for the cap while closes
        of this agent are in flight waits for those closes (each within CLOSE_TIMEOUT) and is sent
        once more; a second refusal fails the rollout."""
        try:
            return await resources.seed_session(session_id, task)
        except errors.GymError as e:
            if e.reason != errors.Reason.SESSIONS_EXHAUSTED or not self._closing:
                raise
        await asyncio.wait(set(self._closing))
        return await resources.seed_session(session_id, task)

    async def close_session(self, resources: ResourcesClient, session_id: str) -> None:
        """Close a rollout's session on `resources`, whatever ended the rollout.

        The close runs in a task of its own, within CLOSE_TIMEOUT and not the rollout's deadline,
        and a cancellation of the caller does not cut it off: a rollout past its deadline is
        cancelled as the close starts, and over RunMany both the run's deadline and the client's
        cancel of it reach the rollout (two cancellations), which a plain `await` in a `finally`
        would not survive. The caller waits for the close unless it is cancelled while it does. A
        session that cannot be closed is logged and counted (GetCounters.sessions_not_closed); the
        environment closes it at its idle time-out."""
        await asyncio.shield(self.start_closing(resources, session_id))

    def start_closing(self, resources: ResourcesClient, session_id: str) -> asyncio.Future[None]:
        """Start closing a rollout's session (see close_session), without waiting: the close runs in a
        task the agent waits for when it stops."""
        closing = asyncio.ensure_future(self._close(resources, session_id))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        return closing

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

    def _attempt(self, request: agent_pb.RunRequest, link: run_many.RunLink | None) -> Attempt:
        """The attempt a Run request asks for: a first one, or one that resumes a rollout."""
        if not request.HasField("resume"):
            return Attempt(request.rollout_id, link=link)
        if not self.app.resumable:
            raise errors.ResumeUnsupported(f"agent {self.app.name!r} cannot resume rollouts", field="resume")
        if not request.rollout_id:
            raise errors.InvalidArgument("rollout_id: is required with resume", field="rollout_id")
        try:
            rollout_state.check(request.resume, "resume")
        except ValueError as e:
            raise errors.InvalidArgument(str(e), field="resume") from None
        return Attempt(request.rollout_id, request.resume, link)

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
    async def Run(
        self, request: agent_pb.RunRequest, context: Any, link: run_many.RunLink | None = None
    ) -> agent_pb.RunResponse:
        events = RolloutEvents(attempt=self._attempt(request, link))
        try:
            rollout = await self._roll_out(request, events)
        except _Parked:
            return agent_pb.RunResponse()  # RunMany answers with the state the attempt left on the link
        if link is not None and link.durable:
            images.tool_images_to_references(rollout.response)  # its checkpoints carried them to the caller
        return agent_pb.RunResponse(rollout=rollout)

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
    max_rollout_tokens: int | None = Field(
        None,
        ge=1,
        description="most tokens of the whole trajectory after the prompt (generated and tool outputs, as the "
        "model's usage counts them), as a trainer's max_response_length cuts it: each model call's "
        "max_output_tokens is capped to what is left, and the rollout ends (stop reason token_budget) when a turn "
        "is cut at that cap or the budget is used up; null: no budget",
    )


def add_usage(total: r.Usage, usage: r.Usage) -> None:
    """Add one model call's usage to a rollout's total."""
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
    without calling a tool, its output is cut short, `max_steps` model calls
    were made, or the trajectory used up `max_rollout_tokens` (TokenBudget).
    Then verify and close the session. (A stateless environment, as
    DescribeTools says, gets no SeedSession and CloseSession.) A tool's failure
    (unknown tool, arguments that are not JSON, an exception in the tool) goes
    back to the model as the tool's output; only a failing server fails the rollout.

    Hooks to override: `first_request` (edit the first model request),
    `call_model` (one model call) and `call_tool` (one tool call).
    """

    Config = ToolLoopConfig
    config: ToolLoopConfig
    resumable = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.model = ModelClient(
            self.registry, self.config.model_server, timeout=self.config.model_call_timeout_seconds
        )
        self.resources = ResourcesClient(self.registry, self.config.resources_server)
        self._described: res_pb.DescribeToolsResponse | None = None
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

    async def call_tool(
        self, session_id: str, call: r.FunctionCall, step: int, key: str = "", attempt: int = 0
    ) -> ToolResult:
        """Hook: one tool call; an error ToolResult goes back to the model as the tool's output. `key`
        makes it run at most once in the session, `attempt` is the attempt at the rollout that makes
        it (CallToolRequest.idempotency_key and .attempt): pass them on."""
        return await self.resources.call_tool(session_id, call, key=key, attempt=attempt)

    # --- the loop -------------------------------------------------------------------

    async def _description(self) -> res_pb.DescribeToolsResponse:
        """Asked once: whether the environment is stateless (it then needs no SeedSession and
        CloseSession) and how its sessions can be recovered."""
        if self._described is None:
            async with self._describing:
                if self._described is None:
                    self._described = await self.resources.describe_tools()
        return self._described

    async def run(self, task: task_pb2.Task, events: RolloutEvents, *, verify: bool = True) -> task_pb2.Rollout:
        started = time.monotonic()
        attempt = events.attempt
        record = task_pb2.RolloutAttempt(agent=self.agent_id, first_turn=len(attempt.resume.turns))
        stateful = not (await self._description()).stateless
        keep = False
        try:
            if stateful:  # a seed cut off by the deadline may still have opened it: closed below either way
                await self._open_session(task, attempt, record)
            attempt.begin(record)
            # The rollout's id for the model server too (its session memory, its logs), stateless or not.
            rollout = await self._rollout(record.session_id or uuid.uuid4().hex, task, events, verify)
            if record.session_id and attempt.durable and attempt.link is not None:
                # Closed once its caller has the result: lost before that, the rollout is resumed and
                # verified again, in this session.
                session_id = record.session_id
                # In the rollout's context, so that the close is in its trace too.
                rollout_context = contextvars.copy_context()
                attempt.link.after_result(lambda: rollout_context.run(self.start_closing, self.resources, session_id))
                keep = True
        except BaseException as e:
            keep = attempt.keeps_session(e)
            raise
        finally:
            if record.session_id and not keep:
                await self.close_session(self.resources, record.session_id)
        if attempt.number > 1:  # a rollout run to its end by its first attempt lists none
            rollout.attempts.extend(attempt.resume.attempts)
            rollout.attempts.append(record)
        rollout.timings.total_seconds = time.monotonic() - started + attempt.resume.elapsed_seconds
        return rollout

    async def _open_session(self, task: task_pb2.Task, attempt: Attempt, record: task_pb2.RolloutAttempt) -> None:
        """Open the attempt's session (its id in `record`): a new one, or for a resumed rollout the
        one its last attempt used, taken over; when that one is gone, a new one with the earlier
        tool calls replayed on it if the environment allows (SessionRecovery), else SessionLost."""
        resume = attempt.resume
        previous = resume.attempts[-1] if resume.attempts else None
        if previous is not None and previous.session_id:
            self.resources.resumed(previous.session_id, previous.session_replica)
            try:
                await self.resources.resume_session(previous.session_id, attempt.number)
            except errors.GymError as e:
                lost = e.reason == errors.Reason.SESSION_NOT_OPEN or e.code == grpc.StatusCode.UNAVAILABLE
                if not lost:
                    raise
                log.info("%s: rollout %s: session %s lost: %s", self.name, attempt.rollout_id, previous.session_id, e)
                await self._replay_session(task, attempt, record, e)
                return
            record.session_id, record.session_replica = previous.session_id, previous.session_replica
            return
        if attempt.resume.turns:  # resumed, but the session it had was never reported
            await self._replay_session(task, attempt, record, None)
            return
        record.session_id = uuid.uuid4().hex
        episode = await self.seed_session(self.resources, record.session_id, task)
        record.session_replica = self.resources.replica_of(record.session_id)
        if episode is not None:
            raise errors.FailedPrecondition(
                f"environment {self.resources.name!r} runs episodes with several roles "
                f"({', '.join(role.name for role in episode.roles)}): serve it with an episode agent "
                "(servers/agents/episode_agent, docs/episodes.md)",
                reason=errors.Reason.EPISODE_TURN_INVALID,
            )

    async def _replay_session(
        self, task: task_pb2.Task, attempt: Attempt, record: task_pb2.RolloutAttempt, lost: errors.GymError | None
    ) -> None:
        """A new session for a resumed rollout whose session was lost, the earlier tool calls run
        on it again in order (an environment with SESSION_RECOVERY_REPLAY), each checked against the
        output the model saw. SessionLost when the environment cannot, or the outputs differ."""
        done = [(t, turn) for t, turn in enumerate(attempt.resume.turns) if turn.tool_outputs]
        why = f": {lost.message}" if lost is not None else ""
        recovery = (await self._description()).session_recovery
        if done and recovery != res_pb.SESSION_RECOVERY_REPLAY:
            raise errors.SessionLost(
                f"the rollout's environment session is gone{why}, and environment {self.resources.name!r} "
                "cannot restore sessions (session_recovery: none)",
                field="resume",
            )
        record.session_id = uuid.uuid4().hex
        record.session_replayed = True
        await self.seed_session(self.resources, record.session_id, task)
        record.session_replica = self.resources.replica_of(record.session_id)
        for index, turn in done:
            calls = function_calls(turn.response)  # the last turn may have fewer outputs than calls
            for position, (call, recorded) in enumerate(zip(calls, turn.tool_outputs, strict=False)):
                key = attempt.tool_key(index, position)
                result = await self.resources.call_tool(record.session_id, call, key=key, attempt=attempt.number)
                if tool_call_output(call, result).output != recorded.output:
                    raise errors.SessionLost(
                        f"the rollout's environment session is gone{why}, and replaying it did not give back "
                        f"the output of turn {index}'s call {position} ({call.name}): the environment is not "
                        "deterministic enough for session_recovery: replay",
                        field="resume",
                    )

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
        rollout = task_pb2.Rollout(stop_reason=task_pb2.STOP_REASON_MAX_STEPS)
        rollout.response.status = r.RESPONSE_STATUS_COMPLETED
        budget = TokenBudget.of(self.config.max_rollout_tokens, params, self.config.model_server)
        so_far = _SoFar(rollout, params.input_items.items, budget)
        attempt = events.attempt
        for resumed in attempt.resume.turns:
            if budget is not None:
                budget.limit()  # the cap that turn had, to tell why it ended
            so_far.take(resumed.response, resumed.model_seconds)
            for output in resumed.tool_outputs:
                so_far.tool_output(output, 0.0)
            rollout.timings.tools_seconds += resumed.tools_seconds
        step = len(attempt.resume.turns)
        if step:  # resumed: the last turn ended the rollout, or goes on with the tool calls it has left
            last = attempt.resume.turns[-1]
            ended = so_far.stop(last.response)
            if not ended:
                await self._call_tools(session_id, last.response, step - 1, len(last.tool_outputs), events, so_far)
            if ended or step == self.config.max_steps:
                rollout.model_calls = step
                return await self.verified(session_id, task, rollout, events, verify)
        sent = images.SentImages()
        while step < self.config.max_steps:
            attempt.park_if_asked()
            if budget is not None:
                params.max_output_tokens = budget.limit()
            began = time.monotonic()
            sent.before_call(params.input_items.items)
            with tracing.model_call(params.model, session_id, step) as span:
                try:
                    response = await self.call_model(request, step)
                except errors.GymError as e:
                    if e.reason != errors.Reason.IMAGE_NOT_FOUND:
                        raise
                    sent.restore(params.input_items.items)  # a model server that restarted: once more, by value
                    response = await self.call_model(request, step)
                tracing.model_answered(span, response)
            sent.after_call(params.input_items.items)
            seconds = time.monotonic() - began
            events.model_call(step, response, seconds)
            so_far.take(response, seconds)
            step += 1
            if so_far.stop(response):
                break
            await self._call_tools(session_id, response, step - 1, 0, events, so_far)
        rollout.model_calls = step
        return await self.verified(session_id, task, rollout, events, verify)

    async def _call_tools(
        self, session_id: str, response: r.Response, step: int, first: int, events: RolloutEvents, so_far: _SoFar
    ) -> None:
        """Run the function calls of `response` (turn `step`) from the `first`-th on, in order."""
        attempt = events.attempt
        for position, call in enumerate(function_calls(response)[first:], start=first):
            await attempt.turn_kept()
            began = time.monotonic()
            key = attempt.tool_key(step, position)
            with tracing.tool_call(call.name, call.call_id, step) as span:
                result = await self.call_tool(session_id, call, step, key=key, attempt=attempt.number)
                tracing.tool_answered(span, result.error, result.reason)
            seconds = time.monotonic() - began
            output = tool_call_output(call, result)
            events.tool_call(step, call, output, result.error, seconds)
            so_far.tool_output(output, seconds)

    async def verified(
        self, session_id: str, task: task_pb2.Task, rollout: task_pb2.Rollout, events: RolloutEvents, verify: bool
    ) -> task_pb2.Rollout:
        """The rollout with its verdict from the resources server, or marked unverified without `verify`.
        An image shown several times is held by value once in its response, referenced after."""
        images.by_value_once(rollout.response.output)
        if not verify:
            rollout.verification_skipped = True
            return rollout
        began = time.monotonic()
        response = rollout.response
        if self._described is not None and not self._described.stateless:
            response = images.tool_images_as_references(response)  # the session holds them
        with tracing.verification(self.resources.name) as span:
            verdict = await self.resources.verify(session_id, task, response)
            tracing.verified(span, verdict.reward)
        rollout.timings.verify_seconds = time.monotonic() - began
        fields_json = rows.json_text(verdict, "fields")  # passed on as text, never parsed here
        events.verification(verdict.reward, fields_json, rollout.timings.verify_seconds, verdict.reward_components)
        rollout.reward = verdict.reward
        rollout.verifier_fields_json = fields_json
        rollout.reward_components.update(verdict.reward_components)
        return rollout


class _SoFar:
    """The rollout as its turns come in: its response (the model's envelope from the first
    turn, every output item after), its timings, the conversation sent to the model."""

    def __init__(self, rollout: task_pb2.Rollout, conversation: Any, budget: TokenBudget | None = None) -> None:
        self.rollout, self.conversation = rollout, conversation
        self.budget = budget
        self.first = True

    def take(self, response: r.Response, seconds: float) -> None:
        final = self.rollout.response
        if self.first:
            final.CopyFrom(response)  # the model's envelope: id, echoed parameters, keys we do not model
            self.first = False
        else:
            final.model, final.status = response.model, response.status
            add_usage(final.usage, response.usage)
            final.output.extend(response.output)
        self.rollout.timings.model_seconds += seconds
        self.conversation.extend(response.output)
        if self.budget is not None:
            self.budget.took(response)

    def stop(self, response: r.Response) -> bool:
        """Whether the rollout ends with this response, its stop reason set when it does."""
        if response.status == r.RESPONSE_STATUS_INCOMPLETE:
            self.rollout.response.incomplete_details.CopyFrom(response.incomplete_details)
            cut = self.budget is not None and self.budget.cut(response)
            self.rollout.stop_reason = task_pb2.STOP_REASON_TOKEN_BUDGET if cut else task_pb2.STOP_REASON_INCOMPLETE
            return True
        if not function_calls(response):
            self.rollout.stop_reason = task_pb2.STOP_REASON_FINAL_MESSAGE
            return True
        if self.budget is not None and self.budget.spent:  # its tool outputs would only add to a trajectory cut anyway
            self.rollout.stop_reason = task_pb2.STOP_REASON_TOKEN_BUDGET
            return True
        return False

    def tool_output(self, output: r.FunctionCallOutput, seconds: float) -> None:
        self.rollout.timings.tools_seconds += seconds
        item = r.Item(function_call_output=output)
        self.rollout.response.output.append(item)
        self.conversation.append(item)


def tool_call_output(call: r.FunctionCall, result: ToolResult) -> r.FunctionCallOutput:
    """The output item that answers `call` with `result`, as the model sees it (an error marked)."""
    output = r.FunctionCallOutput(id=new_id("fco"), call_id=call.call_id, status=r.ITEM_STATUS_COMPLETED)
    if result.error:
        output.output = tool_error_output(result.output)
    elif result.parts:
        output.output_parts.items.extend(result.parts)
    else:
        output.output = result.output
    return output
