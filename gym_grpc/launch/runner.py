"""Start the servers of a configuration and serve the registry (what `gym-grpc run` does).

Each server runs in a process (`python -m gym_grpc.server.worker`), bound to
its configured port or to port 0 with the bound port read back from it; the
servers of one `process:` group share a process, and call each other without
gRPC (each still serves its own port). Under the default layout (`layout:
grouped`) the configuration gives the servers linked by references one
`process:` (see GymConfig.layout); under `layout: per_server` each server
without a `process:` runs alone. The
runner waits until every server reports ready and answers its health check,
checks that the servers they call exist, then lists them in the registry.
A server with `restart: true` whose process dies is started again, with a
bounded backoff when its replacement dies too. Each server's stderr passes
through the runner (see server_log.py), which quotes its last lines when it
cannot start. Stopping sends SIGTERM (servers finish in-flight calls within
the grace period) and kills what is still alive after it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
from google.protobuf import json_format
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gym_grpc import errors
from gym_grpc.launch.config import ConfigError, GymConfig, ServerSpec
from gym_grpc.launch.server_log import ServerLog
from gym_grpc.policy_version import ServedVersion
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import REGISTRY_SERVICE, SERVER_ROLES, RegistryServicer, closest
from gym_grpc.rpc.security import Security
from gym_grpc.server.serving import DEFAULT_GRACE_SECONDS, GymServer, Running, serve
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import registry_service_pb2_grpc as reg_grpc

log = logging.getLogger("gym_grpc.launch.runner")

#: Seconds a server may take from process start to healthy.
DEFAULT_STARTUP_TIMEOUT = 120.0

#: Attempts to start a dead server again before giving up on it.
RESTART_ATTEMPTS = 5

#: Seconds before the second attempt (the first is at once); doubles, up to RESTART_MAX_DELAY.
RESTART_FIRST_DELAY = 0.5
RESTART_MAX_DELAY = 8.0


class StartupError(errors.FrameworkError, RuntimeError):
    """A server could not start; the message names it and says why."""

    reason = errors.Reason.SERVER_START_FAILED


class RegistryServer(GymServer):
    """The registry service as a GymServer, so it gets health and reflection too."""

    def __init__(self) -> None:
        super().__init__(name="registry")
        self.servicer = RegistryServicer()

    def add_services(self, server: grpc.aio.Server) -> list[str]:
        reg_grpc.add_RegistryServiceServicer_to_server(self.servicer, server)
        return [REGISTRY_SERVICE]


def check_references(infos: dict[str, reg.ServerInfo]) -> None:
    """StartupError when a server calls a server that is not in the configuration."""
    for info in infos.values():
        for role, target in info.references.items():
            if target not in infos:
                raise StartupError(
                    f"server {info.name!r} calls {role} server {target!r}, which is not in the "
                    f"configuration: {closest(target, list(infos))}"
                )


@dataclass
class ServerProcesses:
    """One server of the configuration and its registry entry."""

    name: str
    spec: ServerSpec
    info: reg.ServerInfo = field(default_factory=reg.ServerInfo)
    #: The file its workers share the served policy version through (several workers only).
    policy_version_file: Path | None = None


@dataclass
class ProcessGroup:
    """The worker processes of one server, or of the servers of one `process:` group."""

    name: str
    members: list[ServerProcesses]
    #: Whether it is a `process:` group (else one server on its own).
    shared: bool = False
    processes: list[asyncio.subprocess.Process] = field(default_factory=list)
    log: ServerLog = field(default_factory=ServerLog)

    @property
    def label(self) -> str:
        """How messages name it."""
        if not self.shared:
            return f"server {self.name!r}"
        return f"process {self.name!r} (servers {', '.join(repr(m.name) for m in self.members)})"

    @property
    def num_workers(self) -> int:
        return self.members[0].spec.num_workers  # the same for every member (GymConfig checks)

    @property
    def restart(self) -> bool:
        return self.members[0].spec.restart


def process_groups(servers: dict[str, ServerProcesses]) -> list[ProcessGroup]:
    """The processes that serve `servers`: one per server, one per `process:` group."""
    groups: dict[str, ProcessGroup] = {}
    alone = []
    for server in servers.values():
        if server.spec.process is None:
            alone.append(ProcessGroup(server.name, [server]))
        else:
            groups.setdefault(server.spec.process, ProcessGroup(server.spec.process, [], shared=True))
            groups[server.spec.process].members.append(server)
    return [*alone, *groups.values()]


class Started(Protocol):
    """A server as a runner keeps it: its name and its registry entry."""

    name: str
    info: reg.ServerInfo


class RegistryHost:
    """What every runner does around its servers: serve the registry, start within
    the time-out (and stop what started when that fails), stop the registry."""

    servers: Mapping[str, Started]

    def __init__(
        self,
        config: GymConfig,
        *,
        grace: float = DEFAULT_GRACE_SECONDS,
        startup_timeout: float = DEFAULT_STARTUP_TIMEOUT,
        log_level: str = "INFO",
    ) -> None:
        if not config.servers:
            raise ConfigError("the configuration has no servers")
        self.config = config
        self.grace = grace
        self.startup_timeout = startup_timeout
        self.log_level = log_level
        self.servers = {}
        self.registry: Running | None = None

    @property
    def registry_address(self) -> str:
        if self.registry is None:
            raise RuntimeError("the runner is not started")
        return self.registry.address

    @property
    def servicer(self) -> RegistryServicer:
        """The registry's table, which the runner keeps up to date."""
        assert self.registry is not None, "the runner is not started"
        return self.registry.app.servicer  # type: ignore[attr-defined]

    async def _serve_registry(self, host: str) -> None:
        port = self.config.registry.port
        try:
            self.registry = await serve(RegistryServer(), host, port, security=self.config.security)
        except (OSError, RuntimeError) as e:
            raise StartupError(
                f"cannot serve the registry on {host}:{port} ({e}); is another `gym-grpc run` "
                f"using it? Pick another port with registry.port=PORT (0: any free port)"
            ) from None

    async def _within_startup_timeout(self, starting: Awaitable[None]) -> None:
        """Await `starting`; past the time-out, or when it fails, stop what started."""
        try:
            await asyncio.wait_for(starting, self.startup_timeout)
        except TimeoutError:
            await self.stop()
            pending = [s.name for s in self.servers.values() if not s.info.addresses]
            raise StartupError(f"servers not ready after {self.startup_timeout:.0f} s: {', '.join(pending)}") from None
        except BaseException:
            await self.stop()
            raise

    def _list(self) -> None:
        """Check that every server calls servers of the configuration, then list them all."""
        infos = {s.name: s.info for s in self.servers.values()}
        check_references(infos)
        for info in infos.values():
            self.servicer.add(info)

    def ready(self) -> dict[str, Any]:
        """What `gym-grpc run --ready-json` prints once every server is healthy: this process's pid,
        the registry's address and every server's registry entry (`gym.v1.ServerInfo` in protobuf's
        JSON mapping, as ListServers gives it: addresses, replicas, worker pids, references)."""
        return {
            "pid": os.getpid(),
            "registry": self.registry_address,
            "servers": [
                json_format.MessageToDict(s.info, preserving_proto_field_name=True) for s in self.servers.values()
            ],
        }

    async def stop(self) -> None:
        await self._stop_registry()

    async def _stop_registry(self) -> None:
        if self.registry is not None:
            await self.servicer.close()
            await self.registry.stop(grace=1.0)


class Runner(RegistryHost):
    """Starts, lists and stops the servers of one configuration."""

    servers: dict[str, ServerProcesses]
    groups: Sequence[ProcessGroup] = ()
    _shared: tempfile.TemporaryDirectory[str] | None = None

    async def start(self) -> None:
        """Start the registry and every server; return once all are healthy."""
        for note in self.config.layout_notes:
            log.warning("%s", note)
        await self._serve_registry(self.config.registry.host)
        # State the worker processes of one server share (the policy version a model server serves).
        self._shared = tempfile.TemporaryDirectory(prefix="gym-grpc-run-")
        self.servers = {name: ServerProcesses(name, spec) for name, spec in self.config.servers.items()}
        self.groups = process_groups(self.servers)
        await self._within_startup_timeout(self._start_servers())

    async def _start_servers(self) -> None:
        await asyncio.gather(*(self._start_group(g) for g in self.groups))
        self._list()

    async def _start_group(self, group: ProcessGroup) -> None:
        """Start a group's first worker, then the others on the ports it bound."""
        try:
            await self._start_workers(group)
        except StartupError as e:
            raise StartupError(f"{e}{group.log.quote()}") from None

    async def _start_workers(self, group: ProcessGroup) -> None:
        if group.num_workers > 1:
            assert self._shared is not None
            for server in group.members:
                server.policy_version_file = Path(self._shared.name) / f"{server.name}.policy_version"
                ServedVersion.create_file(server.policy_version_file)
        report = await self._ready(group, await self._spawn(group, [s.spec.port for s in group.members], 0))
        ports = [served["port"] for served in report["servers"]]
        others = [await self._spawn(group, ports, i) for i in range(1, group.num_workers)]
        reports = [report, *await asyncio.gather(*(self._ready(group, process) for process in others))]
        for index, server in enumerate(group.members):
            served = report["servers"][index]
            host = transport.reachable_host(server.spec.host)
            address = f"{host}:{served['port']}"
            await _wait_healthy(address, self.config.security)
            workers = [_worker(host, worker, r, index) for worker, r in enumerate(reports)]
            server.info = reg.ServerInfo(
                name=server.name,
                role=served["role"],
                addresses=[address],
                replicas=[reg.Replica(address=address, workers=workers)],
                entrypoint=server.spec.entrypoint,
                references=served["references"],
                workers=group.num_workers,
            )

    async def _spawn(self, group: ProcessGroup, ports: list[int], worker: int) -> asyncio.subprocess.Process:
        """Start worker `worker` of a group, its servers on `ports`."""
        process = await group.log.spawn(
            sys.executable,
            "-m",
            "gym_grpc.server.worker",
            name=group.name,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            start_new_session=True,  # its own process group, so that what it starts goes with it
        )
        if worker < len(group.processes):  # a restart: close the dead process's stdin
            dead = group.processes[worker]
            if dead.stdin is not None:
                dead.stdin.close()
            group.processes[worker] = process
        else:
            group.processes.append(process)
        message = {
            "name": group.name,
            "worker": worker,
            "workers": group.num_workers,
            "registry": self.registry_address,
            "grace": self.grace,
            "log_level": self.log_level,
            "profiling_dir": self.config.profiling_results_dirpath if self.config.profiling_enabled else None,
            "security": self.config.security.model_dump(),
            "log_name": group.name if group.num_workers == 1 else f"{group.name}.worker{worker}",
            "servers": [
                {
                    "name": server.name,
                    "entrypoint": server.spec.entrypoint,
                    "host": server.spec.host,
                    "port": port,
                    "metrics_port": _metrics_port(server.spec, worker),
                    "config": server.spec.config,
                    "policy_version_file": str(server.policy_version_file) if server.policy_version_file else None,
                }
                for server, port in zip(group.members, ports, strict=True)
            ],
        }
        assert process.stdin is not None
        process.stdin.write((json.dumps(message) + "\n").encode())
        await process.stdin.drain()
        return process

    async def _ready(self, group: ProcessGroup, process: asyncio.subprocess.Process) -> dict:
        """The ready report of one worker process (StartupError when it failed)."""
        assert process.stdout is not None
        line = await process.stdout.readline()
        if not line:
            code = await process.wait()
            _kill_group(process)  # what it started may hold its stderr open
            await group.log.drained(process)
            raise StartupError(f"{group.label} exited with code {code} before it was ready")
        report = json.loads(line)
        if "error" in report:
            reason = report["error"].removeprefix(f"{group.label}: ")
            raise StartupError(f"{group.label} could not start: {reason}")
        return report

    def processes(self) -> list[tuple[str, asyncio.subprocess.Process]]:
        return [(g.name, p) for g in self.groups for p in g.processes]

    async def watch(self, stop: asyncio.Event) -> int:
        """Until `stop` is set: report each server process that exits, start it again
        when its server says `restart`, keep the others serving. 1 when any process
        exited (0 otherwise); returns early if every process is gone for good."""
        exits: dict[asyncio.Future[int], tuple[ProcessGroup, int]] = {
            asyncio.ensure_future(p.wait()): (g, worker) for g in self.groups for worker, p in enumerate(g.processes)
        }
        restarts: dict[asyncio.Future, tuple[ProcessGroup, int]] = {}
        stopping = asyncio.ensure_future(stop.wait())
        code = 0
        try:
            while exits or restarts:
                done, _ = await asyncio.wait({*exits, *restarts, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if stopping in done:
                    break
                for future in done:
                    if future in restarts:
                        group, worker = restarts.pop(future)
                        if future.result():
                            exits[asyncio.ensure_future(group.processes[worker].wait())] = (group, worker)
                        continue
                    group, worker = exits.pop(future)
                    process = group.processes[worker]
                    _kill_group(process)  # what it started (a verifier's pool, say) is orphaned now
                    code = 1
                    log.error("%s (pid %d) exited with code %s", group.label, process.pid, process.returncode)
                    if group.restart:
                        restarts[asyncio.ensure_future(self._restart(group, worker))] = (group, worker)
                    else:
                        log.error("the other servers keep serving (see gym-grpc status)")
            if not exits and not restarts:
                log.error("every server has exited")
        finally:
            stopping.cancel()
            for future in [*exits, *restarts]:
                future.cancel()
            await asyncio.gather(*restarts, return_exceptions=True)  # their processes are listed for stop()
        return code

    async def _restart(self, group: ProcessGroup, worker: int) -> bool:
        """Start worker `worker` of a group again on its servers' ports; whether it came back.

        A replacement that dies (or is not healthy) before it serves is followed by
        another, up to RESTART_ATTEMPTS, with growing delays; then the group is
        given up, with its last log lines."""
        addresses = [server.info.addresses[0] for server in group.members]
        ports = [int(address.rsplit(":", 1)[1]) for address in addresses]
        for attempt in range(1, RESTART_ATTEMPTS + 1):
            delay = 0.0 if attempt == 1 else min(RESTART_FIRST_DELAY * 2 ** (attempt - 2), RESTART_MAX_DELAY)
            when = f" in {delay:.1f} s" if delay else ""
            log.warning("restarting %r (attempt %d of %d)%s", group.name, attempt, RESTART_ATTEMPTS, when)
            await asyncio.sleep(delay)
            try:
                process = await self._spawn(group, ports, worker)
                report = await asyncio.wait_for(self._ready(group, process), self.startup_timeout)
                for address in addresses:
                    await _wait_healthy(address, self.config.security)
            except TimeoutError:
                failure = f"{group.label} not ready after {self.startup_timeout:.0f} s"
            except (StartupError, OSError) as e:
                failure = str(e)
            else:
                log.warning("%s restarted (pid %d) on %s", group.label, process.pid, ", ".join(addresses))
                for index, server in enumerate(group.members):
                    entry = server.info.replicas[0].workers[worker]
                    entry.CopyFrom(
                        _worker(transport.reachable_host(server.spec.host), worker, report, index, entry.restarts + 1)
                    )
                    self.servicer.add(server.info)  # its new pid (and metrics port) for status
                return True
            log.error("attempt %d of %d failed: %s", attempt, RESTART_ATTEMPTS, failure)
            await _end(group.processes[worker])
        log.error("giving up on %s after %d attempts to restart it%s", group.label, RESTART_ATTEMPTS, group.log.quote())
        return False

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
        if self._shared is not None:
            self._shared.cleanup()
        await self._stop_registry()


def _metrics_port(spec: ServerSpec, worker: int) -> int | None:
    """Where worker `worker` serves its metrics: metrics_port + worker for a fixed port;
    0 (a free port each) and None (off) as they are."""
    return spec.metrics_port + worker if spec.metrics_port else spec.metrics_port


def _worker(host: str, index: int, report: dict, member: int, restarts: int = 0) -> reg.Worker:
    """Worker process `index` as the registry lists it for the `member`-th server it serves,
    from its ready report."""
    served = report["servers"][member]
    metrics = f"{host}:{served['metrics_port']}" if served["metrics_port"] else ""
    own = f"{host}:{served['own_port']}" if served["own_port"] else ""
    return reg.Worker(index=index, pid=report["pid"], metrics_address=metrics, restarts=restarts, address=own)


async def _end(process: asyncio.subprocess.Process) -> None:
    """Kill a server process that failed to start, and what it started."""
    _kill_group(process)
    await process.wait()


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
        refs += f"  (in process {s.spec.process!r})" if s.spec.process else ""
        lines.append(
            f"{SERVER_ROLES.get(s.info.role, '?'):<10} {s.name:<24} {s.info.addresses[0]:<22} {workers:<11}{refs}"
        )
    processes = len(runner.processes())
    counted = f"{processes} process" + ("es" if processes != 1 else "")
    lines.append(f"{len(runner.servers)} servers healthy in {time.monotonic() - started:.1f} s ({counted})")
    return "\n".join(lines)
