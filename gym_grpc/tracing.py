"""OpenTelemetry traces: one trace per rollout, across every process it passes through.

Off unless `OTEL_TRACES_EXPORTER` names an exporter (`otlp`, `console`, or any installed under
the `opentelemetry_traces_exporter` entry points) and `OTEL_SDK_DISABLED` is not `true`. Off,
nothing here imports OpenTelemetry, and every function is a check of one flag: the SDK is an
optional dependency (`pip install 'gym-grpc[tracing]'`). On, a process of gym-grpc (a server of
`gym-grpc run`, `gym-grpc collect`, a `GymClient`) sets the SDK up the standard way from the
`OTEL_*` variables (`configure`): the exporter, its endpoint and protocol
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_PROTOCOL`...), the sampler
(`OTEL_TRACES_SAMPLER`), the propagators (`OTEL_PROPAGATORS`), the batch processor
(`OTEL_BSP_*`), `OTEL_SERVICE_NAME` and `OTEL_RESOURCE_ATTRIBUTES`. A program that has set a
tracer provider of its own keeps it.

The trace of a rollout (names and attributes: docs/observability.md#traces):

    rl.sample                          the client: collect, GymClient (root)
      gym_grpc.queue_wait              waiting for the client's in-flight window
      gym.v1.AgentService/Run          the agent (a SERVER span; every call a server handles is one)
        gym.v1.ResourcesService/SeedSession
        chat MODEL                     each model call, with its token counts
          gym.v1.ModelService/CreateResponse
            POST /v1/chat/completions  the model server's request to its engine (traceparent sent)
        execute_tool TOOL              each tool call
          gym.v1.ResourcesService/CallTool
        gym_grpc.verify                the verification, with the reward
          gym.v1.ResourcesService/Verify

The context crosses processes as W3C Trace Context (`traceparent`): gRPC metadata on every call
of the typed clients (client/stubs.py), the `trace_context` of each run on a RunMany call (whose
runs belong to different traces, so the call's own metadata cannot carry it), HTTP headers to an
engine. In-process calls (a `process:` group) carry it as the metadata they hand the handler.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger("gym_grpc.tracing")

#: The instrumentation scope of every span gym-grpc makes.
SCOPE = "gym_grpc"

#: What a span of a switched-off tracer is: nothing.
OFF: contextlib.nullcontext[None] = contextlib.nullcontext()


def _wanted() -> bool:
    """Whether the environment asks for traces (see the module's docstring)."""
    exporters = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    disabled = os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    return bool(exporters) and exporters != "none" and not disabled


class _State:
    """Whether this process traces, and with what."""

    def __init__(self) -> None:
        self.on = _wanted()
        #: The program gave its own provider (`use_provider`): nothing to set up.
        self.given = False
        self._tracer: Tracer | None = None
        #: The provider `configure` made (and shuts down), when it made one.
        self.provider: Any = None

    @property
    def tracer(self) -> Tracer:
        if self._tracer is None:
            from opentelemetry import trace

            self._tracer = trace.get_tracer(SCOPE)
        return self._tracer


_state = _State()


def active() -> bool:
    """Whether this process makes spans."""
    return _state.on


def configure(service_name: str, **resource: str | int) -> None:
    """Set the OpenTelemetry SDK up from the `OTEL_*` variables for a process of gym-grpc, when
    tracing is on and the process has no tracer provider yet: `service_name` unless
    OTEL_SERVICE_NAME says otherwise, `resource` added to its resource attributes. The provider
    is shut down (its last spans sent) at exit, or by `shutdown`."""
    if not _wanted() or _state.given or _state.provider is not None:
        return
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return  # the program set one up itself
    attributes: dict[str, str | int] = {"process.pid": os.getpid(), **resource}
    if not os.environ.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = service_name
    provider = TracerProvider(resource=Resource.create(attributes))  # the sampler from OTEL_TRACES_SAMPLER
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))  # OTEL_BSP_* settings
    trace.set_tracer_provider(provider)
    _state.provider = provider
    atexit.register(shutdown)


def _exporters() -> list[Any]:
    """The exporters OTEL_TRACES_EXPORTER names, as the OpenTelemetry SDK reads it: `otlp` is
    OTLP over gRPC, or over HTTP when OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL is `http/protobuf`;
    each name is looked up among the `opentelemetry_traces_exporter` entry points."""
    from importlib.metadata import entry_points

    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip()
    by_protocol = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
    exporters = []
    for name in os.environ.get("OTEL_TRACES_EXPORTER", "").split(","):
        name = name.strip()
        if name == "otlp":
            if protocol not in by_protocol:
                raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL: {protocol!r} is not one of {', '.join(by_protocol)}")
            name = by_protocol[protocol]
        found = entry_points(group="opentelemetry_traces_exporter", name=name)
        if not found:
            raise ValueError(
                f"OTEL_TRACES_EXPORTER: no exporter {name!r} is installed (pip install 'gym-grpc[tracing]' "
                "brings otlp and console)"
            )
        exporters.append(next(iter(found)).load()())
    return exporters


def shutdown() -> None:
    """Send the spans not sent yet and stop the provider `configure` made (nothing otherwise)."""
    provider, _state.provider = _state.provider, None
    if provider is not None:
        provider.shutdown()


def use_provider(provider: Any | None) -> None:
    """Trace with `provider` (a TracerProvider: a program's own, a test's in-memory exporter),
    whatever the environment says; None goes back to what the environment says."""
    _state.on = provider is not None or _wanted()
    _state.given = provider is not None
    _state._tracer = provider.get_tracer(SCOPE) if provider is not None else None


# --- propagation -------------------------------------------------------------------------------


def carrier() -> dict[str, str]:
    """The current trace context as W3C Trace Context entries (`traceparent`...); {} when off."""
    if not _state.on:
        return {}
    from opentelemetry import propagate

    out: dict[str, str] = {}
    propagate.inject(out)
    return out


def outgoing() -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying the current trace context to the server of a call; None when off."""
    if not _state.on:
        return None
    return tuple(carrier().items()) or None


def _context_of(metadata: Sequence[Any]) -> Any:
    from opentelemetry import propagate

    return propagate.extract({key: value for key, value in metadata if isinstance(value, str)})


# --- spans -------------------------------------------------------------------------------------


def server_call(method: str, metadata: Sequence[Any], server: str) -> contextlib.AbstractContextManager[Span | None]:
    """The SERVER span of a call a gym-grpc server handles (`method`: "gym.v1.AgentService/Run"),
    in the trace its `metadata` carries (a root without one); set `call_ended` when it ends."""
    if not _state.on:
        return OFF
    from opentelemetry.trace import SpanKind

    service, _, name = method.rpartition("/")
    return _state.tracer.start_as_current_span(
        method,
        context=_context_of(metadata),
        kind=SpanKind.SERVER,
        attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": name, "gym_grpc.server": server},
        record_exception=False,
        set_status_on_exception=False,
    )


def call_ended(span: Span | None, status: str, detail: str = "") -> None:
    """A server call ended with gRPC status `status` ("OK", "INVALID_ARGUMENT"...)."""
    if span is None:
        return
    import grpc
    from opentelemetry.trace import StatusCode

    span.set_attribute("rpc.grpc.status_code", grpc.StatusCode[status].value[0])
    if status != "OK":
        span.set_status(StatusCode.ERROR, f"{status}: {detail}" if detail else status)


@contextlib.contextmanager
def _span(name: str, kind: str, attributes: Mapping[str, Any]) -> Iterator[Span]:
    """A span that is current inside the block; an exception that leaves it marks it failed with
    its class and message (cancellations too: a rollout cut off by its deadline shows where)."""
    from opentelemetry.trace import SpanKind

    with _state.tracer.start_as_current_span(
        name, kind=SpanKind[kind], attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        try:
            yield span
        except BaseException as e:
            failed(span, e)
            raise


def failed(span: Span | None, error: BaseException) -> None:
    """Mark `span` failed with `error` (its class as error.type, its message as the status)."""
    if span is None:
        return
    from opentelemetry.trace import StatusCode

    span.set_attribute("error.type", getattr(error, "reason", None) or type(error).__name__)
    span.set_status(StatusCode.ERROR, str(getattr(error, "message", None) or error or type(error).__name__))


def model_call(model: str, session_id: str, turn: int) -> contextlib.AbstractContextManager[Span | None]:
    """An agent's call to its model server (a gen_ai `chat` client span); `model_answered` adds the answer."""
    if not _state.on:
        return OFF
    attributes = {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "gym_grpc",
        "gen_ai.request.model": model,
        "gen_ai.conversation.id": session_id,
        "gym_grpc.turn": turn,
    }
    return _span(f"chat {model}" if model else "chat", "CLIENT", attributes)


def model_answered(span: Span | None, response: Any) -> None:
    """What a model call answered (a gym.v1 Response): its model, id, status and token counts."""
    if span is None:
        return
    usage = response.usage
    span.set_attributes(
        {
            "gen_ai.response.model": response.model,
            "gen_ai.response.id": response.id,
            "gen_ai.response.finish_reasons": [_finish_reason(response)],
            "gen_ai.usage.input_tokens": usage.input_tokens,
            "gen_ai.usage.output_tokens": usage.output_tokens,
        }
    )


def _finish_reason(response: Any) -> str:
    from gym_grpc.v1 import responses_pb2 as r

    if response.status == r.RESPONSE_STATUS_INCOMPLETE:
        return response.incomplete_details.reason or "incomplete"
    return "tool_calls" if any(item.HasField("function_call") for item in response.output) else "stop"


def tool_call(name: str, call_id: str, turn: int) -> contextlib.AbstractContextManager[Span | None]:
    """An agent's tool call (a gen_ai `execute_tool` span); `tool_answered` adds how it went."""
    if not _state.on:
        return OFF
    attributes = {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": name,
        "gen_ai.tool.call.id": call_id,
        "gen_ai.tool.type": "function",
        "gym_grpc.turn": turn,
    }
    return _span(f"execute_tool {name}", "INTERNAL", attributes)


def tool_answered(span: Span | None, error: bool, reason: str | None) -> None:
    """A tool call ended; `error`: its output is an error for the model (TOOL_FAILED, ...)."""
    if span is None or not error:
        return
    from opentelemetry.trace import StatusCode

    span.set_attribute("error.type", reason or "TOOL_FAILED")
    span.set_status(StatusCode.ERROR, reason or "TOOL_FAILED")


def verification(environment: str) -> contextlib.AbstractContextManager[Span | None]:
    """An agent's verification of a rollout; `verified` adds the reward."""
    if not _state.on:
        return OFF
    return _span("gym_grpc.verify", "INTERNAL", {"gym_grpc.environment": environment})


def verified(span: Span | None, reward: float) -> None:
    if span is not None:
        span.set_attribute("rl.reward.score", reward)


def engine_request(method: str, url: str, path: str, model: str) -> contextlib.AbstractContextManager[Span | None]:
    """A model server's request to its engine: an HTTP client span ("POST /v1/completions"), or with
    no `method` a gRPC one (`path` the method); `engine_headers` are
    the headers that carry the trace to it, `engine_answered` what it said."""
    if not _state.on:
        return OFF
    if method:
        attributes: dict[str, Any] = {"http.request.method": method, "url.full": url}
    else:
        attributes = {"rpc.system": "grpc", "server.address": url}
    if model:
        attributes["gen_ai.request.model"] = model
    return _span(f"{method} {path}".strip(), "CLIENT", attributes)


def engine_headers() -> dict[str, str] | None:
    """HTTP headers carrying the current trace context (`traceparent`); None when off."""
    return carrier() or None if _state.on else None


def engine_answered(span: Span | None, status: int, answer: Any) -> None:
    """An engine's HTTP answer: its status, and the token counts of an OpenAI-style `usage`."""
    if span is None:
        return
    span.set_attribute("http.response.status_code", status)
    usage = answer.get("usage") if isinstance(answer, dict) else None
    if not isinstance(usage, dict):
        return
    for ours, theirs in (
        ("gen_ai.usage.input_tokens", ("prompt_tokens", "input_tokens")),
        ("gen_ai.usage.output_tokens", ("completion_tokens", "output_tokens")),
    ):
        value = next((usage[key] for key in theirs if isinstance(usage.get(key), int)), None)
        if value is not None:
            span.set_attribute(ours, value)


def engine_tokens(span: Span | None, prompt: int, generated: int) -> None:
    """Token counts of an engine's answer that is not JSON (vLLM's gRPC Generate)."""
    if span is not None:
        span.set_attributes({"gen_ai.usage.input_tokens": prompt, "gen_ai.usage.output_tokens": generated})


def rollout(
    queued_ns: int, name: str = "rl.sample", **attributes: Any
) -> contextlib.AbstractContextManager[Span | None]:
    """The root span of one rollout in its client (`name`), current inside the block: it begins
    when the rollout was asked for (`queued_ns`, time.time_ns()), so that its wait for the
    client's in-flight window, until the block begins, is inside it as `gym_grpc.queue_wait`.
    In a program that has a span current (a trainer's step), the rollout is its child."""
    if not _state.on:
        return OFF
    return _rollout(name, queued_ns, attributes)


@contextlib.contextmanager
def _rollout(name: str, queued_ns: int, attributes: Mapping[str, Any]) -> Iterator[Span]:
    tracer = _state.tracer
    with tracer.start_as_current_span(
        name, start_time=queued_ns, attributes=attributes, record_exception=False, set_status_on_exception=False
    ) as span:
        tracer.start_span("gym_grpc.queue_wait", start_time=queued_ns).end()
        try:
            yield span
        except BaseException as e:
            failed(span, e)
            raise


def sampled(rollout: Any) -> None:
    """The rollout of the current `rollout` span came back (a gym.v1 Rollout): its reward, turns
    and token counts go on that span."""
    if not _state.on:
        return
    from opentelemetry import trace

    usage = rollout.response.usage
    trace.get_current_span().set_attributes(
        {
            "rl.reward.score": rollout.reward,
            "rl.sample.turns": rollout.model_calls,
            "rl.sample.input_tokens": usage.input_tokens,
            "rl.sample.output_tokens": usage.output_tokens,
        }
    )
