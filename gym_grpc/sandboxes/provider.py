"""What a sandbox runtime provides: a sandbox that lives for a session, and the operations on it.

A `SandboxProvider` makes `Sandbox`es from a `SandboxSpec`; the fleet
(fleet.py) decides when, how many at once, and which one a session gets. The
built-in provider is bubblewrap (bubblewrap.py), the one tested here. Another
runtime (a container runtime, a cloud sandbox) plugs in as a subclass named by
the environment's `sandbox.provider` setting ("package.module:Class", built as
`Class(**sandbox.options)`); docs/sandboxes.md says what each method must do.
No other provider ships: the interface is all there is for them.

Every method runs on the server's event loop and must not block it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from gym_grpc.errors import SandboxError

__all__ = ["CommandResult", "FileEntry", "Sandbox", "SandboxError", "SandboxProvider", "SandboxSpec"]


@dataclass(frozen=True)
class SandboxSpec:
    """What every sandbox of a fleet looks like (the same for all, so that one can be made ahead)."""

    #: Writable directories made in the sandbox, the first one its working directory.
    dirs: tuple[str, ...] = ("/app", "/tmp")
    #: Bytes all its writable directories may hold together (a disk filler gets ENOSPC there).
    disk_bytes: int = 256 << 20
    #: Bytes of address space each of its processes may use.
    memory_bytes: int = 2 << 30
    #: Processes it may run at once (a fork bomb stops there).
    max_processes: int = 256
    #: Bind the server's Python environment read-only (its packages: the openai SDK of an agent program).
    python_packages: bool = False

    @property
    def workdir(self) -> str:
        return self.dirs[0]


@dataclass(frozen=True)
class CommandResult:
    """How a command ended, and the first bytes of what it wrote."""

    exit_code: int  #: negative: killed by that signal
    stdout: bytes
    stderr: bytes
    stdout_bytes: int  #: the full size of its stdout
    stderr_bytes: int
    timed_out: bool  #: killed at its timeout
    seconds: float


@dataclass(frozen=True)
class FileEntry:
    name: str
    type: str  #: "file", "dir" or "link"
    size: int


class Sandbox(ABC):
    """One sandbox, alive until `destroy`."""

    #: A short id for logs and counters.
    id: str

    @abstractmethod
    async def exec(
        self,
        argv: list[str],
        *,
        stdin: bytes = b"",
        cwd: str = "",
        env: dict[str, str] | None = None,
        timeout: float,
        max_output: int,
    ) -> CommandResult:
        """Run argv in the sandbox; kill it and its process group at `timeout`."""

    @abstractmethod
    async def read_file(self, path: str, max_bytes: int) -> tuple[bytes, int]:
        """The file's first `max_bytes`, and its full size."""

    @abstractmethod
    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a whole file, making its directories."""

    @abstractmethod
    async def list_files(self, path: str) -> list[FileEntry]:
        """A directory's entries, by name."""

    @abstractmethod
    async def kill_processes(self) -> None:
        """End every process the sandbox's commands left running (before its tests run, say)."""

    @abstractmethod
    async def forward(self, port: int, target: str) -> None:
        """Join connections to 127.0.0.1:`port` inside the sandbox to `target` (host:port) outside."""

    @abstractmethod
    def alive(self) -> bool:
        """Whether it still runs (a warm sandbox that died is not handed out)."""

    @abstractmethod
    async def destroy(self) -> None:
        """End it and everything in it; it leaves nothing behind. Safe to call twice."""


class SandboxProvider(ABC):
    """Makes sandboxes of one runtime."""

    async def start(self) -> None:
        """Get ready before the first sandbox (check the runtime works); raise ConfigError with the fix."""
        return None

    @abstractmethod
    async def create(self, spec: SandboxSpec) -> Sandbox:
        """A new, ready sandboxes; SandboxError with the runtime's reason when it cannot start one."""

    async def close(self) -> None:
        """Release what `start` took (every sandbox has been destroyed by then)."""
        return None
