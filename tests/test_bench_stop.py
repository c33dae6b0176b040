"""A benchmark stopped from outside leaves nothing of its own running: bench/run.py in a process of
its own, stopped while a collector runs against its stack (`--only durable`, which would take minutes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gym_grpc.testing.processes import descendants
from tests.support import alive, command_line

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture
def collecting(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, dict[int, str]]]:
    """The benchmark, once its collector runs, and the processes it had started by then (their commands)."""
    log = (tmp_path / "bench.log").open("w")
    bench = subprocess.Popen(
        [sys.executable, str(REPO / "bench/run.py"), "--only", "durable", "--name", "stopped"], stderr=log, cwd=REPO
    )
    started: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 300  # a bound on a hang, not a timing claim
        while not any(" collect " in command for command in started.values()):
            assert bench.poll() is None, (tmp_path / "bench.log").read_text()
            assert time.monotonic() < deadline, "no collector after 300 s"
            time.sleep(0.1)
            started = {pid: command_line(pid) for pid in descendants(bench.pid)}
        yield bench, started
    finally:
        bench.kill()
        bench.wait()
        for pid in started:  # what a failing test left behind
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        log.close()


def _left_running(pids: dict[int, str], seconds: float) -> dict[int, str]:
    """Which of `pids` still run after up to `seconds` (a bound on a hang)."""
    deadline = time.monotonic() + seconds
    while (left := {pid: command for pid, command in pids.items() if alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def test_sigterm_stops_the_stack_and_the_collector_before_the_benchmark_exits(collecting):
    bench, started = collecting
    assert any(" run " in command for command in started.values()), started  # its `gym-grpc run`
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=120) == 128 + signal.SIGTERM  # by its own exit, after its clean-up
    assert _left_running(started, 0) == {}


def test_sigkill_takes_the_processes_it_started_with_it(collecting):
    bench, started = collecting
    bench.kill()
    bench.wait()
    assert _left_running(started, 60) == {}
