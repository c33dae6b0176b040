"""A real `gym-grpc run` process, for tests that need what a user runs: servers in their own
processes, restarts, signals, the command line.

    with GymRun.start("configs/quickstart.yaml") as run:      # returns once every server is healthy
        subprocess.run([gym_grpc_command(), "collect", "--registry", run.registry, ...])
        run.servers["math_agent"]                              # its address
        run.pids("math_agent")                                 # its worker processes

It starts `gym-grpc run ARGS --ready-json` (with `--registry 127.0.0.1:0` unless ARGS give one)
and reads the one JSON line the runner prints on stdout once every server answers its health
check: the registry's address and every server's registry entry, as ListServers gives them. No
human output is parsed. The runner's stderr (its table and every server's log) goes to a file,
never to a pipe nobody reads, which would fill and stop the servers' logging; `log()` reads it.
Leaving the block stops the run with SIGINT, as Ctrl-C would, and removes the log file.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from gym_grpc import errors

#: Seconds a run may take to stop once signalled (its servers get their grace period first).
STOP_TIMEOUT_SECONDS = 60.0


def gym_grpc_command() -> str:
    """The `gym-grpc` command of this interpreter's environment."""
    return str(Path(sys.executable).with_name("gym-grpc"))


def descendants(*roots: int) -> list[int]:
    """Every process `roots` started, and every process those started, from /proc (Linux); not `roots`.
    Read before a process ends: its children are then given to another parent."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone meanwhile
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [child for root in roots for child in children.get(root, [])]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


class RunFailed(errors.FrameworkError, RuntimeError):
    """`gym-grpc run` ended before its servers were ready; the message holds what it said."""

    reason = errors.Reason.SERVER_START_FAILED


class GymRun:
    """A `gym-grpc run` process whose servers are all healthy. See the module's docstring."""

    def __init__(self, process: subprocess.Popen[str], ready: dict[str, Any], stderr: IO[str]) -> None:
        self.process = process
        #: The line `--ready-json` printed: {"pid", "registry", "servers": [ServerInfo as JSON, ...]}.
        self.ready = ready
        self._stderr = stderr

    @classmethod
    def start(
        cls,
        *args: str | Path,
        cwd: str | Path | None = None,
        env: dict[str, str] | None = None,
        preexec_fn: Callable[[], None] | None = None,
    ) -> GymRun:
        """Start `gym-grpc run ARGS` and return once every server is healthy (RunFailed if it ends first)."""
        words = [str(a) for a in args]
        if not any(w == "--registry" or w.startswith("--registry=") for w in words):
            words += ["--registry", "127.0.0.1:0"]
        stderr = tempfile.NamedTemporaryFile("w+", prefix="gym-grpc-run-", suffix=".log")
        process = subprocess.Popen(
            [gym_grpc_command(), "run", *words, "--ready-json"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            cwd=cwd,
            env=env,
            preexec_fn=preexec_fn,
        )
        assert process.stdout is not None
        try:
            line = process.stdout.readline()  # the runner's own start-up time-out bounds the wait
        except BaseException:  # Ctrl-C, or SystemExit from a signal handler: no caller will stop this run
            with cls(process, {}, stderr):  # so it is stopped here, and its log removed, on the way out
                raise
        if not line:
            code = process.wait(timeout=STOP_TIMEOUT_SECONDS)
            stderr.seek(0)
            said = stderr.read()
            stderr.close()
            raise RunFailed(f"gym-grpc run {' '.join(words)} exited with code {code} before it was ready:\n{said}")
        return cls(process, json.loads(line), stderr)

    @property
    def registry(self) -> str:
        """The registry's address, what clients give as --registry."""
        return str(self.ready["registry"])

    @property
    def servers(self) -> dict[str, str]:
        """Each server's address (its first, under Ray its first replica's), by name."""
        return {s["name"]: s["addresses"][0] for s in self.ready["servers"]}

    def info(self, name: str) -> dict[str, Any]:
        """A server's registry entry, as the ready line gave it."""
        for server in self.ready["servers"]:
            if server["name"] == name:
                return dict(server)
        raise KeyError(f"no server {name!r}; the run has {', '.join(self.servers)}")

    def replicas(self, name: str) -> list[str]:
        """The addresses of a server's replicas (one without Ray)."""
        return [replica["address"] for replica in self.info(name).get("replicas", [])]

    def worker_addresses(self, name: str) -> list[str]:
        """An address per worker process of a server that reaches that process alone (Worker.address),
        or its address when it runs as one process: where to ask each process for its own counters."""
        own = [
            str(worker["address"])
            for replica in self.info(name).get("replicas", [])
            for worker in replica.get("workers", [])
            if worker.get("address")
        ]
        return own or [self.servers[name]]

    def pids(self, name: str) -> list[int]:
        """The pids of a server's worker processes, as they were when it became ready."""
        return [
            int(worker["pid"])
            for replica in self.info(name).get("replicas", [])
            for worker in replica.get("workers", [])
            if "pid" in worker
        ]

    def log(self) -> str:
        """What the runner and its servers wrote to stderr so far."""
        self._stderr.flush()
        with open(self._stderr.name) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGINT) -> int:
        """Signal the run (SIGINT, as Ctrl-C) unless it has ended, and wait for it; its exit code.
        `log()` still reads what it said; leaving the `with` block removes that file."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()  # a test must not leave it behind; the expiry still fails the test
            self.process.wait()
            raise
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()

    def __enter__(self) -> GymRun:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        try:
            self.stop()
        finally:
            self._stderr.close()
