"""The testing kit's own promises: every name it exports resolves, and its checks run without pytest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import gym_grpc.testing as kit
from gym_grpc.testing.processes import descendants
from tests.support import alive, command_line, one_server_config


def test_every_exported_name_resolves_to_its_module():
    assert sorted(kit.__all__) == sorted(kit._HOMES)
    for name in kit.__all__:
        value = getattr(kit, name)
        assert value.__module__ == f"gym_grpc.testing.{kit._HOMES[name]}", name


def test_the_checks_and_the_cli_load_without_pytest_or_the_fake_engine():
    code = (
        "import sys, gym_grpc.cli.app, gym_grpc.testing.checks; "
        "loaded = [m for m in ('pytest', 'pytest_asyncio', 'gym_grpc.testing.fake_engine') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


#: A program that waits in GymRun.start, with SIGTERM turned into SystemExit as bench/run.py does.
STARTING = """
import signal, sys
from gym_grpc.testing.processes import GymRun

signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
GymRun.start(sys.argv[1])
"""


@pytest.mark.slow
def test_a_gym_run_start_interrupted_before_its_servers_are_ready_stops_the_run(tmp_path):
    begun = tmp_path / "started"
    config = one_server_config(
        tmp_path, "hanging", "tests/programs/hanging_env.py:HangingEnv", {"started_file": str(begun)}
    )
    program = subprocess.Popen([sys.executable, "-c", STARTING, str(config)], cwd=tmp_path)
    started: list[int] = []
    try:
        # The server's process waits in its start: the program waits for the ready line.
        deadline = time.monotonic() + 120  # a bound on a hang, not a timing claim
        while not begun.exists():
            assert program.poll() is None and time.monotonic() < deadline, "the server's start never began"
            time.sleep(0.05)
        started = descendants(program.pid)
        program.send_signal(signal.SIGTERM)
        assert program.wait(timeout=120) == 128 + signal.SIGTERM
        assert [command_line(pid) for pid in started if alive(pid)] == []  # stopped before the program ended
    finally:
        program.kill()
        program.wait()
        for pid in started:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
