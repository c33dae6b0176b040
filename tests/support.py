"""Parts shared by the repository's tests. The scripted model, the calculator
environment and the server helpers are the testing kit's (`gym_grpc.testing`);
they are named here too, as the tests have always imported them."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from gym_grpc.responses import input_items, message_text
from gym_grpc.testing import Calculator, ScriptedModel, call, say, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.v1 import responses_pb2 as r

__all__ = ["REPO", "Calculator", "EchoModel", "ScriptedModel", "call", "nested_json", "say", "static_registry", "task"]

REPO = Path(__file__).resolve().parent.parent


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
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def gym_grpc(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run the `gym-grpc` command of this interpreter's environment to its end."""
    command = str(Path(sys.executable).with_name("gym-grpc"))
    return subprocess.run([command, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)


@contextlib.contextmanager
def gym_grpc_run(*args: str, cwd: Path = REPO) -> Iterator[str]:
    """A real `gym-grpc run ARGS --registry 127.0.0.1:0` process, once its servers are healthy;
    yields its registry address and stops it (SIGTERM) at the end."""
    stderr = tempfile.NamedTemporaryFile("w+", prefix="gym-grpc-run-", suffix=".log")
    command = str(Path(sys.executable).with_name("gym-grpc"))
    process = subprocess.Popen(
        [command, "run", *args, "--registry", "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=stderr, text=True, cwd=cwd
    )
    try:
        lines = []
        for line in process.stdout or ():
            lines.append(line)
            if "servers healthy" in line:
                break
        else:
            stderr.seek(0)
            raise AssertionError("gym-grpc run stopped before it was ready:\n" + "".join(lines) + stderr.read())
        yield lines[0].split()[1]
    finally:
        process.terminate()
        process.wait(timeout=60)
        stderr.close()
