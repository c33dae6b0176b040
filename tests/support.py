"""Parts shared by the repository's tests. The scripted model, the calculator
environment and the server helpers are the testing kit's (`gym_grpc.testing`);
they are named here too, as the tests have always imported them."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from gym_grpc.responses import input_items, message_text
from gym_grpc.testing import Calculator, ScriptedModel, call, say, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.testing.processes import GymRun, gym_grpc_command
from gym_grpc.v1 import responses_pb2 as r

__all__ = ["REPO", "Calculator", "EchoModel", "ScriptedModel", "call", "nested_json", "say", "static_registry", "task"]

REPO = Path(__file__).resolve().parent.parent
#: The virtualenv's scripts: gym-grpc, grpcurl.
BIN = Path(sys.executable).parent
WEATHER = REPO / "servers" / "resources" / "weather" / "data" / "example.jsonl"
MATH = REPO / "servers" / "resources" / "math" / "data" / "example.jsonl"
QUICKSTART = REPO / "configs" / "quickstart.yaml"


def nested_json(levels: int) -> str:
    """JSON text of `levels` objects, each inside the one before: the most a Struct pays per level."""
    return '{"a": ' * levels + "1" + "}" * levels


class EchoModel(ScriptedModel):
    """Answers with the prompt after `delay` s, or once `gate` is set if it is given; fails on
    prompts containing "fail"; counts concurrent and cancelled calls."""

    def __init__(self, delay: float = 0.01, gate: asyncio.Event | None = None):
        super().__init__([])
        self.delay = delay
        self.gate = gate
        self.active = self.peak = self.cancelled = 0

    async def create_response(self, params, session_id):
        self.requests.append(params)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await (self.gate.wait() if self.gate else asyncio.sleep(self.delay))
            text = message_text(input_items(params)[-1].message)
            if "fail" in text:
                raise RuntimeError("engine exploded")
            return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=say(text))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1


async def eventually(condition: Callable[[], object], what: str, seconds: float = 30.0) -> None:
    """Wait for a condition another task or process brings about, looking every 10 ms.

    `seconds` bounds a hang, it is not a timing assertion: generous, for a loaded machine."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds:.0f} s: {what}")
        await asyncio.sleep(0.01)


def collect_args(registry: str, agent: str, tasks: object, output: object) -> list[str]:
    """The start of a `gym-grpc collect` command line: the registry, the agent, the input and the output."""
    return ["collect", "--registry", registry, "--agent", agent, "--input", str(tasks), "--output", str(output)]


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie has ended)."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):  # gone, or reaped between the two
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"  # the state follows the command name, which may hold spaces


def script(path: str, name: str) -> ModuleType:
    """A script of the repository that is no package module (bench/, dev/; `path` from the root), loaded
    as module `name` and registered under it, as its dataclasses need."""
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    assert spec is not None and spec.loader is not None, path
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def command_line(pid: int) -> str:
    """Process `pid`'s command line, its words joined by spaces ("" once it has gone)."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def tool(name: str) -> str:
    """A command of this virtualenv (else of PATH), such as grpcurl."""
    path = shutil.which(name, path=str(BIN)) or shutil.which(name)
    assert path, f"{name} is not installed: pip install -e '.[test]'"
    return path


def gym(*args: str, timeout: float = 300, **kwargs: Any) -> subprocess.CompletedProcess:
    """Run the `gym-grpc` command of this interpreter's environment to its end (output captured as text)."""
    return subprocess.run([gym_grpc_command(), *args], capture_output=True, text=True, timeout=timeout, **kwargs)


def grpcurl(*args: str) -> str:
    """grpcurl -plaintext ARGS's output; the call must succeed."""
    done = subprocess.run([tool("grpcurl"), "-plaintext", *args], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout


def read_rows(path: Path) -> list[dict]:
    """The JSON objects of a JSONL file."""
    return [json.loads(line) for line in path.read_bytes().splitlines()]  # bytes: "\n" only, not U+2028


def limit_open_files(soft: int, hard: int) -> Callable[[], None]:
    """For `preexec_fn`: start a process with these limits on its open files."""
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def start_run(
    *overrides: str, configs: tuple[Path, ...] = (), open_files: tuple[int, int] | None = None, **kwargs: Any
) -> GymRun:
    """`gym-grpc run` of `configs` (the quickstart's when none) and `overrides`, once every server is healthy,
    with `open_files` as its (soft, hard) limits on open files if given."""
    preexec_fn = limit_open_files(*open_files) if open_files else None
    return GymRun.start(*(configs or (QUICKSTART,)), *overrides, preexec_fn=preexec_fn, **kwargs)


def worker_process(
    name: str, entrypoint: str, config: dict[str, Any], registry: str = "127.0.0.1:1"
) -> tuple[subprocess.Popen, str]:
    """Server `name` in its own process, as `gym-grpc run` starts one (gym_grpc.server.worker), with
    `registry` to find its peers by; the process and the server's address once it serves."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gym_grpc.server.worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    spec = {
        "name": name,
        "entrypoint": entrypoint,
        "host": "127.0.0.1",
        "port": 0,
        "config": config,
        "registry": registry,
        "grace": 1.0,
    }
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write(json.dumps(spec) + "\n")
    process.stdin.flush()
    report = json.loads(process.stdout.readline())
    return process, f"127.0.0.1:{report['servers'][0]['port']}"


def run_status(registry: str) -> tuple[int, dict[str, dict]]:
    """`gym-grpc status --json` of a run: its exit code and each server's row by name."""
    done = gym("status", "--registry", registry, "--json", "--interval", "0.2")
    return done.returncode, {row["name"]: row for row in json.loads(done.stdout)}


def _tcp_sockets() -> list[list[str]]:
    """The fields of every TCP socket's line of /proc/net/tcp and tcp6 (grpc listens on v4-mapped
    IPv6 sockets): 1 the local address, 2 the remote, 3 the state, 9 the inode."""
    tables = ("/proc/net/tcp", "/proc/net/tcp6")
    return [line.split() for table in tables for line in Path(table).read_text().splitlines()[1:]]


def _port_of(address: str) -> int:
    return int(address.rsplit(":", 1)[1], 16)


def _socket_links(pid: int) -> set[str]:
    """The "socket:[inode]" links of a process's open files (empty once it is gone)."""
    links = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                links.add(os.readlink(fd))
    return links


def listening_pids(port: int) -> list[int]:
    """Processes with a socket listening on a TCP port (Linux /proc)."""
    inodes = {f"socket:[{f[9]}]" for f in _tcp_sockets() if _port_of(f[1]) == port and f[3] == "0A"}
    return sorted(int(d.name) for d in Path("/proc").glob("[0-9]*") if _socket_links(int(d.name)) & inodes)


def connections_from(pids: Iterable[int], ports: Iterable[int]) -> int:
    """TCP connections the processes `pids` hold established to any of `ports` (Linux /proc).

    Counted from the processes' own sockets: a connection some other process of this machine
    makes to one of the ports (the tests run side by side) is not theirs."""
    links = set().union(*(_socket_links(pid) for pid in pids))
    wanted = set(ports)
    return sum(1 for f in _tcp_sockets() if f[3] == "01" and _port_of(f[2]) in wanted and f"socket:[{f[9]}]" in links)


def cpu_ticks(pid: int) -> int:
    """The CPU time a process used so far, in clock ticks (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def one_server_config(directory: Path, name: str, entrypoint: str, config: dict[str, Any]) -> Path:
    """A config file (in `directory`) that adds one server to a run: `name`, its `entrypoint` (a file of
    this repository, as "servers/models/local_policy/server.py:LocalPolicyModel") and its config."""
    path = directory / f"{name}.yaml"
    spec = {"entrypoint": str(REPO / entrypoint), "config": config}
    path.write_text(json.dumps({"servers": {name: spec}}))  # JSON is YAML
    return path
