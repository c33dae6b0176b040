"""The servers of one process: what `gym-grpc run` starts for each server, or
for each `process:` group of servers.

The parent writes a spec as one JSON line on our stdin and keeps stdin open;
when it closes (the parent exited, even by SIGKILL) we stop. The spec is one
server's, or, for a group, the settings they share with a list of each one's
own (`servers`). Once every server serves, we write one JSON line on stdout:
our pid, and for each server its bound port, role, the names of the servers
it calls and the port of its metrics endpoint (0 when off); or {"error": ...}
when one could not start. The servers of a group call each other in-process
(rpc/in_process.py). Logs go to stderr, prefixed with the server's name (the
group's, for a group).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
from typing import Any, TextIO

from gym_grpc import tracing
from gym_grpc.errors import ConfigError
from gym_grpc.model import ModelServer
from gym_grpc.policy_version import ServedVersion
from gym_grpc.rpc import event_loop
from gym_grpc.rpc.registry import Registry
from gym_grpc.rpc.security import Security
from gym_grpc.server import open_files, stderr
from gym_grpc.server.entrypoints import load_entrypoint
from gym_grpc.server.profiling import Profiler
from gym_grpc.server.serving import GymServer, Running, serve

_reports: TextIO | None = None

log = logging.getLogger("gym_grpc")


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


async def _serve(apps: list[GymServer], specs: list[dict[str, Any]], security: Security) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_stdin() -> None:
        if not os.read(0, 4096):  # EOF: the parent is gone
            loop.remove_reader(0)
            stop.set()

    loop.add_reader(0, on_stdin)
    event_loop.stop_on_signals(stop)
    running: list[Running] = []

    async def start() -> None:
        for app, spec in zip(apps, specs, strict=True):
            running.append(
                await serve(
                    app,
                    spec["host"],
                    spec["port"],
                    reuse_port=spec.get("workers", 1) > 1,  # the server's workers share its port
                    security=security,
                    metrics_port=spec.get("metrics_port"),
                )
            )

    try:
        # The parent stops a worker whose start takes too long, or that it is asked to stop meanwhile.
        if await event_loop.stopped_first(start(), stop):
            log.info("stopped before it served")
            return
        local = {r.app.name: r.in_process for r in running} if len(running) > 1 else {}
        for app in apps:
            app.registry.in_process.update(local)
        _report({"pid": os.getpid(), "servers": [_served(r) for r in running]})
        await stop.wait()
    finally:
        grace = specs[0]["grace"]
        log.info("stopping (grace %.0f s)", grace)
        # Every server stops taking calls and finishes the ones in flight first, then each
        # releases what it holds: a call in flight may still call another server of the group.
        await asyncio.gather(*(r.stop_serving(grace) for r in running))
        for r in running:
            await r.release()


def _served(running: Running) -> dict[str, Any]:
    """What the parent needs to know of one server of this process."""
    app, endpoint = running.app, running.metrics
    return {
        "name": app.name,
        "port": running.port,
        "own_port": running.own_port,
        "role": app.role,
        "references": app.references(),
        "metrics_port": endpoint.port if endpoint else 0,
    }


def _specs(message: dict[str, Any]) -> list[dict[str, Any]]:
    """Each server's spec: the settings of the message, with a group member's own on top."""
    shared = {k: v for k, v in message.items() if k != "servers"}
    return [{**shared, **own} for own in message.get("servers", [{}])]


def _app(spec: dict[str, Any], security: Security, profiler: Profiler | None) -> GymServer:
    cls = load_entrypoint(spec["entrypoint"])
    name = spec["name"]
    cls.check_processes(name, spec.get("workers", 1), "num_workers")
    app = cls(spec["config"], name=name, registry=Registry(spec["registry"], security=security))
    app.entrypoint = spec["entrypoint"]
    app.worker = spec.get("worker", 0)
    if spec.get("policy_version_file") and isinstance(app, ModelServer):
        app.served_version = ServedVersion(spec["policy_version_file"])  # one for all the server's workers
    if profiler is not None:  # yappi is one per process: its servers share it, and the first stop writes its log
        app.profiler = profiler
    return app


def main() -> None:
    _take_stdout()
    stderr.install()  # logging must never block the event loop on a pipe nobody drains
    message = json.loads(sys.stdin.readline())
    specs = _specs(message)
    name = message["name"]  # the server's, or the group's
    # and name this process in what it says about it (a group's process is no server of that name)
    open_files.raise_limit(f"process {name!r}" if len(specs) > 1 else f"server {name!r}")
    logging.basicConfig(
        stream=sys.stderr,
        level=message.get("log_level", "INFO"),
        format=f"%(asctime)s [{name}] %(levelname)s %(message)s",
    )
    # Traced when the OTEL_* variables say so: the server's name (the group's) is the service's.
    tracing.configure(name, **{"gym_grpc.worker": specs[0].get("worker", 0)})
    try:
        security = Security.model_validate(message.get("security") or {})
        first = specs[0]
        profiler = Profiler(first["profiling_dir"], first.get("log_name", name)) if first.get("profiling_dir") else None
        apps = [_app(spec, security, profiler) for spec in specs]
        event_loop.run(_serve(apps, specs, security))
    except ConfigError as e:
        _report({"error": str(e)})
        sys.exit(2)
    except Exception as e:
        log.exception("could not serve")
        _report({"error": f"{type(e).__name__}: {e}"})
        sys.exit(1)
    finally:
        tracing.shutdown()  # the last spans go out before the process ends (SIGTERM, SIGINT, stdin closed)


if __name__ == "__main__":
    main()
