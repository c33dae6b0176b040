"""Stands in for `python -m vllm.entrypoints.openai.api_server ...` in tests of gym_grpc.engines.local_vllm.

Takes vLLM's arguments (only --port matters) and behaves as FAKE_VLLM_MODE says:
serve (answers GET /v1/models, with a forked child like vLLM's engine core; as
`-m vllm.entrypoints.launchers.grpc_server`, the gRPC server's, answers gRPC health
checks with SERVING instead),
die, hang (never listens), stubborn (serves and ignores SIGTERM), taken_once
(the first start fails with vLLM's "address already in use", later ones serve).
Writes its PID and its child's to FAKE_VLLM_PIDS, one per line. Like vLLM, it listens on
a Unix socket in VLLM_RPC_BASE_PATH (ZeroMQ's, in vLLM), and leaves it there when it ends.
"""

import http.server
import os
import signal
import socket
import sys
import tempfile
import time
import uuid
from pathlib import Path


class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"object": "list", "data": [{"id": "fake"}]}' if self.path == "/v1/models" else b"{}"
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    port = int(sys.argv[sys.argv.index("--port") + 1])
    mode = os.environ["FAKE_VLLM_MODE"]
    pids = Path(os.environ["FAKE_VLLM_PIDS"])
    if mode == "taken_once":
        marker = pids.with_suffix(".taken")
        if not marker.exists():
            marker.touch()
            print("OSError: [Errno 98] Address already in use", flush=True)
            sys.exit(1)
    if mode == "die":
        print("RuntimeError: boom, the model did not load", flush=True)
        sys.exit(3)
    child = os.fork()
    if child == 0:  # the engine core: lives until signalled
        while True:
            time.sleep(1)
    with pids.open("a") as f:
        f.write(f"{os.getpid()}\n{child}\n")
    ipc = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    ipc.bind(os.path.join(os.environ.get("VLLM_RPC_BASE_PATH", tempfile.gettempdir()), str(uuid.uuid4())))
    ipc.listen()
    if mode == "stubborn":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "hang":
        while True:
            time.sleep(1)
    if "vllm.entrypoints.launchers.grpc_server" in sys.argv:
        serve_grpc_health(port)
    http.server.HTTPServer(("127.0.0.1", port), Models).serve_forever()


def serve_grpc_health(port: int) -> None:
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    server.wait_for_termination()


if __name__ == "__main__":
    main()
