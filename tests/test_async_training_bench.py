"""bench/async_training.py's choices: which of a mode's repeated runs is reported, and --group-workers."""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import pytest

from tests.support import script


def _run(share: float, name: str) -> dict:
    return {"name": name, "gym_grpc_cpu_share_of_engine": share, "steps": [{"step": 0}]}


def test_the_run_of_median_share_is_reported_with_every_run_beside_it_in_the_order_run():
    bench = script("bench/async_training.py", "bench_async_training")
    median = bench.median_run([_run(0.03, "a"), _run(0.01, "b"), _run(0.02, "c")])
    assert median["name"] == "c"
    assert median["steps"] == [{"step": 0}]  # the median run's own steps stay
    assert [run["name"] for run in median["runs"]] == ["a", "b", "c"]
    assert all("steps" not in run for run in median["runs"])


def test_of_an_even_count_the_lower_middle_run_is_reported_and_one_run_is_reported_as_it_is():
    bench = script("bench/async_training.py", "bench_async_training")
    assert bench.median_run([_run(0.04, "a"), _run(0.01, "b"), _run(0.03, "c"), _run(0.02, "d")])["name"] == "d"
    one = _run(0.02, "a")
    assert bench.median_run([one]) is one


def test_group_workers_takes_what_a_configuration_takes_and_refuses_the_rest():
    bench = script("bench/async_training.py", "bench_async_training")
    assert bench.group_workers("auto") == "auto"
    assert bench.group_workers("3") == 3
    for bad in ("0", "two", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.group_workers(bad)


def _wait(pipe: Connection) -> None:
    pipe.send("started")
    pipe.recv()


def test_the_stacks_cpu_is_split_by_what_each_process_runs():
    """A check pool's process is one multiprocessing spawned (as CpuPool does), a server worker runs
    gym_grpc.server.worker, and anything else in the tree is the supervisor's. Each child is asked
    only once it says it runs: right after a fork and exec its /proc/PID/cmdline can still be empty
    (once in 200 starts here)."""
    bench = script("bench/async_training.py", "bench_async_training")
    theirs, ours = multiprocessing.Pipe()
    child = multiprocessing.get_context("spawn").Process(target=_wait, args=(theirs,), daemon=True)
    child.start()
    try:
        assert ours.poll(60) and ours.recv() == "started"
        assert child.pid is not None
        assert bench._server_role(child.pid) == "check_pools"
    finally:
        ours.send(None)
        child.join(10)
    worker = subprocess.Popen(
        [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(30)", "gym_grpc.server.worker"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None and worker.stdout.readline() == "started\n"
        assert bench._server_role(worker.pid) == "workers"
    finally:
        worker.kill()
        worker.wait()
    assert bench._server_role(os.getpid()) == "supervisor"


def test_the_meters_own_walk_through_proc_is_not_counted_as_gym_grpcs(monkeypatch):
    """CpuMeter reads the stack's and the engine's /proc on the event loop's thread, whose CPU it counts
    as gym-grpc's: its reading at the start and at the end must fall outside what it counts. Here a
    reading of the tree costs 0.2 CPU s, and nothing else runs on this thread between the two."""
    bench = script("bench/async_training.py", "bench_async_training")

    def costly_tree(root: int) -> dict[int, float]:
        began = time.thread_time()
        while time.thread_time() - began < 0.2:
            pass
        return {}

    monkeypatch.setattr(bench.bench_real, "_tree_cpu", costly_tree)
    meter = bench.CpuMeter(stack_pid=os.getpid(), engine_pid=os.getpid())
    used = meter.report(wall=1.0, steps=1)["cpu_seconds"]
    assert used["gym_grpc_in_trainer"] < 0.1  # 0.4 or more when a reading is counted
