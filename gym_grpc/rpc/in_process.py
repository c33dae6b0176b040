"""Calls between servers that share a process, without gRPC.

Servers named in one `process:` group of a configuration run in one worker
process (see launch/runner.py). Each still serves its own gRPC port for every
other caller, but the typed clients of that process call a server of the group
through its `InProcessServer`: the same handler a gRPC call reaches, with no
HTTP/2, no C-core and no hop through the event loop's socket.

What a call keeps from gRPC, so that caller and callee cannot tell the
difference except by speed:

* the request and the reply are copied through their wire form (the handler's
  own deserializer and serializer), so the two sides share no object, and
  unknown fields travel as they would;
* the deadline: the handler sees the time left (`time_remaining`) and is
  cancelled when it passes; the caller gets DEADLINE_EXCEEDED;
* errors: an aborted call raises the same `grpc.aio.AioRpcError`, status
  details (ErrorInfo, BadRequest) included, that the wire would have given;
* the handler runs in a task of its own with an empty context: context
  variables of the caller (a rollout's policy version, its deadline, its
  trace) do not leak into it, as they would not cross a process. A cancelled
  caller cancels it;
* metadata: what the caller sends (a trace's `traceparent`) is what the
  handler's `invocation_metadata()` gives.

What it leaves out: interceptors (the bearer token check and TLS concern
callers from outside the process), and the message size limit.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import grpc

#: What an in-process call's handler sees as its peer.
PEER = "in-process"


class InProcessServer:
    """The unary methods of one server, by full method path ("/gym.v1.ModelService/CreateResponse")."""

    def __init__(self) -> None:
        self.methods: dict[str, grpc.RpcMethodHandler] = {}
        #: The address that reaches this process's server alone (GymServer.replica), when it
        #: has one: calls pinned there (a session's) are in-process too.
        self.replica = ""

    async def call(
        self, path: str, request: Any, timeout: float | None, metadata: Sequence[tuple[str, str]] | None = None
    ) -> Any:
        """Call method `path` with a copy of `request` (and `metadata`); a copy of its reply.
        Failures raise `grpc.aio.AioRpcError` as a gRPC call would."""
        handler = self.methods.get(path)
        if handler is None:
            raise status_error(grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {path}")
        copied = handler.request_deserializer(request.SerializeToString())
        reply = await invoke(handler.unary_unary, copied, timeout, metadata=metadata)
        return type(reply).FromString(handler.response_serializer(reply))


async def invoke(
    behaviour: Callable[[Any, Any], Coroutine[Any, Any, Any]],
    request: Any,
    timeout: float | None,
    peer: str = PEER,
    *,
    metadata: Sequence[tuple[str, str]] | None = None,
) -> Any:
    """Run a unary handler (`behaviour(request, context)`) as gRPC would run it for a call
    from `peer` with `timeout` and `metadata`: in a task of its own with an empty context,
    cancelled when the deadline passes. Its reply, or the `grpc.aio.AioRpcError` the call
    would have ended with."""
    context = _Context(timeout, peer, metadata)
    try:
        async with asyncio.timeout(timeout) as deadline:  # None: no deadline
            return await asyncio.get_running_loop().create_task(
                behaviour(request, context), context=contextvars.Context()
            )
    except grpc.aio.AbortError:
        raise context.failure() from None
    except TimeoutError:
        if deadline.expired():
            raise status_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        raise context.failure(grpc.StatusCode.UNKNOWN, "Unexpected TimeoutError") from None
    except Exception as e:  # what gRPC makes of an exception the handler let out
        raise context.failure(grpc.StatusCode.UNKNOWN, f"Unexpected {type(e).__name__}: {e}") from None


class Recorder:
    """Stands in for a `grpc.aio.Server` while a server adds its services: passes every
    call on to the real server and keeps the unary handlers in an `InProcessServer`."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self.in_process = InProcessServer()

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(service, handlers)
        for method, handler in handlers.items():
            if handler.unary_unary is not None:
                self.in_process.methods[f"/{service}/{method}"] = handler

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class _Aborted(grpc.aio.AbortError):
    """What `abort` raises in an in-process call, as grpc.aio raises AbortError."""


class _Context:
    """The part of `grpc.aio.ServicerContext` that handlers use, for one in-process call."""

    def __init__(
        self, timeout: float | None, peer: str = PEER, metadata: Sequence[tuple[str, str]] | None = None
    ) -> None:
        self._peer = peer
        self._metadata = tuple(metadata or ())
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: tuple[tuple[str, str | bytes], ...] = ()

    def peer(self) -> str:
        return self._peer

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(self._deadline - time.monotonic(), 0.0)

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def cancelled(self) -> bool:
        return False

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        self._trailing = tuple(metadata)

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Sequence[tuple[str, str | bytes]] = ()
    ) -> None:
        self._code, self._details, self._trailing = code, details, tuple(trailing_metadata)
        raise _Aborted()

    async def abort_with_status(self, status: grpc.Status) -> None:
        await self.abort(status.code, status.details, status.trailing_metadata)

    def failure(self, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN, details: str = "") -> grpc.aio.AioRpcError:
        """The error the caller gets: the status the handler set, else `code` and `details`."""
        if self._code is None:
            return status_error(code, details)
        return status_error(self._code, self._details, self._trailing)


def status_error(
    code: grpc.StatusCode, details: str, trailing: Sequence[tuple[str, str | bytes]] = ()
) -> grpc.aio.AioRpcError:
    """The error of a call that ended with this status (and this trailing metadata)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)
