"""The event loop gym-grpc processes run on: uvloop by default where it is installed, asyncio's on request."""

import asyncio
import json
import os
import subprocess
import sys

from gym_grpc.rpc import event_loop

PROBE = (
    "import asyncio, json; from gym_grpc.rpc import event_loop\n"
    "async def which():\n"
    "    return type(asyncio.get_running_loop()).__module__\n"
    "print(json.dumps([event_loop.name(), event_loop.run(which())]))"
)


def _loop_in_a_fresh_process(**env: str) -> list[str]:
    base = {k: v for k, v in os.environ.items() if k != event_loop.VARIABLE}
    command = [sys.executable, "-c", PROBE]
    done = subprocess.run(command, capture_output=True, text=True, env={**base, **env}, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_uvloop_runs_by_default_and_asyncio_when_asked():
    assert _loop_in_a_fresh_process() == ["uvloop", "uvloop"]
    assert _loop_in_a_fresh_process(GYM_GRPC_EVENT_LOOP="asyncio") == ["asyncio", "asyncio.unix_events"]


def test_run_returns_what_the_coroutine_returns():
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    assert event_loop.run(answer()) == 42


def test_run_collects_cycles_less_often_and_freezes_what_start_up_made():
    probe = (
        "import gc, json; from gym_grpc.rpc import event_loop\n"
        "before = gc.get_threshold()[0]\n"
        "async def inside():\n"
        "    return [gc.get_threshold()[0], gc.get_freeze_count()]\n"
        "print(json.dumps([before, *event_loop.run(inside())]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    before, threshold, frozen = json.loads(done.stdout)
    assert before == 700  # CPython's default, changed only by run
    assert threshold == event_loop.GC_YOUNG_THRESHOLD
    assert frozen > 1000  # the modules imported before the loop started
