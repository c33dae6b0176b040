"""The engine a shell started: recorded in a file, so that a later command can find it, or stop it.

`gym-grpc engine start|stop|status` and `python -m gym_grpc.engines.local_vllm
start|stop` both go through here. The record is CACHE/run/vllm.json, or the
file GYM_GRPC_ENGINE_RECORD names (a test's own engine, next to one that a
user started, with the same prepared virtualenv and model). A record is
trusted only while its PID is still a vLLM: a stale record never lets a start
be refused, nor a stop signal an unrelated process that reused the PID.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gym_grpc import errors
from gym_grpc.engines.local_vllm.installation import Prepared, _locked, cache_dir
from gym_grpc.engines.local_vllm.process import Engine, EngineStartError, start, stop

RECORD_VARIABLE = "GYM_GRPC_ENGINE_RECORD"


class AlreadyRunning(EngineStartError):
    """start_recorded() found the recorded engine still running."""

    reason = errors.Reason.ENGINE_ALREADY_RUNNING

    def __init__(self, engine: Engine) -> None:
        super().__init__(f"a vLLM is already running at {engine.base_url} (pid {engine.pid}): stop it first")
        self.engine = engine


class RecordError(errors.FrameworkError, RuntimeError):
    """The record exists but cannot be read."""

    reason = errors.Reason.ENGINE_RECORD_UNREADABLE


def record_path() -> Path:
    """GYM_GRPC_ENGINE_RECORD, or CACHE/run/vllm.json."""
    configured = os.environ.get(RECORD_VARIABLE)
    return Path(configured).expanduser() if configured else cache_dir() / "run" / "vllm.json"


def is_vllm(pid: int) -> bool:
    """Whether pid is a running vLLM server (its command line names vLLM's entry point)."""
    try:
        return b"vllm.entrypoints" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def read_record() -> Engine | None:
    """The recorded engine, running or not; None without a record; RecordError if it is unreadable."""
    path = record_path()
    try:
        data = json.loads(path.read_text())
        return Engine(data["base_url"], int(data["pid"]), Path(data["log_path"]), data["model"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RecordError(f"cannot read {path}: {e}") from None


def recorded() -> Engine | None:
    """The recorded engine if its process is still a running vLLM, else None (an unreadable record too)."""
    try:
        engine = read_record()
    except RecordError:
        return None
    return engine if engine is not None and is_vllm(engine.pid) else None


def start_recorded(
    prepared: Prepared | None = None, *, ready_timeout: float, max_model_len: int, port: int | None = None
) -> Engine:
    """start() and record the engine; AlreadyRunning if the recorded one still runs.

    A lock next to the record makes a second start (another shell) wait for
    the first, then find its engine and refuse, instead of starting two."""
    path = record_path()
    with _locked(path.with_name(path.name + ".lock")):
        running = recorded()
        if running is not None:
            raise AlreadyRunning(running)
        engine = start(prepared, ready_timeout=ready_timeout, max_model_len=max_model_len, port=port)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(engine.to_json())
        temporary.replace(path)
        return engine


def stop_recorded(pid: int | None = None) -> str:
    """Stop the recorded engine (or the vLLM with this pid) and say what was done.

    Without pid the record is removed, whether its engine was still running or
    not; RecordError if it cannot be read."""
    path = record_path()
    if pid is None:
        engine = read_record()
        if engine is None:
            return f"no engine recorded in {path}: nothing to stop"
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
