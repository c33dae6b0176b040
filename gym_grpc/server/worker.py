"""One server in its own process: what `gym-grpc run` starts for each server.

The parent writes the server's spec as one JSON line on our stdin and keeps
stdin open; when it closes (the parent exited, even by SIGKILL) we stop. Once
serving, we write one JSON line on stdout: the bound port, role, the names
of the servers we call, our pid and the port of our metrics endpoint (0 when
off); or {"error": ...} when we could not start. Logs go to stderr, prefixed
with the server's name.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any, TextIO

from gym_grpc.errors import ConfigError
from gym_grpc.model import ModelServer
from gym_grpc.policy_version import ServedVersion
from gym_grpc.rpc import event_loop
from gym_grpc.rpc.registry import Registry
from gym_grpc.rpc.security import Security
from gym_grpc.server import open_files
from gym_grpc.server.entrypoints import load_entrypoint
from gym_grpc.server.profiling import Profiler
from gym_grpc.server.serving import GymServer, Running, serve_until_signalled

_reports: TextIO | None = None


def _take_stdout() -> None:
    """Keep our stdout as the parent gave it for reports only, on a descriptor that
    processes we start (a verifier's pool, say) do not inherit. Descriptor 1
    becomes a copy of stderr: a grandchild holding the pipe open would keep the
    parent from seeing us exit (asyncio waits for the pipe to close)."""
    global _reports
    _reports = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def _report(message: dict[str, Any]) -> None:
    assert _reports is not None, "main() takes stdout first"
    _reports.write(json.dumps(message) + "\n")
    _reports.flush()


async def _serve(app: GymServer, spec: dict[str, Any], security: Security) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stdin() -> None:
        if not os.read(0, 4096):  # EOF: the parent is gone
            loop.remove_reader(0)
            stop.set()

    loop.add_reader(0, on_stdin)

    def on_ready(running: Running) -> None:
        endpoint = running.metrics
        _report(
            {
                "port": running.port,
                "role": app.role,
                "references": app.references(),
                "pid": os.getpid(),
                "metrics_port": endpoint.port if endpoint else 0,
            }
        )

    await serve_until_signalled(
        app,
        spec["host"],
        spec["port"],
        grace=spec["grace"],
        on_ready=on_ready,
        stop_event=stop,
        reuse_port=spec.get("reuse_port", False),
        security=security,
        metrics_port=spec.get("metrics_port"),
    )


def main() -> None:
    _take_stdout()
    spec = json.loads(sys.stdin.readline())
    name = spec["name"]
    open_files.raise_limit(f"server {name!r}")  # and name this process in what it says about it
    logging.basicConfig(
        stream=sys.stderr,
        level=spec.get("log_level", "INFO"),
        format=f"%(asctime)s [{name}] %(levelname)s %(message)s",
    )
    try:
        security = Security.model_validate(spec.get("security") or {})
        cls = load_entrypoint(spec["entrypoint"])
        app = cls(spec["config"], name=name, registry=Registry(spec["registry"], security=security))
        app.entrypoint = spec["entrypoint"]
        app.worker = spec.get("worker", 0)
        if spec.get("policy_version_file") and isinstance(app, ModelServer):
            app.served_version = ServedVersion(spec["policy_version_file"])  # one for all the server's workers
        if spec.get("profiling_dir"):
            app.profiler = Profiler(spec["profiling_dir"], spec.get("log_name", name))
        event_loop.run(_serve(app, spec, security))
    except ConfigError as e:
        _report({"error": str(e)})
        sys.exit(2)
    except Exception as e:
        logging.getLogger("gym_grpc").exception("could not serve")
        _report({"error": f"{type(e).__name__}: {e}"})
        sys.exit(1)


if __name__ == "__main__":
    main()
