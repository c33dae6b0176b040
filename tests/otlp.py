"""A real OpenTelemetry trace receiver for tests: OTLP over gRPC (opentelemetry-proto's
TraceService, what every OTel collector serves) or over HTTP (POST /v1/traces, binary protobuf),
on 127.0.0.1, keeping every span exported to it with its process's resource."""

from __future__ import annotations

import contextlib
import http.server
import os
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc


class Receiver(otlp_grpc.TraceServiceServicer):
    """An OTLP trace receiver: keeps every span exported to it, with its process's resource.
    `endpoint` and `protocol` are what an exporter needs to reach it."""

    def __init__(self) -> None:
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self.endpoint = ""
        self.protocol = ""

    def Export(self, request: otlp.ExportTraceServiceRequest, context) -> otlp.ExportTraceServiceResponse:
        with self._lock:
            for resource_spans in request.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            {
                                "name": span.name,
                                "trace": span.trace_id.hex(),
                                "id": span.span_id.hex(),
                                "parent": span.parent_span_id.hex(),
                                "kind": span.kind,
                                "attributes": {a.key: _value(a.value) for a in span.attributes},
                                "service": resource.get("service.name"),
                                "pid": resource.get("process.pid"),
                            }
                        )
        return otlp.ExportTraceServiceResponse()


def _value(value) -> object:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


@contextlib.contextmanager
def grpc_receiver(port: int = 0) -> Iterator[Receiver]:
    """An OTLP/gRPC receiver on 127.0.0.1 (its `endpoint`), on `port` (0: a free one)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])
    received = Receiver()
    otlp_grpc.add_TraceServiceServicer_to_server(received, server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    received.endpoint, received.protocol = f"http://127.0.0.1:{port}", "grpc"
    try:
        yield received
    finally:
        server.stop(0)


@contextlib.contextmanager
def http_receiver() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver (POST /v1/traces, binary protobuf) on 127.0.0.1 (its `endpoint`)."""
    received = Receiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            assert self.path == "/v1/traces", self.path
            reply = received.Export(otlp.ExportTraceServiceRequest.FromString(body), None).SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    received.endpoint, received.protocol = f"http://127.0.0.1:{server.server_port}", "http/protobuf"
    try:
        yield received
    finally:
        server.shutdown()
        server.server_close()


def otel_env(receiver: Receiver, **more: str) -> dict[str, str]:
    """This process's environment with tracing on, exporting to `receiver` (and `more` variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    return {
        **env,
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": receiver.protocol,
        **more,
    }
