"""`gym-grpc run`: start the servers of a configuration and serve the registry.

Each server runs in its own process (`python -m gym_grpc.worker`), bound to
its configured port or to port 0 with the bound port read back from it. The
runner waits until every server reports ready and answers its health check,
checks that the servers they call exist, then lists them in the registry.
Stopping sends SIGTERM (servers finish in-flight calls within the grace
period) and kills what is still alive after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_grpc import transport
from gym_grpc.config import ConfigError, GymConfig, ServerSpec
from gym_grpc.registry import REGISTRY_SERVICE, SERVER_ROLES, RegistryServicer, closest
from gym_grpc.security import Security
from gym_grpc.serving import DEFAULT_GRACE_SECONDS, GymServer, Running, serve
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import registry_service_pb2_grpc as reg_grpc

log = logging.getLogger("gym_grpc.runner")

#: Seconds a server may take from process start to healthy.
DEFAULT_STARTUP_TIMEOUT = 120.0

_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}


class StartupError(RuntimeError):
    """A server could not start; the message names it and says why."""


class RegistryServer(GymServer):
    """The registry service as a GymServer, so it gets health and reflection too."""

    def __init__(self) -> None:
        super().__init__(name="registry")
        self.servicer = RegistryServicer()

    def add_services(self, server: grpc.aio.Server) -> list[str]:
        reg_grpc.add_RegistryServiceServicer_to_server(self.servicer, server)
        return [REGISTRY_SERVICE]


@dataclass
class ServerProcesses:
    """The worker processes of one server and what they reported."""

    name: str
    spec: ServerSpec
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)
    info: reg.ServerInfo = field(default_factory=reg.ServerInfo)


class Runner:
    """Starts, lists and stops the servers of one configuration."""

    def __init__(
        self,
        config: GymConfig,
        *,
        grace: float = DEFAULT_GRACE_SECONDS,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        log_level: str = "INFO",
    ) -> None:
        self.config = config
        self.grace = grace
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self.servers: dict[str, ServerProcesses] = {}
        self.registry: Running | None = None

    @property
    def registry_address(self) -> str:
        if self.registry is None:
            raise RuntimeError("the runner is not started")
        return self.registry.address

    async def start(self) -> None:
        """Start the registry and every server; return once all are healthy."""
        if not self.config.servers:
            raise ConfigError("the configuration has no servers")
        spec = self.config.registry
        try:
            self.registry = await serve(RegistryServer(), spec.host, spec.port, security=self.config.security)
        except (OSError, RuntimeError) as e:
            raise StartupError(
                f"cannot serve the registry on {spec.host}:{spec.port} ({e}); is another `gym-grpc run` "
                f"using it? Pick another port with registry.port=PORT (0: any free port)"
            ) from None
        self.servers = {name: ServerProcesses(name, spec) for name, spec in self.config.servers.items()}
        try:
            await asyncio.wait_for(self._start_servers(), self.startup_timeout)
        except TimeoutError:
            await self.stop()
            pending = [s.name for s in self.servers.values() if not s.info.addresses]
            raise StartupError(f"servers not ready after {self.startup_timeout:.0f} s: {', '.join(pending)}") from None
        except BaseException:
            await self.stop()
            raise

    async def _start_servers(self) -> None:
        await asyncio.gather(*(self._start_server(s) for s in self.servers.values()))
        for s in self.servers.values():
            for role, target in s.info.references.items():
                if target not in self.servers:
                    raise StartupError(
                        f"server {s.name!r} calls {role} server {target!r}, which is not in the "
                        f"configuration: {closest(target, list(self.servers))}"
                    )
        for s in self.servers.values():
            self.registry.app.servicer.add(s.info)  # type: ignore[union-attr]

    async def _start_server(self, server: ServerProcesses) -> None:
        """Start a server's first worker, then the others on the port it bound."""
        spec = server.spec
        report = await self._ready(server, await self._spawn(server, spec.port, 0))
        others = [await self._spawn(server, report["port"], i) for i in range(1, spec.num_workers)]
        await asyncio.gather(*(self._ready(server, process) for process in others))
        host = "127.0.0.1" if spec.host in _WILDCARD_HOSTS else spec.host
        address = f"{host}:{report['port']}"
        await _wait_healthy(address, self.config.security)
        server.info = reg.ServerInfo(
            name=server.name,
            role=report["role"],
            addresses=[address],
            entrypoint=spec.entrypoint,
            references=report["references"],
            workers=spec.num_workers,
        )

    async def _spawn(self, server: ServerProcesses, port: int, worker: int) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "gym_grpc.worker",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group, so that what it starts goes with it
        )
        server.processes.append(process)
        spec = server.spec
        message = {
            "name": server.name,
            "entrypoint": spec.entrypoint,
            "host": spec.host,
            "port": port,
            "reuse_port": spec.num_workers > 1,
            "config": spec.config,
            "registry": self.registry_address,
            "grace": self.grace,
            "log_level": self.log_level,
            "profiling_dir": self.config.profiling_results_dirpath if self.config.profiling_enabled else None,
            "security": self.config.security.model_dump(),
            "log_name": server.name if spec.num_workers == 1 else f"{server.name}.worker{worker}",
        }
        assert process.stdin is not None
        process.stdin.write((json.dumps(message) + "\n").encode())
        await process.stdin.drain()
        return process

    async def _ready(self, server: ServerProcesses, process: asyncio.subprocess.Process) -> dict:
        """The ready report of one worker process (StartupError when it failed)."""
        assert process.stdout is not None
        line = await process.stdout.readline()
        if not line:
            code = await process.wait()
            raise StartupError(
                f"server {server.name!r} exited with code {code} before it was ready (see its log above)"
            )
        report = json.loads(line)
        if "error" in report:
            reason = report["error"].removeprefix(f"server {server.name!r}: ")
            raise StartupError(f"server {server.name!r} could not start: {reason}")
        return report

    def processes(self) -> list[tuple[str, asyncio.subprocess.Process]]:
        return [(s.name, p) for s in self.servers.values() for p in s.processes]

    async def watch(self, stop: asyncio.Event) -> int:
        """Until `stop` is set: report each server process that exits, start it again
        when its server says `restart`, keep the others serving. 1 when any process
        exited (0 otherwise); returns early if every process is gone for good."""
        exits = {
            asyncio.ensure_future(p.wait()): (s, worker)
            for s in self.servers.values()
            for worker, p in enumerate(s.processes)
        }
        stopping = asyncio.ensure_future(stop.wait())
        code = 0
        try:
            while exits:
                done, _ = await asyncio.wait({*exits, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if stopping in done:
                    break
                for future in done:
                    server, worker = exits.pop(future)
                    process = server.processes[worker]
                    _kill_group(process)  # what it started (a verifier's pool, say) is orphaned now
                    code = 1
                    log.error("server %r (pid %d) exited with code %s", server.name, process.pid, process.returncode)
                    if not server.spec.restart:
                        log.error("the other servers keep serving (see gym-grpc status)")
                        continue
                    try:
                        await self._restart(server, worker)
                    except StartupError as e:
                        log.error("could not restart it: %s", e)
                        continue
                    exits[asyncio.ensure_future(server.processes[worker].wait())] = (server, worker)
            if not exits:
                log.error("every server has exited")
        finally:
            stopping.cancel()
            for future in exits:
                future.cancel()
        return code

    async def _restart(self, server: ServerProcesses, worker: int) -> None:
        """Start worker `worker` of a server again on the server's port."""
        address = server.info.addresses[0]
        port = int(address.rsplit(":", 1)[1])
        process = await self._spawn(server, port, worker)
        server.processes[worker] = server.processes.pop()  # _spawn appended it
        await asyncio.wait_for(self._ready(server, process), self.startup_timeout)
        await _wait_healthy(address, self.config.security)
        log.warning("server %r restarted (pid %d) on %s", server.name, process.pid, address)

    async def stop(self) -> None:
        """Stop every server (SIGTERM, then SIGKILL after the grace period) and the registry."""
        alive = [p for _, p in self.processes() if p.returncode is None]
        for process in alive:
            process.send_signal(signal.SIGTERM)
        if alive:
            await asyncio.wait([asyncio.ensure_future(p.wait()) for p in alive], timeout=self.grace + 5)
            for process in alive:
                if process.returncode is None:
                    log.warning("server pid %d did not stop in time; killing it", process.pid)
                    process.kill()
                    await process.wait()
        for _, process in self.processes():
            _kill_group(process)
            if process.stdin is not None:
                process.stdin.close()
        if self.registry is not None:
            await self.registry.stop(grace=1.0)


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """Kill whatever is left in the process group of a server process that has exited."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _wait_healthy(address: str, security: Security, attempts: int = 50) -> None:
    """Poll the health service of a server until it says SERVING."""
    async with transport.open_channel(address, security=security) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for _ in range(attempts):
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.1)
    raise StartupError(f"server at {address} never reported SERVING")


def describe(runner: Runner, started: float) -> str:
    """A table of the running servers, for the terminal."""
    lines = [f"registry   {runner.registry_address}"]
    for s in runner.servers.values():
        refs = ", ".join(f"{k}={v}" for k, v in sorted(s.info.references.items()))
        workers = f"{s.info.workers} workers" if s.info.workers > 1 else ""
        lines.append(
            f"{SERVER_ROLES.get(s.info.role, '?'):<10} {s.name:<24} {s.info.addresses[0]:<22} {workers:<11}{refs}"
        )
    processes = len(runner.processes())
    lines.append(f"{len(runner.servers)} servers healthy in {time.monotonic() - started:.1f} s ({processes} processes)")
    return "\n".join(lines)
