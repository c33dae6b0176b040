"""The error catalogue: every error gym-grpc raises, in one place.

Each error has a stable *reason* (`Reason`, an UPPER_SNAKE code callers
branch on), a public `message` and, kept out of the wire, an internal
`detail`. A `GymError` also has a gRPC status code: a handler raises one and
the servicer plumbing (`serving.rpc_method`) turns it into a
`google.rpc.Status` with the public message, an `ErrorInfo` detail (domain
`DOMAIN`, the reason, `metadata`) and, when a request field is at fault, a
`BadRequest` naming it. Anything else that escapes a handler is a bug: logged
with its traceback, the caller sees INTERNAL (reason INTERNAL_ERROR) with the
exception's class, never the internal detail. The other errors are reported
by the command line or raised to Python callers, never sent.

docs/errors.md lists every reason with its status, when it happens and what
a caller should do; tests/test_errors.py keeps the two in step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from gym_grpc.server import open_files
from gym_grpc.v1 import task_pb2

#: `google.rpc.ErrorInfo.domain` of every error a gym-grpc server sends.
DOMAIN = "gym-grpc.dev"

_S = grpc.StatusCode


class Reason(StrEnum):
    """Why an error happened: the `ErrorInfo.reason` on the wire, `.reason` in Python.

    `status` is the gRPC status code it travels with, None for an error that is never
    sent (reported by the command line or raised to a Python caller)."""

    status: grpc.StatusCode | None

    def __new__(cls, value: str, status: grpc.StatusCode | None) -> Reason:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status = status
        return member

    # The request
    REQUEST_INVALID = "REQUEST_INVALID", _S.INVALID_ARGUMENT
    REQUEST_NOT_PARSABLE = "REQUEST_NOT_PARSABLE", _S.INVALID_ARGUMENT
    ROW_INVALID = "ROW_INVALID", _S.INVALID_ARGUMENT
    TASK_DATA_INVALID = "TASK_DATA_INVALID", _S.INVALID_ARGUMENT
    BEARER_TOKEN_REJECTED = "BEARER_TOKEN_REJECTED", _S.UNAUTHENTICATED
    # Tools (the model's calls)
    TOOL_NOT_FOUND = "TOOL_NOT_FOUND", _S.NOT_FOUND
    TOOL_ARGUMENTS_INVALID = "TOOL_ARGUMENTS_INVALID", _S.INVALID_ARGUMENT
    TOOL_FAILED = "TOOL_FAILED", _S.ABORTED
    # Sessions and state
    SESSION_NOT_OPEN = "SESSION_NOT_OPEN", _S.FAILED_PRECONDITION
    SESSION_ALREADY_OPEN = "SESSION_ALREADY_OPEN", _S.FAILED_PRECONDITION
    SESSION_LOST = "SESSION_LOST", _S.FAILED_PRECONDITION
    STALE_ATTEMPT = "STALE_ATTEMPT", _S.FAILED_PRECONDITION
    RESUME_UNSUPPORTED = "RESUME_UNSUPPORTED", _S.UNIMPLEMENTED
    PRECONDITION_FAILED = "PRECONDITION_FAILED", _S.FAILED_PRECONDITION
    PROTOCOL_INCOMPATIBLE = "PROTOCOL_INCOMPATIBLE", _S.FAILED_PRECONDITION
    SERVER_NOT_FOUND = "SERVER_NOT_FOUND", _S.NOT_FOUND
    # The environment's own code
    VERIFIER_FAILED = "VERIFIER_FAILED", _S.INTERNAL
    VERIFIER_TIMED_OUT = "VERIFIER_TIMED_OUT", _S.INTERNAL
    JUDGE_VERDICT_UNPARSABLE = "JUDGE_VERDICT_UNPARSABLE", _S.INTERNAL
    HOOK_FAILED = "HOOK_FAILED", _S.INTERNAL
    AGENT_PROCESS_FAILED = "AGENT_PROCESS_FAILED", _S.INTERNAL
    INTERNAL_ERROR = "INTERNAL_ERROR", _S.INTERNAL
    # Inference engines
    ENGINE_REJECTED_REQUEST = "ENGINE_REJECTED_REQUEST", _S.INVALID_ARGUMENT
    ENGINE_AUTH_FAILED = "ENGINE_AUTH_FAILED", _S.FAILED_PRECONDITION
    ENGINE_FAILED = "ENGINE_FAILED", _S.INTERNAL
    ENGINE_UNAVAILABLE = "ENGINE_UNAVAILABLE", _S.UNAVAILABLE
    POLICY_VERSION_BEHIND = "POLICY_VERSION_BEHIND", _S.FAILED_PRECONDITION
    WEIGHT_UPDATE_FAILED = "WEIGHT_UPDATE_FAILED", _S.UNAVAILABLE
    WEIGHT_UPDATE_UNSUPPORTED = "WEIGHT_UPDATE_UNSUPPORTED", _S.UNIMPLEMENTED
    # Load and peers
    SESSIONS_EXHAUSTED = "SESSIONS_EXHAUSTED", _S.RESOURCE_EXHAUSTED
    OUT_OF_FILES = "OUT_OF_FILES", _S.RESOURCE_EXHAUSTED
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED", _S.RESOURCE_EXHAUSTED
    PEER_UNAVAILABLE = "PEER_UNAVAILABLE", _S.UNAVAILABLE
    SERVER_STOPPING = "SERVER_STOPPING", _S.UNAVAILABLE
    MCP_SERVER_UNAVAILABLE = "MCP_SERVER_UNAVAILABLE", _S.UNAVAILABLE
    OPENENV_UNAVAILABLE = "OPENENV_UNAVAILABLE", _S.UNAVAILABLE
    SANDBOX_START_FAILED = "SANDBOX_START_FAILED", _S.UNAVAILABLE
    SANDBOX_FAILED = "SANDBOX_FAILED", _S.FAILED_PRECONDITION
    IMAGE_INVALID = "IMAGE_INVALID", _S.INVALID_ARGUMENT
    IMAGE_NOT_FOUND = "IMAGE_NOT_FOUND", _S.FAILED_PRECONDITION
    EPISODE_TURN_INVALID = "EPISODE_TURN_INVALID", _S.FAILED_PRECONDITION
    TASKS_EXHAUSTED = "TASKS_EXHAUSTED", _S.FAILED_PRECONDITION
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED", _S.DEADLINE_EXCEEDED
    CANCELLED = "CANCELLED", _S.CANCELLED
    UNCLASSIFIED = "UNCLASSIFIED", None
    # Never sent: the command line and Python callers
    CONFIG_INVALID = "CONFIG_INVALID", None
    OUTPUT_NOT_WRITABLE = "OUTPUT_NOT_WRITABLE", None
    RUN_MISMATCH = "RUN_MISMATCH", None
    OUTPUT_IN_USE = "OUTPUT_IN_USE", None
    ROLLOUT_FAILED = "ROLLOUT_FAILED", None
    ROLLOUT_PARKED = "ROLLOUT_PARKED", None
    DATASET_INVALID = "DATASET_INVALID", None
    HUB_FAILED = "HUB_FAILED", None
    MLFLOW_FAILED = "MLFLOW_FAILED", None
    EXPORT_FAILED = "EXPORT_FAILED", None
    HISTORY_NOT_MONOTONIC = "HISTORY_NOT_MONOTONIC", None
    SERVER_START_FAILED = "SERVER_START_FAILED", None
    JSON_TOO_DEEP = "JSON_TOO_DEEP", None
    JSON_DUPLICATE_KEY = "JSON_DUPLICATE_KEY", None
    ENGINE_PREPARE_FAILED = "ENGINE_PREPARE_FAILED", None
    ENGINE_START_FAILED = "ENGINE_START_FAILED", None
    ENGINE_ALREADY_RUNNING = "ENGINE_ALREADY_RUNNING", None
    ENGINE_RUN_FILE_UNREADABLE = "ENGINE_RUN_FILE_UNREADABLE", None


class FrameworkError(Exception):
    """The base of every error gym-grpc raises: a reason, a public message, an internal detail.

    `str(error)` is the public message. `detail` is for logs and never leaves the
    process; `metadata` (short strings: a tool's name, a server's name) travels in
    the ErrorInfo of a GymError."""

    reason: Reason = Reason.INTERNAL_ERROR

    def __init__(
        self,
        message: str,
        *,
        reason: Reason | None = None,
        detail: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        self.detail = detail
        self.metadata: dict[str, str] = dict(metadata or {})


class ConfigError(FrameworkError, ValueError):
    """A configuration (file, override, server config block, certificate) cannot be used;
    the message names the file or key. Reported by the command line, not over gRPC."""

    reason = Reason.CONFIG_INVALID


class OutputError(FrameworkError):
    """An output file cannot be written (a full disk, a quota, an I/O error). The run stops;
    every row written before stays, whole. Reported by the command line, not over gRPC."""

    reason = Reason.OUTPUT_NOT_WRITABLE


class OutputInUse(FrameworkError):
    """Another run is writing the same output (data/jsonl.py's `held`). Reported by the command line,
    not over gRPC."""

    reason = Reason.OUTPUT_IN_USE


class GymError(FrameworkError):
    """An error with a gRPC status code and a message meant for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        code: grpc.StatusCode | None = None,
        reason: Reason | None = None,
        detail: str | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message, reason=reason, detail=detail, metadata=metadata)
        self.field = field
        if code is not None:
            self.code = code

    def to_status(self) -> grpc.Status:
        """The rich status: code, message, an ErrorInfo with the reason and, for a field, a BadRequest."""
        return rpc_status.to_status(self.status_proto())

    def status_proto(self) -> status_pb2.Status:
        """`to_status` as a google.rpc.Status message."""
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
        info = any_pb2.Any()
        info.Pack(error_details_pb2.ErrorInfo(reason=str(self.reason), domain=DOMAIN, metadata=self.metadata))
        status.details.append(info)
        if self.field is not None:
            detail = any_pb2.Any()
            detail.Pack(
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(field=self.field, description=self.message)
                    ]
                )
            )
            status.details.append(detail)
        return status


class InvalidArgument(GymError):
    """The request is malformed; `field` names the offending field."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = Reason.REQUEST_INVALID


class TaskDataError(InvalidArgument):
    """A task's data does not hold what the environment needs (raise it from seed_session or
    verify). `key` is the path inside the row's free-form fields, such as "options[2]"."""

    reason = Reason.TASK_DATA_INVALID

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"task.data.{key}: {message}", field=f"task.data.{key}", metadata={"key": key})


class NotFound(GymError):
    """A named thing (tool, server) does not exist."""

    code = grpc.StatusCode.NOT_FOUND
    reason = Reason.TOOL_NOT_FOUND


class FailedPrecondition(GymError):
    """The call is valid but the server is not in a state to run it."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = Reason.PRECONDITION_FAILED


class IncompatibleServer(FailedPrecondition):
    """A server speaks another major version of the gym protocol (the handshake of
    AdminService.GetServerInfo said so); no call to it can be trusted."""

    reason = Reason.PROTOCOL_INCOMPATIBLE


class ToolFailed(GymError):
    """A tool raised. The message is the tool's error, meant for the model: CallTool
    answers it as the tool's output with `is_error` set, not as a status (a server
    older than that answered ABORTED, which a client reads back as ToolFailed)."""

    code = grpc.StatusCode.ABORTED
    reason = Reason.TOOL_FAILED


class VerifierFailed(GymError):
    """A verifier raised; the rollout cannot be scored."""

    code = grpc.StatusCode.INTERNAL
    reason = Reason.VERIFIER_FAILED


class AgentProcessFailed(GymError):
    """An agent server's own program (an external agent) could not start, exited with an
    error, or exited without calling the model; the message ends with what it wrote last."""

    code = grpc.StatusCode.INTERNAL
    reason = Reason.AGENT_PROCESS_FAILED


class ResourceExhausted(GymError):
    """The server is at a configured limit (such as its open sessions); the message names the knob."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.RESOURCE_EXHAUSTED


class Unavailable(GymError):
    """A server this one depends on is down or unknown."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = Reason.PEER_UNAVAILABLE


class SandboxStartFailed(Unavailable):
    """A session's sandbox could not be started (its runtime's reason in the message): the rollout fails, it is
    not scored."""

    reason = Reason.SANDBOX_START_FAILED


class Cancelled(GymError):
    """A downstream call was cancelled: by our own caller going away, or by the callee."""

    code = grpc.StatusCode.CANCELLED
    reason = Reason.CANCELLED


class OutOfFiles(GymError):
    """This process has no descriptor left for a connection or a file (EMFILE); the
    message is `open_files.explain(...)`. Said at most once a minute, not once per call."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = Reason.OUT_OF_FILES


class WeightUpdateFailed(Unavailable):
    """An engine failed a step of a weight update (ModelService.UpdateWeights); retry the same version."""

    reason = Reason.WEIGHT_UPDATE_FAILED


class WeightUpdateUnsupported(GymError):
    """A model server that cannot load weights into its engines was asked to."""

    code = grpc.StatusCode.UNIMPLEMENTED
    reason = Reason.WEIGHT_UPDATE_UNSUPPORTED


class SessionLost(FailedPrecondition):
    """A resumed rollout's environment session is gone and the environment cannot restore it."""

    reason = Reason.SESSION_LOST


class SandboxError(FailedPrecondition):
    """An operation on a session's sandbox failed: the sandbox has ended, did not answer, or the path is
    wrong (the message is the sandbox's own). Sandbox providers raise it."""

    reason = Reason.SANDBOX_FAILED


class StaleAttempt(FailedPrecondition):
    """A call from an attempt at a rollout that a later attempt has taken over."""

    reason = Reason.STALE_ATTEMPT


class ResumeUnsupported(GymError):
    """An agent asked to resume a rollout that it cannot resume."""

    code = grpc.StatusCode.UNIMPLEMENTED
    reason = Reason.RESUME_UNSUPPORTED


class DeadlineExceeded(GymError):
    """The caller's deadline ran out while a downstream call was running."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = Reason.DEADLINE_EXCEEDED


@dataclass(frozen=True)
class Failure:
    """Why a rollout (or an input line) failed: the `error` of a failures sidecar record,
    and the outcome of a failed `GymClient` rollout. One vocabulary for both."""

    #: The error's class, such as "Unavailable", "DeadlineExceeded" or "RowError".
    error_class: str
    #: The gRPC status code's name, such as "UNAVAILABLE".
    code: str
    message: str
    #: The request field at fault, when there is one.
    field: str | None = None
    #: The error's reason (docs/errors.md), such as "PEER_UNAVAILABLE".
    reason: str = Reason.UNCLASSIFIED.value

    @classmethod
    def of(cls, error: Exception) -> Failure:
        """The failure an exception stands for; one that is not a GymError is UNKNOWN."""
        if isinstance(error, GymError):
            return cls(type(error).__name__, error.code.name, error.message, error.field, str(error.reason))
        name = type(error).__name__
        reason = str(error.reason) if isinstance(error, FrameworkError) else Reason.UNCLASSIFIED.value
        return cls(name, grpc.StatusCode.UNKNOWN.name, f"{name}: {error}", getattr(error, "field", None), reason)

    def to_json(self) -> dict[str, str | None]:
        return {
            "class": self.error_class,
            "code": self.code,
            "reason": self.reason,
            "message": self.message,
            "field": self.field,
        }


class RolloutParked(FrameworkError):
    """A rollout its caller asked to park stopped at a turn boundary: `state` resumes it
    (`AgentClient.run(task, rollout_id=..., resume=state)`), on any replica of the agent."""

    reason = Reason.ROLLOUT_PARKED

    def __init__(self, rollout_id: str, state: task_pb2.RolloutState) -> None:
        super().__init__(f"rollout {rollout_id} was parked after {len(state.turns)} turns")
        self.rollout_id = rollout_id
        self.state = state


class RolloutFailed(FrameworkError):
    """The reward or tokens of a rollout that failed were asked for: it is no sample."""

    reason = Reason.ROLLOUT_FAILED

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"the rollout failed ({failure.code}: {failure.message}); check `ok` before using it")
        self.failure = failure


# Codes with which a resources server answers a tool call that the model got
# wrong (an unknown tool, arguments that do not fit): the agent shows them to
# the model as the tool's output. A tool that raised is answered OK with
# CallToolResponse.is_error; ABORTED is how servers before that said it. Any
# other code fails the rollout.
TOOL_ERROR_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED})

# The reason of a status that carries no ErrorInfo (from gRPC itself, or another
# implementation of the protocol), by its code.
_REASON_OF_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: Reason.REQUEST_INVALID,
    grpc.StatusCode.ABORTED: Reason.TOOL_FAILED,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Reason.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE: Reason.PEER_UNAVAILABLE,
    grpc.StatusCode.CANCELLED: Reason.CANCELLED,
    grpc.StatusCode.DEADLINE_EXCEEDED: Reason.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL: Reason.INTERNAL_ERROR,
}


def from_rpc_error(error: grpc.aio.AioRpcError, what: str, metadata: Mapping[str, str] | None = None) -> GymError:
    """Wrap a downstream call's failure, keeping its code, its reason and metadata and the field it
    names, naming the callee; `metadata` is added to the callee's. A call that failed because this
    process is out of descriptors is OutOfFiles."""
    if open_files.ran_out(error):
        return OutOfFiles(open_files.explain(f"calling {what}"), metadata=metadata)
    code = error.code()
    message = f"{what}: {code.name}: {error.details()}"
    field = field_of(error)
    info = error_info_of(error)
    reason = reason_of(error, info)
    kept = {**(info.metadata if info is not None else {}), **(metadata or {})}
    for cls in (
        InvalidArgument,
        NotFound,
        FailedPrecondition,
        ToolFailed,
        ResourceExhausted,
        Unavailable,
        Cancelled,
        DeadlineExceeded,
    ):
        if cls.code == code:
            return cls(message, field=field, reason=reason, metadata=kept)
    return GymError(message, field=field, code=code, reason=reason, metadata=kept)


def reason_of(error: grpc.aio.AioRpcError, info: error_details_pb2.ErrorInfo | None = None) -> Reason:
    """The reason of a failed call: its ErrorInfo's (one this version does not know is
    UNCLASSIFIED) or, for a status without one, the usual reason of its code."""
    info = info if info is not None else error_info_of(error)
    if info is None:
        return _REASON_OF_CODE.get(error.code(), Reason.UNCLASSIFIED)
    return Reason.__members__.get(info.reason, Reason.UNCLASSIFIED)  # each reason's value is its name


def _details(error: grpc.aio.AioRpcError) -> list[any_pb2.Any]:
    status = rpc_status.from_call(error)
    return [] if status is None else list(status.details)


def error_info_of(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo | None:
    """The ErrorInfo detail of a failed call, if it has one."""
    for detail in _details(error):
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    return None


def field_of(error: grpc.aio.AioRpcError) -> str | None:
    """The field a BadRequest detail of a failed call names, if any."""
    for detail in _details(error):
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                return bad.field_violations[0].field
    return None
