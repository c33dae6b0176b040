"""A server that pauses (a GC pause, CPU starvation, VM steal: here SIGSTOP, then
SIGCONT) costs time, never a rollout whose deadline allows the wait.

Real processes: `gym-grpc run` serves the quickstart and `gym-grpc collect`
runs as a user runs it, while the test pauses the weather agent's process.
"""

import os
import signal
import subprocess
import time

import pytest

from tests.support import WEATHER, collect_args, read_rows, run_status, start_run, tool


def _collect(run, out, repeats: int, max_in_flight: int, timeout: float, log) -> subprocess.Popen:
    return subprocess.Popen(
        [
            tool("gym-grpc"),
            *collect_args(run.registry, "weather_agent", str(WEATHER), str(out)),
            "--num-repeats",
            str(repeats),
            "--max-in-flight",
            str(max_in_flight),
            "--timeout",
            str(timeout),
            "--no-progress",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
    )


@pytest.mark.slow
def test_an_agent_paused_while_the_collector_connects_costs_no_rollout(tmp_path):
    run = start_run()
    try:
        _, servers = run_status(run.registry)
        agent = servers["weather_agent"]["pid"]
        out, log = tmp_path / "out.jsonl", (tmp_path / "collect.log").open("w")
        os.kill(agent, signal.SIGSTOP)
        try:
            collector = _collect(run, out, repeats=80, max_in_flight=400, timeout=120, log=log)
            time.sleep(3)
            assert collector.poll() is None  # it waits for the agent rather than failing its rollouts
        finally:
            os.kill(agent, signal.SIGCONT)
        assert collector.wait(timeout=120) == 0, (tmp_path / "collect.log").read_text()[-2000:]
        assert len(read_rows(out)) == 5 * 80
        assert not (tmp_path / "out.failures.jsonl").exists()
    finally:
        run.stop()


@pytest.mark.slow
def test_an_agent_paused_longer_than_grpcs_30_s_queue_limit_mid_run_costs_no_rollout(tmp_path):
    """grpc cancels calls that wait more than 30 s for the application by default;
    the pause has to be longer than that for this test to mean anything."""
    run = start_run("servers.policy_model.config.latency_seconds=0.2")
    try:
        _, servers = run_status(run.registry)
        agent = servers["weather_agent"]["pid"]
        out, log = tmp_path / "out.jsonl", (tmp_path / "collect.log").open("w")
        collector = _collect(run, out, repeats=400, max_in_flight=2000, timeout=300, log=log)
        while not out.exists() or not out.read_bytes():  # mid-run: rollouts are finishing
            assert collector.poll() is None, (tmp_path / "collect.log").read_text()
            time.sleep(0.05)
        os.kill(agent, signal.SIGSTOP)
        try:
            time.sleep(33)
        finally:
            os.kill(agent, signal.SIGCONT)
        assert collector.wait(timeout=300) == 0, (tmp_path / "collect.log").read_text()[-2000:]
        assert len(read_rows(out)) == 5 * 400
        assert not (tmp_path / "out.failures.jsonl").exists()
    finally:
        run.stop()
