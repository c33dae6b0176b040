"""The error catalogue: every error a gym-grpc server reports, in one place.

A handler raises one of these; the servicer plumbing (`serving.rpc_method`)
turns it into a gRPC status with its public message. Anything else that
escapes a handler is a bug: it is logged with its traceback and the caller
sees INTERNAL with the exception's class, never the internal detail.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from gym_grpc.server import open_files


class ConfigError(ValueError):
    """A configuration (file, override, server config block, certificate) cannot be used;
    the message names the file or key. Reported by the command line, not over gRPC."""


class OutputError(Exception):
    """An output file cannot be written (a full disk, a quota, an I/O error). The run stops;
    every row written before stays, whole. Reported by the command line, not over gRPC."""


class GymError(Exception):
    """An error with a gRPC status code and a message meant for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, field: str | None = None, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        if code is not None:
            self.code = code

    def to_status(self) -> grpc.Status:
        """The rich status: code, message and, for a field, a BadRequest detail."""
        status = status_pb2.Status(code=self.code.value[0], message=self.message)
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
        return rpc_status.to_status(status)


class InvalidArgument(GymError):
    """The request is malformed; `field` names the offending field."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class TaskDataError(InvalidArgument):
    """A task's data does not hold what the environment needs (raise it from seed_session or
    verify). `key` is the path inside the row's free-form fields, such as "options[2]"."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"task.data.{key}: {message}", field=f"task.data.{key}")


class NotFound(GymError):
    """A named thing (tool, server) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(GymError):
    """The call is valid but the server is not in a state to run it."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class IncompatibleServer(FailedPrecondition):
    """A server speaks another major version of the gym protocol (the handshake of
    AdminService.GetServerInfo said so); no call to it can be trusted."""


class ToolFailed(GymError):
    """A tool raised. The message is the tool's error, meant for the model."""

    code = grpc.StatusCode.ABORTED


class VerifierFailed(GymError):
    """A verifier raised; the rollout cannot be scored."""

    code = grpc.StatusCode.INTERNAL


class ResourceExhausted(GymError):
    """The server is at a configured limit (such as its open sessions); the message names the knob."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(GymError):
    """A server this one depends on is down or unknown."""

    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(GymError):
    """A downstream call was cancelled: by our own caller going away, or by the callee."""

    code = grpc.StatusCode.CANCELLED


class OutOfFiles(GymError):
    """This process has no descriptor left for a connection or a file (EMFILE); the
    message is `open_files.explain(...)`. Said at most once a minute, not once per call."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(GymError):
    """The caller's deadline ran out while a downstream call was running."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


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

    @classmethod
    def of(cls, error: Exception) -> Failure:
        """The failure an exception stands for; one that is not a GymError is UNKNOWN."""
        if isinstance(error, GymError):
            return cls(type(error).__name__, error.code.name, error.message, error.field)
        name = type(error).__name__
        return cls(name, grpc.StatusCode.UNKNOWN.name, f"{name}: {error}", getattr(error, "field", None))

    def to_json(self) -> dict[str, str | None]:
        return {"class": self.error_class, "code": self.code, "message": self.message, "field": self.field}


class RolloutFailed(Exception):
    """The reward or tokens of a rollout that failed were asked for: it is no sample."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"the rollout failed ({failure.code}: {failure.message}); check `ok` before using it")
        self.failure = failure


# Codes with which a resources server answers a tool call that the model got
# wrong or that the tool refused: the agent shows them to the model as the
# tool's output. Any other code fails the rollout.
TOOL_ERROR_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ABORTED})


def from_rpc_error(error: grpc.aio.AioRpcError, what: str) -> GymError:
    """Wrap a downstream call's failure, keeping its code and the field it names, naming the callee.
    A call that failed because this process is out of descriptors is OutOfFiles."""
    if open_files.ran_out(error):
        return OutOfFiles(open_files.explain(f"calling {what}"))
    code = error.code()
    message = f"{what}: {code.name}: {error.details()}"
    field = field_of(error)
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
            return cls(message, field=field)
    return GymError(message, field=field, code=code)


def field_of(error: grpc.aio.AioRpcError) -> str | None:
    """The field a BadRequest detail of a failed call names, if any."""
    status = rpc_status.from_call(error)
    if status is None:
        return None
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations:
                return bad.field_violations[0].field
    return None
