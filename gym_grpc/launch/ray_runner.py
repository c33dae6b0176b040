"""`gym-grpc run --ray`: the servers of a configuration as replicas on a Ray cluster.

Ray does the placement, the restarts and the node membership; this module
only asks it. Each server gets a placement group of `replicas` bundles (of
`num_cpus` each), laid out by `ray.placement_strategy`, and one actor per
bundle. An actor is a replica: it serves the server in its own process, on a
free port of its node, exactly as a local worker does (the CPU pool of a
verifier included). Ray starts an actor whose process or node died again, up
to `ray.max_restarts` times, in its bundle, which Ray moves to a live node.

The runner is the Ray driver. It serves the registry and polls every replica
(an actor call that starts the server when a restarted actor has not yet):
the registry lists the replicas that answer, and callers follow it (see
`Registry.connections`). A replica that does not answer is taken out of the
registry at once; the calls in flight on it fail UNAVAILABLE naming it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from gym_grpc import tracing
from gym_grpc.launch.config import ConfigError, GymConfig, ServerSpec
from gym_grpc.launch.runner import RegistryHost, StartupError
from gym_grpc.rpc.registry import SERVER_ROLES
from gym_grpc.server.serving import Running, serve
from gym_grpc.v1 import registry_service_pb2 as reg

log = logging.getLogger("gym_grpc.launch.ray_runner")

#: Seconds a replica has to answer a poll before it is taken out of the registry.
POLL_TIMEOUT_SECONDS = 10.0

#: Seconds the cluster has to find room for a server's replicas.
PLACEMENT_TIMEOUT_SECONDS = 60.0

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


class ReplicaServer:
    """One replica as a Ray actor: serves the server in the actor's process.

    `start` is idempotent: the runner calls it to start the server and then, at
    every poll, to learn where it serves; after Ray restarted the actor (a new
    process, maybe on another node) the next poll starts the server again."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.running: Running | None = None
        self.node = ""
        self.metrics_address = ""

    async def start(self) -> dict[str, Any]:
        if self.running is None:
            self.running = await self._serve()
        return {
            "address": self.running.app.replica,
            "node": self.node,
            "pid": os.getpid(),
            "metrics_address": self.metrics_address,
            "role": self.running.app.role,
            "references": self.running.app.references(),
        }

    async def _serve(self) -> Running:
        import ray

        from gym_grpc.rpc.registry import Registry
        from gym_grpc.rpc.security import Security
        from gym_grpc.server import open_files
        from gym_grpc.server.entrypoints import load_entrypoint
        from gym_grpc.server.profiling import Profiler

        spec = self.spec
        label = f"{spec['name']}#{spec['index']}"
        logging.basicConfig(
            stream=sys.stderr, level=spec["log_level"], format=f"%(asctime)s [{label}] %(levelname)s %(message)s"
        )
        open_files.raise_limit(f"replica {label}")
        # Traced when the OTEL_* variables reach the actor (a local cluster inherits them; a remote one
        # through its runtime_env): the server's name is the service's, the replica an attribute.
        tracing.configure(spec["name"], **{"gym_grpc.replica": spec["index"]})
        security = Security.model_validate(spec["security"])
        cls = load_entrypoint(spec["entrypoint"])
        cls.check_processes(spec["name"], spec["replicas"], "replicas")
        app = cls(spec["config"], name=spec["name"], registry=Registry(spec["registry"], security=security))
        app.entrypoint = spec["entrypoint"]
        if spec["profiling_dir"]:
            app.profiler = Profiler(spec["profiling_dir"], label)
        self.node = ray.get_runtime_context().get_node_id()
        running = await serve(app, "0.0.0.0", 0, security=security, metrics_port=spec["metrics_port"])
        ip = ray.util.get_node_ip_address()
        app.replica = f"{ip}:{running.port}"
        if running.metrics is not None:
            self.metrics_address = app.metrics_address = f"{ip}:{running.metrics.port}"
        return running

    async def stop(self, grace: float) -> None:
        if self.running is not None:
            await self.running.stop(grace)
        tracing.shutdown()  # the replica's last spans go out before Ray ends the actor


@dataclass
class Replica:
    """What the runner knows of one replica."""

    index: int
    actor: Any
    #: The actor's last answer (address, node, pid), or None while it does not answer.
    seen: dict[str, Any] | None = None
    pid: int = 0
    restarts: int = 0
    #: Ray gave up on it (max_restarts reached).
    lost: bool = False


@dataclass
class RayServer:
    """The replicas of one server."""

    name: str
    spec: ServerSpec
    group: Any = None
    replicas: list[Replica] = field(default_factory=list)
    info: reg.ServerInfo = field(default_factory=reg.ServerInfo)


class RayRunner(RegistryHost):
    """Starts, watches and stops the replicas of one configuration on a Ray cluster."""

    servers: dict[str, RayServer]

    def __init__(self, config: GymConfig, **options: Any) -> None:
        super().__init__(config, **options)
        assert config.ray is not None, "a RayRunner needs the config's ray block"
        self.ray_spec = config.ray
        self._joined = False  # we called ray.init, so we call ray.shutdown

    async def start(self) -> None:
        """Join the cluster, serve the registry, place and start every replica; return once all serve."""
        ray = _import_ray()
        if not ray.is_initialized():
            options: dict[str, Any] = {"address": self.ray_spec.address}
            if self.ray_spec.address == "local":
                # A Ray of our own on this machine: as many logical CPUs as the replicas ask
                # for, when that is more than the machine has (they share its cores, as
                # `gym-grpc run` without Ray has its processes share them).
                wanted = sum(spec.replicas * spec.num_cpus for spec in self.config.servers.values())
                options = {"address": "local", "num_cpus": max(os.cpu_count() or 1, math.ceil(wanted))}
            try:
                ray.init(**options, log_to_driver=True, include_dashboard=False)
            except ConnectionError as e:
                raise StartupError(f"cannot join the Ray cluster at {self.ray_spec.address!r}: {e}") from None
            self._joined = True
        await self._within_startup_timeout(self._start_servers(ray))

    async def _start_servers(self, ray: Any) -> None:
        # Replicas on other nodes must reach the registry: a loopback host becomes every interface.
        host = self.config.registry.host
        await self._serve_registry("0.0.0.0" if host in _LOOPBACK else host)
        assert self.registry is not None
        if host in _LOOPBACK:
            self.registry.host = ray.util.get_node_ip_address()
        self.servers = {name: RayServer(name, spec) for name, spec in self.config.servers.items()}
        await asyncio.gather(*(self._place(s) for s in self.servers.values()))
        await asyncio.gather(*(self._poll(s, first=True) for s in self.servers.values()))
        self._list()

    async def _place(self, server: RayServer) -> None:
        """Reserve the server's bundles, then start one actor in each."""
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = server.spec
        bundles = [{"CPU": spec.num_cpus} for _ in range(spec.replicas)]
        server.group = placement_group(bundles, strategy=self.ray_spec.placement_strategy, name=f"gym-{server.name}")
        try:
            await asyncio.wait_for(server.group.ready(), PLACEMENT_TIMEOUT_SECONDS)
        except TimeoutError:
            resources = ray.available_resources().get("CPU", 0.0)
            raise StartupError(
                f"server {server.name!r}: Ray found no room for {spec.replicas} replicas of {spec.num_cpus:g} CPU "
                f"({self.ray_spec.placement_strategy}) in {PLACEMENT_TIMEOUT_SECONDS:.0f} s; the cluster has "
                f"{resources:g} CPUs free and {len(ray.nodes())} nodes. Lower servers.{server.name}.replicas or "
                f".num_cpus, or use placement_strategy SPREAD"
            ) from None
        actor_class = ray.remote(ReplicaServer)
        for index in range(spec.replicas):
            actor = actor_class.options(
                name=f"gym-{server.name}-{index}",
                num_cpus=spec.num_cpus,
                max_restarts=self.ray_spec.max_restarts,
                max_task_retries=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(server.group, placement_group_bundle_index=index),
                # gRPC's fork handlers abort children forked while gRPC is busy (see gym_grpc/__init__.py);
                # Ray's worker imports grpc before gym_grpc can turn them off.
                runtime_env={"env_vars": {"GRPC_ENABLE_FORK_SUPPORT": "false"}},
            ).remote(self._replica_spec(server, index))
            server.replicas.append(Replica(index=index, actor=actor))

    def _replica_spec(self, server: RayServer, index: int) -> dict[str, Any]:
        spec = server.spec
        return {
            "name": server.name,
            "index": index,
            "replicas": spec.replicas,
            "entrypoint": spec.entrypoint,
            "config": spec.config,
            "registry": self.registry_address,
            "security": self.config.security.model_dump(),
            "log_level": self.log_level,
            "profiling_dir": self.config.profiling_results_dirpath if self.config.profiling_enabled else None,
            "metrics_port": spec.metrics_port,
        }

    async def _poll(self, server: RayServer, first: bool = False) -> bool:
        """Ask every replica of a server where it serves (starting it if needed) and
        update its registry entry; whether any replica died since the last poll."""
        ray = _import_ray()
        timeout = self.startup_timeout if first else POLL_TIMEOUT_SECONDS
        polled = [r for r in server.replicas if not r.lost]
        answers = await asyncio.gather(
            *(asyncio.wait_for(_answer(r.actor.start.remote()), timeout) for r in polled), return_exceptions=True
        )
        died = False
        for replica, answer in zip(polled, answers, strict=True):
            label = f"{server.name}#{replica.index}"
            if isinstance(answer, dict):
                if replica.pid and answer["pid"] != replica.pid:
                    replica.restarts += 1
                    died = True
                    log.warning(
                        "replica %s restarted by Ray (%d of %d) on node %s at %s",
                        label,
                        replica.restarts,
                        self.ray_spec.max_restarts,
                        answer["node"][:12],
                        answer["address"],
                    )
                replica.pid, replica.seen = answer["pid"], answer
                continue
            if first:
                raise StartupError(f"replica {label} could not start: {_why(answer)}")
            if replica.seen is not None:
                died = True
                log.error("replica %s at %s is down: %s", label, replica.seen["address"], _why(answer))
            replica.seen = None
            if isinstance(answer, ray.exceptions.ActorDiedError):
                replica.lost = True
                log.error("replica %s is lost for good (Ray gave up after %d restarts)", label, replica.restarts)
        self._update(server)
        return died

    def _update(self, server: RayServer) -> None:
        live = [(r, r.seen) for r in server.replicas if r.seen is not None]
        first = live[0][1] if live else {}
        server.info = reg.ServerInfo(
            name=server.name,
            role=first.get("role", server.info.role),
            addresses=[seen["address"] for _, seen in live],
            replicas=[_listed(r, seen) for r, seen in live],
            entrypoint=server.spec.entrypoint,
            references=first.get("references", dict(server.info.references)),
        )
        if self.registry is not None and server.name in self.servicer.servers:
            self.servicer.add(server.info)

    async def watch(self, stop: asyncio.Event) -> int:
        """Poll the replicas until `stop` is set; 1 when any replica died (Ray restarts
        it, up to max_restarts), 0 otherwise; returns early when every replica is lost."""
        code = 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.ray_spec.poll_seconds)
            except TimeoutError:
                pass
            if stop.is_set():
                break
            died = await asyncio.gather(*(self._poll(s) for s in self.servers.values()))
            code = 1 if any(died) else code
            if all(r.lost for s in self.servers.values() for r in s.replicas):
                log.error("every replica is lost")
                break
        return code

    async def stop(self) -> None:
        """Stop every replica (its in-flight calls get the grace period), end the actors and
        their placement groups, stop the registry, and leave the cluster if we joined it."""
        ray = _import_ray()
        replicas = [r for s in self.servers.values() for r in s.replicas if not r.lost]
        if replicas:
            await asyncio.wait(
                [asyncio.ensure_future(_answer(r.actor.stop.remote(self.grace))) for r in replicas],
                timeout=self.grace + 5,
            )
        for replica in replicas:
            ray.kill(replica.actor, no_restart=True)
        from ray.util.placement_group import remove_placement_group

        for server in self.servers.values():
            if server.group is not None:
                remove_placement_group(server.group)
        await self._stop_registry()
        if self._joined:
            ray.shutdown()
            self._joined = False


def _listed(replica: Replica, seen: dict[str, Any]) -> reg.Replica:
    """A live replica as the registry lists it: one worker process, the actor's."""
    worker = reg.Worker(pid=replica.pid, metrics_address=seen.get("metrics_address", ""), restarts=replica.restarts)
    return reg.Replica(
        address=seen["address"], node=seen["node"], restarts=replica.restarts, index=replica.index, workers=[worker]
    )


async def _answer(ref: Any) -> Any:
    return await ref


def _why(error: BaseException) -> str:
    if isinstance(error, TimeoutError):
        return "no answer in time"
    cause = getattr(error, "cause", None)  # a RayTaskError holds what the actor raised
    if isinstance(cause, BaseException):
        return str(cause) if isinstance(cause, ConfigError) else f"{type(cause).__name__}: {cause}"
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[-1] if text else ''}"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'gym-grpc[ray]'") from None
    return ray


def describe(runner: RayRunner, started: float) -> str:
    """A table of the running replicas, for the terminal."""
    lines = [f"registry   {runner.registry_address}"]
    for s in runner.servers.values():
        refs = ", ".join(f"{k}={v}" for k, v in sorted(s.info.references.items()))
        role = SERVER_ROLES.get(s.info.role, "?")
        for r in s.info.replicas:
            lines.append(f"{role:<10} {s.name + '#' + str(r.index):<24} {r.address:<22} node {r.node[:12]}  {refs}")
    count = sum(len(s.info.replicas) for s in runner.servers.values())
    nodes = len({r.node for s in runner.servers.values() for r in s.info.replicas})
    lines.append(
        f"{len(runner.servers)} servers healthy in {time.monotonic() - started:.1f} s "
        f"({count} replicas on {nodes} Ray node{'s' if nodes != 1 else ''})"
    )
    return "\n".join(lines)
