"""Typed clients over the generated stubs, one per role.

Each resolves its server by name through a `Registry`, gives every call a
deadline (what is left of the current call's deadline when called from a
handler, capped by the client's `timeout` when it has one; with neither,
DEFAULT_TIMEOUT) and turns a failed call into a
`GymError` that names the server and method. A server that answered before
is waited for while it cannot be reached (see `transport.Connection`): a
pause or a restart costs time, not the rollout.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import struct_pb2

from gym_grpc import errors, tracing
from gym_grpc.client import run_many
from gym_grpc.policy_version import requested as requested_version
from gym_grpc.rpc import protocol, transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import model_service_pb2_grpc as model_grpc
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import sandbox_service_pb2 as sb_pb
from gym_grpc.v1 import sandbox_service_pb2_grpc as sb_grpc
from gym_grpc.v1 import task_pb2
from gym_grpc.v1 import task_service_pb2 as tasks_pb
from gym_grpc.v1 import task_service_pb2_grpc as tasks_grpc

#: Timeout of one call, in seconds, when neither the caller's deadline nor the client's `timeout` gives one.
DEFAULT_TIMEOUT = 600.0

#: Seconds a TaskService.NextBatch call may take unless told: a day.
BATCH_TIMEOUT = 86_400.0
#: How long a weight update may take on each replica, unless told.
UPDATE_TIMEOUT = 300.0
#: The pause modes of a weight update, by name (PauseMode in model_service.proto).
PAUSE_MODES = {"keep": model_pb.PAUSE_MODE_KEEP, "abort": model_pb.PAUSE_MODE_ABORT, "wait": model_pb.PAUSE_MODE_WAIT}


class _Client:
    _stub_class: Any
    _kind: str
    _service: str  # its full name, for in-process calls

    def __init__(self, registry: Registry, name: str, *, timeout: float | None = None) -> None:
        self.registry = registry
        self.name = name
        #: The most one call may take; None: what is left of the caller's deadline (DEFAULT_TIMEOUT without one).
        self.timeout = timeout
        self._next = 0
        self._handshake: asyncio.Future[None] | None = None

    def _deadline(self, timeout: float | None = None) -> float:
        """The timeout of a call: `timeout`, else the client's, capped by what is left of the caller's
        deadline; with neither, what is left of that deadline, or DEFAULT_TIMEOUT when there is none.
        So a call made in a rollout of an hour may take the hour, not DEFAULT_TIMEOUT."""
        chosen = timeout if timeout is not None else self.timeout
        left = transport.timeout_for(chosen)
        return left if left is not None else DEFAULT_TIMEOUT

    async def _peer(self) -> tuple[Any, transport.Connection]:
        """A stub and its connection for the next call: calls go round the server's
        connections (gRPC balances each one's calls over the replicas)."""
        connections = await self._connections()
        self._next = (self._next + 1) % len(connections)
        connection = connections[self._next]
        return connection.stub(self._stub_class), connection

    async def _connections(self) -> list[transport.Connection]:
        """The server's connections: without an await on every call; the first call opens them."""
        return self.registry.opened(self.name) or await self.registry.connections(self.name)

    async def server_info(self) -> admin_pb.GetServerInfoResponse:
        """The server's AdminService.GetServerInfo: what it is, its protocol version, its capabilities."""
        return await self._call("GetServerInfo", admin_pb.GetServerInfoRequest(), admin=True)

    async def check_protocol(self) -> None:
        """Raise IncompatibleServer when the server speaks another major version of the
        protocol. Asked once; a server without AdminService is taken as it comes."""
        if self._handshake is None:
            self._handshake = asyncio.ensure_future(self._shake_hands())
        handshake = self._handshake
        try:
            await asyncio.shield(handshake)
        except errors.GymError as e:
            if not isinstance(e, errors.IncompatibleServer) and self._handshake is handshake:
                self._handshake = None  # ask again next time: the server may be up by then
            raise

    async def _shake_hands(self) -> None:
        try:
            info = await self.server_info()
        except errors.GymError as e:
            if e.code == grpc.StatusCode.UNIMPLEMENTED:
                return  # another implementation of the protocol, without AdminService: be liberal
            raise
        protocol.check(info, f"{self._kind} {self.name!r}")
        self._shook_hands(info)

    def _shook_hands(self, info: admin_pb.GetServerInfoResponse) -> None:
        """What a role's client makes of the server's answer to the handshake."""

    async def _error(
        self, error: grpc.aio.AioRpcError | None, method: str, connection: transport.Connection | None
    ) -> errors.GymError:
        where = f"{self._kind} {self.name!r} {method}"
        metadata = {"callee": self.name, "callee_method": method}
        if connection is None:  # an in-process call: the error is its own
            assert error is not None
            return errors.from_rpc_error(error, where, metadata)
        if connection.replica:
            where += f" on replica {connection.address}"
            metadata["replica"] = connection.address
        elif "," in connection.address and _lost_peer(error):
            # gRPC does not say which replica took a call; the ones that stopped answering did.
            down = await self.registry.unreachable(connection.address.split(","))
            if down:
                where += f" (replica {', '.join(down)} not answering)"
                metadata["replica"] = ",".join(down)
        if error is None:  # cancelled by the connection: the peer was given up
            return errors.Unavailable(
                f"{where}: UNAVAILABLE: {connection.address} unreachable for {connection.unreachable_seconds:g} s",
                metadata=metadata,
            )
        return errors.from_rpc_error(error, where, metadata)

    async def _call(
        self,
        method: str,
        request: Any,
        timeout: float | None = None,
        *,
        detached: bool = False,
        passing: frozenset[grpc.StatusCode] = frozenset(),
        admin: bool = False,
        connection: transport.Connection | None = None,
    ) -> Any:
        """Call `method` (of the server's AdminService when `admin`). `detached` calls ignore
        the caller's deadline (for cleanup); a failure with a code in `passing` is returned, not raised.
        Given the `connection`, the call goes there (a session's replica), not round the server's;
        a server of this process (a `process:` group) is called in-process, when no connection
        is given or it is the one that reaches this process's server alone."""
        if detached:  # its own timeout (a cleanup), whatever is left of the caller's deadline
            timeout = timeout if timeout is not None else self.timeout if self.timeout is not None else DEFAULT_TIMEOUT
        else:
            timeout = self._deadline(timeout)
        metadata = tracing.outgoing()  # the trace of the rollout this call is part of, when tracing
        local = None if admin else self.registry.in_process.get(self.name)
        if local is not None and connection is not None and connection.address != local.replica:
            local = None
        if local is not None:
            try:
                return await local.call(f"/{self._service}/{method}", request, timeout, metadata)
            except grpc.aio.AioRpcError as e:
                if e.code() in passing:
                    return e
                raise await self._error(e, method, None) from None
        if connection is None:
            stub, connection = await self._peer()
        else:
            stub = connection.stub(self._stub_class)
        if admin:
            stub = connection.stub(admin_grpc.AdminServiceStub)
        wait = connection.wait
        call = getattr(stub, method)(request, timeout=timeout, wait_for_ready=wait, metadata=metadata)
        if wait:
            connection.waiting(call)
        try:
            reply = await call
        except grpc.aio.AioRpcError as e:
            if e.code() in passing:
                return e
            raise await self._error(e, method, connection) from None
        except asyncio.CancelledError:
            if _cancelled_by(connection):
                raise await self._error(None, method, connection) from None
            raise
        connection.answered()
        return reply

    async def _stream(self, method: str, request: Any, timeout: float | None) -> AsyncIterator[Any]:
        """The replies of a server-streaming call, after the handshake; its failure as a GymError."""
        await self.check_protocol()
        stub, connection = await self._peer()
        wait = connection.wait
        call = getattr(stub, method)(
            request, timeout=self._deadline(timeout), wait_for_ready=wait, metadata=tracing.outgoing()
        )
        if wait:
            connection.waiting(call)
        try:
            async for reply in call:
                yield reply
        except grpc.aio.AioRpcError as e:
            raise await self._error(e, method, connection) from None
        except asyncio.CancelledError:
            if _cancelled_by(connection):
                raise await self._error(None, method, connection) from None
            raise
        finally:
            call.cancel()


def _lost_peer(error: grpc.aio.AioRpcError | None) -> bool:
    """Whether a call failed because its peer went away: given up on (None), or
    UNAVAILABLE from gRPC itself. A server's own UNAVAILABLE (a server it calls is
    down) carries our ErrorInfo: that replica answered."""
    if error is None:
        return True
    return error.code() == grpc.StatusCode.UNAVAILABLE and errors.error_info_of(error) is None


def _cancelled_by(connection: transport.Connection) -> bool:
    """Whether a call that ended in CancelledError was cancelled by its connection
    giving up on the peer, not by a cancel of the task that made it."""
    task = asyncio.current_task()
    return connection.given_up and task is not None and not task.cancelling()


class AdminClient(_Client):
    """Calls the AdminService every gym-grpc server has, whatever its role."""

    _stub_class = admin_grpc.AdminServiceStub
    _kind = "server"
    _service = admin_pb.DESCRIPTOR.services_by_name["AdminService"].full_name

    async def counters(self, address: str) -> admin_pb.GetCountersResponse:
        """GetCounters of the server's replica at `address`, over the registry's connection to it."""
        return await self._call("GetCounters", admin_pb.GetCountersRequest(), connection=self.registry.replica(address))


class ModelClient(_Client):
    """Calls a ModelService."""

    _stub_class = model_grpc.ModelServiceStub
    _kind = "model server"
    _service = model_pb.DESCRIPTOR.services_by_name["ModelService"].full_name

    async def create_response(self, params: r.CreateParams, session_id: str = "") -> r.Response:
        return await self.send(model_pb.CreateResponseRequest(params=params, session_id=session_id))

    async def send(self, request: model_pb.CreateResponseRequest) -> r.Response:
        """CreateResponse with a request the caller keeps (an agent grows one conversation in place).
        Called in a rollout that was asked under a policy version, the request carries it."""
        asked = requested_version.get()
        if asked is not None:
            request.policy_version = asked
        reply = await self._call("CreateResponse", request)
        return reply.response

    async def set_policy_version(self, version: int) -> None:
        """Tell every replica of the model server that its engine now serves `version` (after a
        weight update): the turns they generate from now on are stamped with it."""
        info = await self.registry.info(self.name)
        request = model_pb.SetPolicyVersionRequest(version=version)
        for address in info.addresses:
            await self._call("SetPolicyVersion", request, connection=self.registry.replica(address))

    async def update_weights(
        self, version: int, checkpoint_path: str, pause_mode: str = "keep", timeout: float | None = None
    ) -> list[model_pb.UpdateWeightsResponse]:
        """Have every replica of the model server load the checkpoint into its engines and serve
        `version` (ModelService.UpdateWeights), one replica after the other; `pause_mode`: "keep",
        "abort" or "wait" (see PauseMode in model_service.proto). Each replica's answer."""
        mode = PAUSE_MODES.get(pause_mode)
        if mode is None:
            raise ValueError(f"pause_mode must be one of {', '.join(PAUSE_MODES)}, not {pause_mode!r}")
        info = await self.registry.info(self.name)
        request = model_pb.UpdateWeightsRequest(version=version, checkpoint_path=checkpoint_path, pause_mode=mode)
        timeout = timeout if timeout is not None else UPDATE_TIMEOUT
        return [
            await self._call("UpdateWeights", request, timeout, connection=self.registry.replica(address))
            for address in info.addresses
        ]


@dataclass(frozen=True)
class ToolResult:
    """A tool call's output for the model; `error` when the call failed, and then
    `reason` says why (TOOL_FAILED, TOOL_NOT_FOUND, TOOL_ARGUMENTS_INVALID...)."""

    output: str
    error: bool = False
    reason: str | None = None
    #: The output as content parts when the tool returned images (`output` is then their text).
    parts: tuple[r.ContentPart, ...] = ()


class ResourcesClient(_Client):
    """Calls a ResourcesService."""

    _stub_class = res_grpc.ResourcesServiceStub
    _kind = "resources server"
    _service = res_pb.DESCRIPTOR.services_by_name["ResourcesService"].full_name

    def __init__(self, registry: Registry, name: str, *, timeout: float | None = None) -> None:
        super().__init__(registry, name, timeout=timeout)
        self._sessions: dict[str, str] = {}  # session id -> the address of the replica holding it
        self._sandboxes = _SandboxCalls(registry, name, timeout=timeout)

    def _session(self, session_id: str) -> transport.Connection | None:
        """Where a session's calls go: the replica that holds it, else round the server's replicas."""
        replica = self._sessions.get(session_id)
        return None if replica is None else self.registry.replica(replica)

    async def seed_session(self, session_id: str, task: task_pb2.Task) -> res_pb.Episode | None:
        """Open a session; the episode it runs when the environment has several roles, else None.
        When the server has replicas, its later calls go to the one that opened it
        (SeedSessionResponse.replica) until close_session."""
        reply = await self._call("SeedSession", res_pb.SeedSessionRequest(session_id=session_id, task=task))
        if reply.replica:
            self._sessions[session_id] = reply.replica
        return reply.episode if reply.HasField("episode") else None

    async def end_turn(self, session_id: str, role: str, response: r.Response) -> res_pb.EpisodeTurn | None:
        """End `role`'s turn with its model's `response`: the next turn, or None when the episode is over."""
        request = res_pb.EndTurnRequest(session_id=session_id, role=role, response=response)
        reply = await self._call("EndTurn", request, connection=self._session(session_id))
        return reply.next if reply.HasField("next") else None

    def resumed(self, session_id: str, replica: str) -> None:
        """Send a session's calls to `replica` (a resumed rollout's session, opened by another agent)."""
        if replica:
            self._sessions[session_id] = replica

    def replica_of(self, session_id: str) -> str:
        """The replica that holds a session, or "" when any will do."""
        return self._sessions.get(session_id, "")

    async def resume_session(self, session_id: str, attempt: int) -> None:
        """Take over an open session for `attempt` of its rollout (ResourcesService.ResumeSession)."""
        request = res_pb.ResumeSessionRequest(session_id=session_id, attempt=attempt)
        await self._call("ResumeSession", request, connection=self._session(session_id))

    async def call_tool(self, session_id: str, call: r.FunctionCall, *, key: str = "", attempt: int = 0) -> ToolResult:
        """Run a tool call; with a `key`, at most once in the session (CallToolRequest.idempotency_key),
        and refused when `attempt` is older than the session's latest. Mistakes of the model (unknown
        tool, bad arguments) and errors the tool raised come back as an error ToolResult; failures of
        the server itself raise."""
        request = res_pb.CallToolRequest(
            session_id=session_id,
            name=call.name,
            arguments=call.arguments,
            call_id=call.call_id,
            idempotency_key=key,
            attempt=attempt,
        )
        reply = await self._call(
            "CallTool", request, passing=errors.TOOL_ERROR_CODES, connection=self._session(session_id)
        )
        if isinstance(reply, grpc.aio.AioRpcError):
            reason = errors.reason_of(reply)
            return ToolResult(output=reply.details() or reply.code().name, error=True, reason=str(reason))
        if reply.is_error:
            return ToolResult(output=reply.output, error=True, reason=str(errors.Reason.TOOL_FAILED))
        return ToolResult(output=reply.output, parts=tuple(reply.parts))

    async def verify(self, session_id: str, task: task_pb2.Task, response: r.Response) -> res_pb.VerifyResponse:
        request = res_pb.VerifyRequest(session_id=session_id, task=task, response=response)
        return await self._call("Verify", request, connection=self._session(session_id))

    async def close_session(self, session_id: str, timeout: float | None = None) -> None:
        """Close a session. Cleanup: runs with its own timeout even when the
        caller's deadline has passed."""
        request = res_pb.CloseSessionRequest(session_id=session_id)
        try:
            await self._call("CloseSession", request, timeout, detached=True, connection=self._session(session_id))
        finally:
            self._sessions.pop(session_id, None)

    async def aggregate_metrics(self, results: Iterable[task_pb2.VerificationResult]) -> struct_pb2.Struct:
        reply = await self._call("AggregateMetrics", res_pb.AggregateMetricsRequest(results=results))
        return reply.metrics

    async def describe_tools(self) -> res_pb.DescribeToolsResponse:
        """The environment's tools, and whether it is stateless."""
        return await self._call("DescribeTools", res_pb.DescribeToolsRequest())

    async def sandbox_exec(self, request: sb_pb.ExecRequest, timeout: float | None = None) -> sb_pb.ExecResponse:
        """Run a command in the session's sandbox (SandboxService.Exec, on the replica that holds the session)."""
        return await self._sandboxes._call("Exec", request, timeout, connection=self._session(request.session_id))

    async def sandbox_write(self, session_id: str, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file of the session's sandbox (SandboxService.WriteFile)."""
        request = sb_pb.WriteFileRequest(session_id=session_id, path=path, data=data, mode=mode)
        await self._sandboxes._call("WriteFile", request, connection=self._session(session_id))


class _SandboxCalls(_Client):
    """SandboxService calls of a resources server, made through its ResourcesClient (which knows the
    replica that holds each session)."""

    _stub_class = sb_grpc.SandboxServiceStub
    _kind = "resources server"
    _service = sb_pb.DESCRIPTOR.services_by_name["SandboxService"].full_name


class AgentClient(_Client):
    """Calls an AgentService."""

    _stub_class = agent_grpc.AgentServiceStub
    _kind = "agent"
    _service = agent_pb.DESCRIPTOR.services_by_name["AgentService"].full_name

    def __init__(
        self,
        registry: Registry,
        name: str,
        *,
        timeout: float | None = None,
        resume_attempts: int = run_many.RESUME_ATTEMPTS,
    ) -> None:
        super().__init__(registry, name, timeout=timeout)
        self._run_many: run_many.RunMany | None = None
        #: The largest run the agent takes: its handshake's max_receive_message_bytes, or ours.
        self._largest_run = transport.MAX_MESSAGE_BYTES
        #: How many times a rollout lost with a server or engine is resumed (0: never); see client/run_many.py.
        self.resume_attempts = resume_attempts
        self._resumable = False

    async def run(
        self,
        task: task_pb2.Task,
        timeout: float | None = None,
        *,
        skip_verification: bool = False,
        policy_version: int | None = None,
        rollout_id: str = "",
        resume: task_pb2.RolloutState | None = None,
        progress: run_many.Progress | None = None,
    ) -> task_pb2.Rollout:
        """One rollout; `policy_version`: the version the trainer asks it under (see policy_version.py).

        When the agent resumes rollouts, the rollout is durable: lost with its agent replica, model
        server or engine, it goes on from its last turn boundary (up to `resume_attempts` times).
        `resume` goes on with a parked rollout (RolloutParked.state, under its `rollout_id`), or one
        whose caller died; `progress` keeps a durable rollout's attempts and checkpoints as they come,
        for that (batch/states.py)."""
        await self.check_protocol()
        if resume is not None and not rollout_id:
            raise ValueError("resume needs the rollout_id the rollout was parked under")
        request = agent_pb.RunRequest(
            task=task,
            skip_verification=skip_verification,
            policy_version=policy_version,
            rollout_id=rollout_id or (uuid.uuid4().hex if self._resumable else ""),
            resume=resume,
        )
        if request.ByteSize() > self._largest_run:  # never sent: on a RunMany call it would end the other runs too
            raise errors.InvalidArgument(
                f"agent {self.name!r}: the run is {request.ByteSize():,} bytes, over the {self._largest_run:,} "
                "bytes a message to it may have",
                field="task",
            )
        if self._run_many is None or self.name in self.registry.in_process:
            reply = await self._call("Run", request, timeout)
            return reply.rollout
        resumes = self.resume_attempts if self._resumable else 0
        try:
            return await self._run_many.run(request, self._deadline(timeout), resumes, progress)
        except grpc.aio.AioRpcError as e:
            raise await self._error(e, "Run", None) from None

    def _shook_hands(self, info: admin_pb.GetServerInfoResponse) -> None:
        """Rollouts go over RunMany calls when the agent serves it (see client/run_many.py), durable
        when it resumes rollouts."""
        if info.capabilities.max_receive_message_bytes:
            self._largest_run = min(self._largest_run, info.capabilities.max_receive_message_bytes)
        if run_many.METHOD in protocol.methods(info, self._service):
            confirms = (info.protocol.major, info.protocol.minor) >= (1, 18)
            self._run_many = run_many.RunMany(self._connections, self._error, confirms)
            self._resumable = info.capabilities.resumable_rollouts

    def park(self) -> int:
        """Ask the agent to park every rollout this client has in flight, at its next turn boundary:
        each one's `run` raises RolloutParked, whose state resumes it (`run(..., resume=...)`) on
        any replica, now or later. How many were asked; only rollouts over RunMany can be parked."""
        return self._run_many.park() if self._run_many is not None else 0

    async def close(self) -> None:
        """End the client's RunMany calls (its channels are the registry's, closed with it)."""
        if self._run_many is not None:
            await self._run_many.close()

    async def run_stream(
        self,
        task: task_pb2.Task,
        timeout: float | None = None,
        *,
        skip_verification: bool = False,
        policy_version: int | None = None,
    ) -> AsyncIterator[agent_pb.RunStreamResponse]:
        """The events of one rollout as they happen; the last one holds the rollout."""
        request = agent_pb.RunStreamRequest(
            task=task, skip_verification=skip_verification, policy_version=policy_version
        )
        async for event in self._stream("RunStream", request, timeout):
            yield event


class TaskClient(_Client):
    """Calls a TaskService (a task server: gym_grpc/tasks)."""

    _stub_class = tasks_grpc.TaskServiceStub
    _kind = "task"
    _service = tasks_pb.DESCRIPTOR.services_by_name["TaskService"].full_name

    async def next_batch(
        self,
        groups: int,
        group_size: int = 0,
        *,
        policy_version: int | None = None,
        rollout_timeout: float | None = None,
        timeout: float | None = None,
    ) -> AsyncIterator[tasks_pb.NextBatchResponse]:
        """The groups of a batch as the server completes them, then its summary (NextBatch). The call
        may take BATCH_TIMEOUT unless `timeout` says: a batch is many rollouts, and groups dropped for
        want of signal are rolled out again."""
        request = tasks_pb.NextBatchRequest(
            groups=groups,
            group_size=group_size,
            policy_version=policy_version,
            rollout_timeout_seconds=rollout_timeout or 0.0,
        )
        async for reply in self._stream("NextBatch", request, BATCH_TIMEOUT if timeout is None else timeout):
            yield reply

    async def task_stats(self, limit: int = 0) -> tasks_pb.GetTaskStatsResponse:
        """What the server knows of its tasks (GetTaskStats)."""
        return await self._call("GetTaskStats", tasks_pb.GetTaskStatsRequest(limit=limit))
