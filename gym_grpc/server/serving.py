"""Server bootstrap shared by every gym-grpc server.

`GymServer` is the base of the three roles: a name, a typed config, the gRPC
services it adds, and start/stop hooks. `serve()` puts one on a grpc.aio
server with the health service, server reflection and our transport options,
binds it (port 0 picks a free port, read back from the server), and
`Running.stop()` shuts it down gracefully: health goes NOT_SERVING first, then
in-flight calls get a grace period to finish. With a `metrics_port` it also
serves its Prometheus metrics over HTTP (metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import BaseModel, ConfigDict, ValidationError

from gym_grpc import errors, tracing
from gym_grpc.errors import ConfigError
from gym_grpc.rpc import event_loop, in_process, protocol, transport
from gym_grpc.rpc.registry import SERVER_ROLES, Registry
from gym_grpc.rpc.security import Security
from gym_grpc.server import admin, health, metrics, open_files, reflection
from gym_grpc.server.admin import ADMIN_SERVICE, AdminServicer
from gym_grpc.server.counters import Counters
from gym_grpc.server.health import HealthServicer
from gym_grpc.server.profiling import Profiler
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc
from gym_grpc.v1 import registry_service_pb2 as reg

log = logging.getLogger("gym_grpc")

#: Seconds in-flight calls get to finish after a stop is requested.
DEFAULT_GRACE_SECONDS = 10.0


class ServerConfig(BaseModel):
    """Base of a server's own config (the `config:` block of its entry)."""

    model_config = ConfigDict(extra="forbid")


class GymServer:
    """Base of every gym-grpc server. Subclass one of the role bases instead."""

    role: ClassVar[reg.ServerRole.ValueType] = reg.SERVER_ROLE_UNSPECIFIED
    Config: ClassVar[type[ServerConfig]] = ServerConfig
    #: Why the server must run in one process, when it must: its state outside sessions (a task
    #: server's draws and pools) would split between worker processes or replicas, each serving
    #: part of the calls from a state of its own. `gym-grpc run` keeps such a server out of process
    #: groups and refuses num_workers or replicas above 1 for it. None: any number of processes.
    one_process: ClassVar[str | None] = None

    @classmethod
    def check_processes(cls, name: str, count: int, setting: str) -> None:
        """ConfigError when `count` processes (`setting`: num_workers, replicas) would serve server
        `name` and its class must run in one."""
        if cls.one_process and count > 1:
            raise ConfigError(
                f"server {name!r}: {setting} is {count}, but {cls.__name__} runs in one process: {cls.one_process}"
            )

    def __init__(
        self,
        config: ServerConfig | dict[str, Any] | None = None,
        *,
        name: str | None = None,
        registry: Registry | None = None,
    ) -> None:
        self.name = name or type(self).__name__
        self.config = config if isinstance(config, ServerConfig) else self.checked_config(config, self.name)
        self.registry = registry or Registry()
        self.counters = Counters()
        self.profiler = Profiler()
        #: What it runs, for AdminService.GetServerInfo (the worker sets the configured string).
        self.entrypoint = f"{type(self).__module__}:{type(self).__qualname__}"
        #: Random id of this instance (AdminService.GetServerInfo.instance_id).
        self.instance_id = uuid.uuid4().hex
        #: When it is one of several replicas or worker processes of a server, the address
        #: that reaches this process alone: a resources server's sessions are pinned to it
        #: (SeedSessionResponse.replica). Empty for a server of one process.
        self.replica = ""
        #: Index of this process among its server's workers (num_workers), from 0.
        self.worker = 0
        #: "host:port" of its Prometheus endpoint; empty while it serves none.
        self.metrics_address = ""
        #: Set when it starts to stop: it finishes what it is doing and takes on nothing new.
        self.stopping = asyncio.Event()

    @classmethod
    def checked_config(cls, config: dict[str, Any] | None, name: str) -> ServerConfig:
        """The `config:` block of server `name` as this class's Config; ConfigError naming
        each wrong key (with the nearest known one for a mistyped key) when it does not fit."""
        try:
            return cls.Config.model_validate(config or {})
        except ValidationError as e:
            raise ConfigError(_describe_validation(name, e, cls.Config)) from None

    def references(self) -> dict[str, str]:
        """Names of the servers this one calls, by role (for the registry)."""
        return {}

    def add_services(self, server: grpc.aio.Server) -> list[str]:
        """Add this server's gRPC services; return their full names."""
        raise NotImplementedError

    def capabilities(self) -> admin_pb.Capabilities:
        """What this server's methods can do, for the handshake (AdminService.GetServerInfo).
        A role or a server adds what it declares, such as a model server's token ids."""
        return protocol.base_capabilities()

    async def start(self) -> None:
        """Hook: acquire resources (pools, channels) before serving."""

    async def stop(self) -> None:
        """Hook: release them after the last call finished."""
        await self.registry.close()


def _describe_validation(name: str, error: ValidationError, model: type[BaseModel]) -> str:
    problems = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(config)"
        problem = f"config.{where}: {e['msg']}"
        if e["type"] == "extra_forbidden" and len(e["loc"]) == 1:
            near = difflib.get_close_matches(str(e["loc"][0]), list(model.model_fields), n=1, cutoff=0.75)
            problem += f" (did you mean {near[0]!r}?)" if near else ""
        problems.append(problem)
    return f"server {name!r}: " + "; ".join(problems)


H = TypeVar("H", bound=Callable[..., Any])


class _Call:
    """One call as the log and the counters see it.

    Everything it needs from the call's context is read when the call starts:
    touching a grpc.aio context after its call has ended (client cancel,
    deadline, client death) can crash the process."""

    __slots__ = ("app", "method", "peer", "deadline", "began", "status", "detail", "out_of_files", "ended", "metadata")

    def __init__(self, app: GymServer, method: str, context: grpc.aio.ServicerContext) -> None:
        self.app, self.method = app, method
        self.peer = context.peer()
        #: What the call's metadata says, when tracing: the trace it belongs to.
        self.metadata = context.invocation_metadata() or () if tracing.active() else ()
        remaining = context.time_remaining()
        self.deadline = None if remaining is None else time.monotonic() + remaining
        self.began = app.counters.begin(method)
        self.status, self.detail = "OK", ""
        self.out_of_files = False
        self.ended = False

    async def fail(self, error: BaseException, context: grpc.aio.ServicerContext) -> NoReturn:
        """Turn what the handler raised into the call's status; always raises."""
        if isinstance(error, errors.GymError):
            self.status, self.detail = error.code.name, error.message
            if error.detail:  # the internal detail: for the log, never the wire
                self.detail = f"{error.message} ({error.detail})"
            self.out_of_files = isinstance(error, errors.OutOfFiles)
            self.end()  # before the status goes out: once the caller has it, the log has the line
            await context.abort_with_status(error.to_status())
        if isinstance(error, grpc.aio.AbortError):
            raise error
        if not isinstance(error, Exception):  # cancelled, or a stream closed early
            expired = self.deadline is not None and time.monotonic() >= self.deadline
            self.status = "DEADLINE_EXCEEDED" if expired else "CANCELLED"
            raise error
        self.status, self.detail = "INTERNAL", f"{type(error).__name__}: {error}"
        log.error("%s failed", self.method, exc_info=error)
        self.end()
        bug = errors.GymError(
            f"internal error in {self.method}: {type(error).__name__} (details in the server log)",
            metadata={"method": self.method, "server": self.app.name},
        )
        await context.abort_with_status(bug.to_status())
        raise AssertionError("abort returned")

    def end(self) -> None:
        """Count the call and log it if it failed; once, whichever of fail() and the handler's end comes first."""
        if self.ended:
            return
        self.ended = True
        seconds = self.app.counters.end(self.method, self.began, self.status)
        if self.status != "OK" and (not self.out_of_files or open_files.time_to_say()):
            level = logging.INFO if self.status in _CALLER_FAULTS else logging.WARNING
            log.log(
                level,
                "%s %s from %s after %.1f ms: %s",
                self.method,
                self.status,
                self.peer,
                1000 * seconds,
                self.detail,
            )


def rpc_method(handler: H) -> H:
    """Wrap a servicer method (a coroutine, or an async generator for a stream):
    errors become statuses, the deadline propagates, the call is counted and logged.

    A `GymError` aborts the call with its code and public message. Any other
    exception is a bug: logged with its traceback, reported as INTERNAL with
    the exception's class only. A call that ends because its deadline passed
    counts as DEADLINE_EXCEEDED, one the client gave up on as CANCELLED.
    """
    method = handler.__name__.lstrip("_")

    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext, *rest: Any) -> Any:
            call = _Call(self.app, method, context)
            # Not reset: the stream may be closed from another task, and each call
            # runs in its own task, whose context dies with it.
            transport.set_deadline(context.time_remaining())
            with _traced(self, method, call) as span:
                try:
                    async for reply in handler(self, request, context, *rest):
                        yield reply
                except BaseException as e:
                    await call.fail(e, context)
                finally:
                    call.end()
                    tracing.call_ended(span, call.status, call.detail)

        return stream  # type: ignore[return-value]

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext, *rest: Any) -> Any:
        call = _Call(self.app, method, context)
        token = transport.set_deadline(context.time_remaining())
        with _traced(self, method, call) as span:
            try:
                return await handler(self, request, context, *rest)
            except BaseException as e:
                await call.fail(e, context)
            finally:
                transport.reset_deadline(token)
                call.end()
                tracing.call_ended(span, call.status, call.detail)

    return unary  # type: ignore[return-value]


# Calls that are no span of their own: each run of a RunMany call is one (its Run handler's),
# in the trace the run carries; the call, open for many rollouts, belongs to none of them.
_UNTRACED = frozenset({"RunMany"})


def _traced(servicer: Any, method: str, call: _Call) -> contextlib.AbstractContextManager[Any]:
    """The SERVER span of a call (nothing when tracing is off), in the trace its metadata carries."""
    if not tracing.active() or method in _UNTRACED:
        return tracing.OFF
    service = _service_of(servicer.__class__)
    return tracing.server_call(f"{service}/{method}", call.metadata, servicer.app.name)


@functools.cache
def _service_of(servicer: Any) -> str:
    """The full name of the gRPC service a servicer class serves ("gym.v1.AgentService"): the
    generated base it extends is named for it."""
    for base in servicer.__mro__:
        if base.__module__.startswith("gym_grpc.v1.") and base.__name__.endswith("Servicer"):
            return f"gym.v1.{base.__name__.removesuffix('Servicer')}"
    return servicer.__name__


# Failures that come from the caller's request (or the model's tool call), not the server.
_CALLER_FAULTS = frozenset(
    {"INVALID_ARGUMENT", "NOT_FOUND", "ABORTED", "FAILED_PRECONDITION", "CANCELLED", "DEADLINE_EXCEEDED"}
)


class _Corrupt:
    """What a request that does not parse becomes, so that the call can say so."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _guarded(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # protobuf's DecodeError and friends
            return _Corrupt(e)

    return deserialize


def _not_parsable_error(method: str, error: Exception) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"{method}: the request is not a valid message: {error}", reason=errors.Reason.REQUEST_NOT_PARSABLE
    )


class _DecodeGuard(grpc.aio.ServerInterceptor):
    """A request whose bytes do not parse gets INVALID_ARGUMENT (grpcio would say UNKNOWN).

    The last interceptor, so a method's handler never changes: it is wrapped once."""

    def __init__(self) -> None:
        self._wrapped: dict[str, Any] = {}

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        wrapped = self._wrapped.get(details.method)
        if wrapped is None:
            handler = await continuation(details)
            if handler is None:
                return None
            wrapped = self._wrapped[details.method] = self._wrap(details.method, handler)
        return wrapped

    @staticmethod
    def _wrap(method: str, handler: Any) -> Any:
        if handler.request_deserializer is None:
            return handler
        if handler.request_streaming:
            if not handler.response_streaming:
                return handler  # no such method in gym.v1

            async def checked_requests(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, _Corrupt):
                        raise _not_parsable_error(method, request.error)
                    yield request

            async def checked_bidi(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                async for reply in handler.stream_stream(checked_requests(requests), context):
                    yield reply

            return grpc.stream_stream_rpc_method_handler(
                checked_bidi, _guarded(handler.request_deserializer), handler.response_serializer
            )
        behaviour = handler.unary_unary or handler.unary_stream

        async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Corrupt):
                await context.abort_with_status(_not_parsable_error(method, request.error).to_status())
            return await behaviour(request, context)

        async def checked_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Corrupt):
                await context.abort_with_status(_not_parsable_error(method, request.error).to_status())
            async for reply in behaviour(request, context):
                yield reply

        deserialize = _guarded(handler.request_deserializer)
        if handler.unary_stream:
            # A streaming handler is an async generator or a coroutine that writes; keep its kind.
            wrapped = checked_stream if inspect.isasyncgenfunction(behaviour) else checked
            return grpc.unary_stream_rpc_method_handler(wrapped, deserialize, handler.response_serializer)
        return grpc.unary_unary_rpc_method_handler(checked, deserialize, handler.response_serializer)


class _EndedCallWrites(logging.Filter):
    """grpc logs an ERROR with a traceback when a stream's next reply is written
    after its call ended (the deadline passed in between). The call's end is
    already counted and logged by rpc_method; the traceback is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("ExecuteBatchError raised in core")


_GRPC_CORE_LOG = logging.getLogger("grpc._cython.cygrpc")
_GRPC_CORE_LOG.addFilter(_EndedCallWrites())


class Running:
    """A server that is up: its bound port, and how to stop it."""

    def __init__(
        self,
        server: grpc.aio.Server,
        app: GymServer,
        health_servicer: HealthServicer,
        host: str,
        port: int,
        metrics_endpoint: metrics.Endpoint | None = None,
        in_process_server: in_process.InProcessServer | None = None,
        own_port: int = 0,
    ) -> None:
        self.server = server
        self.app = app
        self.health = health_servicer
        self.host = host
        self.port = port
        #: Its Prometheus endpoint, when it serves one.
        self.metrics = metrics_endpoint
        #: Its unary methods, for callers in this process (a `process:` group).
        self.in_process = in_process_server or in_process.InProcessServer()
        #: The port it serves alone when it shares `port` with other workers (0 otherwise).
        self.own_port = own_port
        self._stopped = self._released = False

    @property
    def address(self) -> str:
        """The "host:port" to reach it."""
        return f"{self.host}:{self.port}"

    async def stop(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        """Go NOT_SERVING, let in-flight calls finish within `grace` s, then close."""
        await self.stop_serving(grace)
        await self.release()

    async def stop_serving(self, grace: float = DEFAULT_GRACE_SECONDS) -> None:
        """Go NOT_SERVING and let in-flight calls finish within `grace` s; the app keeps what it
        holds, for the in-process calls of other servers that are still finishing theirs."""
        if self._stopped:
            return
        self._stopped = True
        self.app.stopping.set()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def release(self) -> None:
        """After `stop_serving`: the app releases what it holds, the profiler and metrics stop."""
        if self._released:
            return
        self._released = True
        await self.app.stop()
        self.app.profiler.stop()
        if self.metrics is not None:
            await self.metrics.stop()


async def serve(
    app: GymServer,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    reuse_port: bool = False,
    security: Security | None = None,
    metrics_port: int | None = None,
) -> Running:
    """Start `app` on host:port (0: any free port) and return once it serves.

    `reuse_port` lets several processes serve the same port (num_workers): each
    then also serves a port of its own (`Running.own_port`), which becomes its
    `replica` address, so that the calls of a session it opened come back to it;
    `security` adds TLS and the bearer token check; `metrics_port` serves its
    Prometheus metrics over HTTP on that port of `host` (0: any free port)."""
    security = security or Security()
    server = grpc.aio.server(
        options=transport.server_options(reuse_port=reuse_port),
        interceptors=[*security.server_interceptors(), _DecodeGuard()],
    )
    recorder = in_process.Recorder(server)
    names = [*app.add_services(recorder), ADMIN_SERVICE]
    served = [*names, health.SERVICE_NAME, *reflection.SERVICE_NAMES]
    described = reflection.add_to_server(served, server)
    admin_grpc.add_AdminServiceServicer_to_server(AdminServicer(app, protocol.served(served, described)), server)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = security.server_credentials()
    bound = _bind(server, app, host, port, credentials)
    # With its port shared, the kernel gives each connection to any of the processes: the calls of a
    # session must reach the one that holds it, on a port it serves alone (port 0 never lands on a
    # port other sockets share, even with SO_REUSEPORT set).
    own = _bind(server, app, host, 0, credentials) if reuse_port else 0
    if own:
        app.replica = f"{transport.reachable_host(host)}:{own}"
        recorder.in_process.replica = app.replica
    endpoint = None
    if metrics_port is not None:
        labels = {"role": SERVER_ROLES.get(app.role, "?"), "worker": app.worker, "version": admin.VERSION}
        endpoint = metrics.serve(app, host, metrics_port, labels)
        app.metrics_address = endpoint.address
    app.profiler.start()
    try:
        await app.start()
        await server.start()
    except BaseException:
        if endpoint is not None:  # its thread would outlive a server that never served
            await endpoint.stop()
        raise
    for name in ["", *names]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    serving_metrics = f", metrics on http://{endpoint.address}{metrics.PATH}" if endpoint else ""
    log.info("%s serving on %s:%d%s", app.name, host, bound, serving_metrics)
    return Running(server, app, health_servicer, host, bound, endpoint, recorder.in_process, own)


def _bind(
    server: grpc.aio.Server, app: GymServer, host: str, port: int, credentials: grpc.ServerCredentials | None
) -> int:
    """Add host:port to `server`; the port bound (OSError naming the server when it cannot)."""
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise OSError(f"server {app.name!r} could not bind {host}:{port} (in use?)")
    return bound


async def serve_until_signalled(
    app: GymServer,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    grace: float = DEFAULT_GRACE_SECONDS,
    on_ready: Callable[[Running], None] | None = None,
    stop_event: asyncio.Event | None = None,
    reuse_port: bool = False,
    security: Security | None = None,
    metrics_port: int | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (or `stop_event`), then stop gracefully. A signal while the
    server starts (a model loading for minutes) cancels its start, whose own clean-up runs."""
    stop = stop_event or asyncio.Event()
    event_loop.stop_on_signals(stop)
    starting = asyncio.ensure_future(
        serve(app, host, port, reuse_port=reuse_port, security=security, metrics_port=metrics_port)
    )
    if await event_loop.stopped_first(starting, stop):
        log.info("%s stopped before it served", app.name)
        return
    running = starting.result()
    if on_ready is not None:
        on_ready(running)
    await stop.wait()
    log.info("%s stopping (grace %.0f s)", app.name, grace)
    await running.stop(grace)
