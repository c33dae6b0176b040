"""The event loop gym-grpc processes run on: uvloop by default where it is installed, asyncio's on request."""

import asyncio
import json
import os
import subprocess
import sys

import pytest

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


async def test_a_start_stopped_first_is_cancelled_and_cleans_up_before_stopped_first_returns():
    stop, cleaned = asyncio.Event(), []

    async def start():
        try:
            await asyncio.Event().wait()  # a start that hangs
        finally:
            cleaned.append("stopped what it started")

    asyncio.get_running_loop().call_soon(stop.set)
    assert await event_loop.stopped_first(start(), stop) is True
    assert cleaned == ["stopped what it started"]


async def test_a_start_that_ends_first_returns_false_and_one_that_fails_raises():
    async def fails():
        raise OSError("port in use")

    assert await event_loop.stopped_first(asyncio.sleep(0), asyncio.Event()) is False
    with pytest.raises(OSError, match="port in use"):
        await event_loop.stopped_first(fails(), asyncio.Event())


async def test_a_caller_cancelled_while_it_waits_cancels_the_start():
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def start():
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    waiting = asyncio.ensure_future(event_loop.stopped_first(start(), asyncio.Event()))
    await started.wait()
    waiting.cancel()
    await asyncio.wait_for(cancelled.wait(), 60)  # a bound on a hang
