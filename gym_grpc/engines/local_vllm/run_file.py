"""The engine a shell started: written in a run file, so that a later command can find it, or stop it.

`gym-grpc engine start|stop|status` and `python -m gym_grpc.engines.local_vllm
start|stop` both go through here. The run file is CACHE/run/vllm.json, or the
file GYM_GRPC_ENGINE_RUN_FILE names (a test's own engine, next to one that a
user started, with the same prepared virtualenv and model). A run file is
trusted only while its PID is still a vLLM: a stale run file never lets a start
be refused, nor a stop signal an unrelated process that reused the PID.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from gym_grpc import errors
from gym_grpc.engines.local_vllm.installation import Prepared, _locked, cache_dir
from gym_grpc.engines.local_vllm.process import DEFAULTS, Capacity, Engine, EngineStartError, start, stop

RUN_FILE_VARIABLE = "GYM_GRPC_ENGINE_RUN_FILE"


class AlreadyRunning(EngineStartError):
    """start_tracked() found the tracked engine still running."""

    reason = errors.Reason.ENGINE_ALREADY_RUNNING

    def __init__(self, engine: Engine) -> None:
        super().__init__(f"a vLLM is already running at {engine.base_url} (pid {engine.pid}): stop it first")
        self.engine = engine


class RunFileError(errors.FrameworkError, RuntimeError):
    """The run file exists but cannot be read."""

    reason = errors.Reason.ENGINE_RUN_FILE_UNREADABLE


def run_file_path() -> Path:
    """GYM_GRPC_ENGINE_RUN_FILE, or CACHE/run/vllm.json."""
    configured = os.environ.get(RUN_FILE_VARIABLE)
    return Path(configured).expanduser() if configured else cache_dir() / "run" / "vllm.json"


def is_vllm(pid: int) -> bool:
    """Whether pid is a running vLLM server (its command line names vLLM's entry point)."""
    try:
        return b"vllm.entrypoints" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def read_run_file() -> Engine | None:
    """The tracked engine, running or not; None without a run file; RunFileError if it is unreadable."""
    path = run_file_path()
    try:
        data = json.loads(path.read_text())
        return Engine(data["base_url"], int(data["pid"]), Path(data["log_path"]), data["model"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunFileError(f"cannot read {path}: {e}") from None


def tracked() -> Engine | None:
    """The tracked engine if its process is still a running vLLM, else None (an unreadable run file too)."""
    try:
        engine = read_run_file()
    except RunFileError:
        return None
    return engine if engine is not None and is_vllm(engine.pid) else None


def start_tracked(
    prepared: Prepared | None = None,
    *,
    ready_timeout: float,
    max_model_len: int,
    port: int | None = None,
    grpc: bool = False,
    capacity: Capacity = DEFAULTS,
    extra_args: Sequence[str] = (),
) -> Engine:
    """start() and write its run file; AlreadyRunning if the one in the run file still runs.

    A lock next to the run file makes a second start (another shell) wait for
    the first, then find its engine and refuse, instead of starting two."""
    path = run_file_path()
    with _locked(path.with_name(path.name + ".lock")):
        running = tracked()
        if running is not None:
            raise AlreadyRunning(running)
        engine = start(
            prepared,
            ready_timeout=ready_timeout,
            max_model_len=max_model_len,
            port=port,
            grpc=grpc,
            capacity=capacity,
            extra_args=extra_args,
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(engine.to_json())
        temporary.replace(path)
        return engine


def stop_tracked(pid: int | None = None) -> str:
    """Stop the tracked engine (or the vLLM with this pid) and say what was done.

    Without pid the run file is removed, whether its engine was still running or
    not; RunFileError if it cannot be read."""
    path = run_file_path()
    if pid is None:
        engine = read_run_file()
        if engine is None:
            return f"no engine in the run file {path}: nothing to stop"
        target = engine.pid
    else:
        target = pid
    if is_vllm(target):
        stop(target)
        said = f"stopped vLLM (pid {target})"
    else:
        said = f"process {target} is not a running vLLM: nothing to stop"
    if pid is None:
        path.unlink(missing_ok=True)
    return said
