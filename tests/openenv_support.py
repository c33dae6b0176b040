"""The real OpenEnv for the tests: the `openenv` package in a virtualenv of its own, and an environment it
generates, served by its own server code.

OpenEnv 0.10 needs fastmcp 3, hence mcp 1.x, while the test extra holds mcp 2 (verifiers 0.4 pins it):
the two cannot share one environment. So the tests build, once per machine, a virtualenv with `openenv`
alone under ~/.cache/gym-grpc-openenv/<version> (GYM_GRPC_OPENENV_CACHE to move it), and generate there,
with `openenv init echo_env`, the environment OpenEnv's own template makes (an echo env: each step's
reward is min(0.1 * len(message), 1)). A file lock makes parallel test processes (pytest -n 3) build it
once; a marker file holding the spec makes it rebuilt when the spec changes. OpenEnv is BSD-3-Clause.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gym_grpc.engines.local_vllm.installation import build_once

OPENENV_VERSION = "0.10.0"
SPEC = {"requirements": [f"openenv=={OPENENV_VERSION}"], "env": "openenv init echo_env", "max_concurrent_envs": 16}
_LISTENING = re.compile(r"running on (http://[^\s]+)")


@dataclass(frozen=True)
class OpenEnvInstall:
    """The prepared OpenEnv: its interpreter, and the directory holding the generated echo_env package."""

    python: Path
    envs: Path

    def echo_command(self) -> list[str]:
        """The command that serves the echo env with OpenEnv's own server (uvicorn on a port of its choosing)."""
        return [str(self.python), "-m", "uvicorn", "echo_env.server.app:app", "--host", "127.0.0.1", "--port", "0"]

    def run(
        self, script: str, *args: str, timeout: float = 120, cwd: Path | None = None
    ) -> subprocess.CompletedProcess:
        """A Python program run by OpenEnv's interpreter (its own client code) in `cwd` (default: where the
        echo env is), output captured."""
        return subprocess.run(
            [str(self.python), "-c", script, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=cwd or self.envs,
        )


def cache_dir() -> Path:
    configured = os.environ.get("GYM_GRPC_OPENENV_CACHE")
    base = Path(configured).expanduser() if configured else Path.home() / ".cache" / "gym-grpc-openenv"
    return base / OPENENV_VERSION


def _run(step: str, command: list[str], **kwargs) -> None:
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"preparing OpenEnv: {step} failed (exit status {done.returncode}):\n{tail}")


def prepare() -> OpenEnvInstall:
    """The OpenEnv virtualenv and echo env, built unless the cache holds them (about 30 s the first time),
    as the local vLLM's are (installation.build_once: a marker of the spec, a file lock)."""
    root = cache_dir()
    install = OpenEnvInstall(root / "venv" / "bin" / "python", root / "envs")
    build_once(root, SPEC, "OpenEnv virtualenv", lambda directory: _build(directory, install))
    return install


def _build(root: Path, install: OpenEnvInstall) -> None:
    root.mkdir(parents=True)
    _run("creating the virtualenv", [sys.executable, "-m", "venv", str(root / "venv")])
    _run("installing openenv", [str(install.python), "-m", "pip", "install", "-q", *SPEC["requirements"]])
    install.envs.mkdir()
    _run("openenv init echo_env", [str(root / "venv" / "bin" / "openenv"), "init", "echo_env"], cwd=install.envs)
    # The template serves one session at a time ("increase this number to allow more concurrent WebSocket
    # sessions", its app.py says); a run collects several rollouts at once.
    app = install.envs / "echo_env" / "server" / "app.py"
    text = app.read_text()
    assert "max_concurrent_envs=1," in text, "OpenEnv's template changed: see tests/openenv_support.py"
    app.write_text(text.replace("max_concurrent_envs=1,", f"max_concurrent_envs={SPEC['max_concurrent_envs']},"))


class OpenEnvServer:
    """An OpenEnv server process (started with `command`), its URL read from what uvicorn prints."""

    def __init__(self, command: list[str], cwd: Path) -> None:
        self.process = subprocess.Popen(
            command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.output: list[str] = []
        self.url = self._wait_listening(60.0)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.put(line.rstrip())
        self.lines.put(None)

    def _wait_listening(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.stop()
                raise RuntimeError(f"the OpenEnv server did not listen within {timeout:g} s: {self.output}") from None
            if line is None:
                raise RuntimeError(f"the OpenEnv server exited ({self.process.wait()}): {self.output}")
            self.output.append(line)
            found = _LISTENING.search(line)
            if found:
                return found.group(1)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
