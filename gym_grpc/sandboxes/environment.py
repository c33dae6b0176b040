"""An environment whose sessions each have a sandbox: the fleet, its settings, and SandboxService.

    class MyEnv(SandboxEnvironment):
        @tool
        async def run(self, session: Session, command: str) -> str:
            result = await self.run_in_sandbox(session, command)
            ...

The session's sandbox is started at SeedSession (`sandbox.create: seed`, the
default: a start failure then fails the rollout before its first model call)
or at its first use (`first_use`), and destroyed at CloseSession, the idle
time-out or the server's stop. The fleet's caps and warm pool are the
`sandbox:` settings; its counters are in `gym-grpc status` and on the
Prometheus endpoint. The same sandbox is served over SandboxService for what
runs beside the model's tools (the external agent's `in_sandbox`).
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar, Literal

import grpc
from pydantic import BaseModel, ConfigDict, Field

from gym_grpc import errors
from gym_grpc.resources import ResourcesConfig, ResourcesServer, Session
from gym_grpc.rpc import transport
from gym_grpc.server.entrypoints import load_class
from gym_grpc.v1 import admin_service_pb2 as admin_pb

from .bubblewrap import BubblewrapProvider
from .fleet import SandboxFleet
from .provider import CommandResult, Sandbox, SandboxProvider, SandboxSpec
from .service import add_sandbox_service

#: Where a session keeps its sandbox (a future: the fleet may make it wait) in `session.state`.
_SANDBOX = "_sandbox"


class SandboxSettings(BaseModel):
    """The `sandbox:` settings of an environment with sandboxes."""

    model_config = ConfigDict(extra="forbid")

    provider: str = Field(
        "bubblewrap", description='"bubblewrap", or "package.module:Class" of a SandboxProvider subclass'
    )
    options: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the provider's class")
    create: Literal["seed", "first_use"] = Field(
        "seed", description="start the sandbox at SeedSession, or when first used"
    )
    warm_pool: int = Field(0, ge=0, description="sandboxes kept started for the next sessions")
    max_alive: int = Field(256, ge=1, description="most sandboxes at once; sessions beyond it wait for one")
    max_starting: int = Field(8, ge=1, description="most sandboxes starting at once")
    starts_per_second: float | None = Field(None, gt=0, description="most sandbox starts a second, on average")
    disk_mb: int = Field(256, ge=1, description="MiB all of a sandbox's writable directories hold together")
    memory_mb: int = Field(2048, ge=16, description="MiB of address space each process in a sandbox may use")
    max_processes: int = Field(256, ge=8, description="processes a sandbox may run at once")
    python_packages: bool = Field(
        False, description="show the server's Python packages (read-only) inside: for an agent program that needs them"
    )
    command_timeout_seconds: float = Field(60.0, gt=0, description="a command's time-out when its caller gives none")
    max_output_bytes: int = Field(65536, ge=1, description="bytes of each of a command's streams returned at most")


class SandboxConfig(ResourcesConfig):
    sandbox: SandboxSettings = Field(default_factory=SandboxSettings)


def load_provider(settings: SandboxSettings) -> SandboxProvider:
    if settings.provider == "bubblewrap":
        return BubblewrapProvider(**settings.options)
    provider: type[SandboxProvider] = load_class(settings.provider, SandboxProvider, "a sandbox provider")  # type: ignore[type-abstract]
    return provider(**settings.options)


class SandboxEnvironment(ResourcesServer):
    """Base of an environment whose sessions each have a sandbox of their own."""

    Config = SandboxConfig
    config: SandboxConfig
    #: The writable directories of its sandboxes, the first one their working directory.
    sandbox_dirs: ClassVar[tuple[str, ...]] = ("/app", "/tmp")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = self.config.sandbox
        spec = SandboxSpec(
            dirs=self.sandbox_dirs,
            disk_bytes=settings.disk_mb << 20,
            memory_bytes=settings.memory_mb << 20,
            max_processes=settings.max_processes,
            python_packages=settings.python_packages,
        )
        self.fleet = SandboxFleet(
            load_provider(settings),
            spec,
            warm_pool=settings.warm_pool,
            max_alive=settings.max_alive,
            max_starting=settings.max_starting,
            starts_per_second=settings.starts_per_second,
        )
        self.counters.sandboxes = self.fleet.states
        self.counters.sandbox_start_failures = lambda: self.fleet.start_failures

    def capabilities(self) -> admin_pb.Capabilities:
        capabilities = super().capabilities()
        capabilities.sandboxes = True
        return capabilities

    def add_services(self, server: grpc.aio.Server) -> list[str]:
        return [*super().add_services(server), add_sandbox_service(self, server)]

    async def start(self) -> None:
        await super().start()
        await self.fleet.start()

    async def stop(self) -> None:
        try:
            await super().stop()  # closes every session, and so releases their sandboxes
        finally:
            await self.fleet.close()

    # --- the session's sandbox -------------------------------------------

    async def seed_session(self, session: Session) -> None:
        if self.config.sandbox.create == "seed":
            await self.sandbox(session)

    async def sandbox(self, session: Session) -> Sandbox:
        """The session's sandbox, started (or taken from the warm pool) on first use."""
        found: asyncio.Future[Sandbox] | None = session.state.get(_SANDBOX)
        pending = found if found is not None else asyncio.ensure_future(self.fleet.acquire())
        session.state[_SANDBOX] = pending
        # A call's deadline does not cancel its handler: the wait for a sandbox ends with it here.
        left = transport.timeout_for(None)
        try:
            return await asyncio.wait_for(asyncio.shield(pending), left)
        except (TimeoutError, asyncio.CancelledError) as e:
            # The caller gave up (its deadline, or the call was cancelled): so does the wait.
            if session.state.get(_SANDBOX) is pending and not pending.done():
                pending.cancel()
                session.state.pop(_SANDBOX, None)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise errors.DeadlineExceeded(
                f"no sandbox within the call's deadline ({self.fleet.alive()} alive, max_alive "
                f"{self.fleet.max_alive}, {self.fleet.waiting} sessions waiting)"
            ) from None
        except errors.GymError:
            session.state.pop(_SANDBOX, None)  # the next use tries again
            raise

    def started_sandbox(self, session: Session) -> Sandbox | None:
        """The session's sandbox if it has one ready now (None: not asked for yet, still waited for, or released)."""
        pending: asyncio.Future[Sandbox] | None = session.state.get(_SANDBOX)
        if pending is None or not pending.done() or pending.cancelled() or pending.exception() is not None:
            return None
        return pending.result()

    async def close_session(self, session: Session) -> None:
        pending: asyncio.Future[Sandbox] | None = session.state.pop(_SANDBOX, None)
        if pending is None:
            return
        if not pending.done():
            pending.cancel()
        try:
            sandbox = await pending
        except (asyncio.CancelledError, errors.GymError):
            return
        self.fleet.release(sandbox)

    async def run_in_sandbox(
        self,
        session: Session,
        argv: list[str] | str,
        *,
        stdin: bytes = b"",
        cwd: str = "",
        env: dict[str, str] | None = None,
        timeout: float | None = None,
        max_output: int | None = None,
    ) -> CommandResult:
        """Run a command (a list, or a shell line) in the session's sandbox."""
        sandbox = await self.sandbox(session)
        command = ["/bin/sh", "-c", argv] if isinstance(argv, str) else argv
        settings = self.config.sandbox
        return await sandbox.exec(
            command,
            stdin=stdin,
            cwd=cwd,
            env=env,
            timeout=timeout or settings.command_timeout_seconds,
            max_output=max_output or settings.max_output_bytes,
        )
