"""CpuPool: checks run in another process, survive a dead worker, and run the same on Ray."""

import asyncio
import os
import signal
import sys
import time

import pytest

from gym_grpc.cpu_pool import CpuPool, checks_busy
from gym_grpc.errors import ConfigError


@pytest.fixture
async def pool():
    """A started pool of one worker process, closed after the test."""
    started = CpuPool("t", workers=1)
    await started.start()
    yield started
    started.close()


def where_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


async def test_a_check_runs_in_another_process(pool):
    pid, value = await pool.run(where_and_square, 7)
    assert value == 49 and pid != os.getpid()


async def test_a_dead_worker_is_replaced_and_its_check_tried_again(pool):
    first, _ = await pool.run(where_and_square, 2)
    os.kill(first, signal.SIGKILL)
    second, value = await pool.run(where_and_square, 3)
    assert value == 9 and second != first


async def test_busy_seconds_count_the_time_workers_spend_on_checks_those_running_included(pool):
    """What an agent reports of its pools (RunManyResponse.load): the seconds their workers spent on
    checks, a check still running counted up to now; a closed pool no longer counts."""
    workers = pool._processes
    assert workers.busy_seconds(time.monotonic()) == 0.0
    await pool.run(time.sleep, 0.2)
    done = workers.busy_seconds(time.monotonic())
    assert done >= 0.2
    running = asyncio.ensure_future(pool.run(time.sleep, 60))
    await asyncio.sleep(0)  # the run's first step sends the check to the worker
    assert [len(worker.calls) for worker in workers.workers] == [1]
    began = time.monotonic()  # the check was sent before this: it counts from here at least
    await asyncio.sleep(0.5)
    now = time.monotonic()
    assert workers.busy_seconds(now) >= done + (now - began)
    before_close = checks_busy(now)  # every pool of this process, this one among them
    assert before_close[0] >= done + (now - began) and before_close[1] >= 1
    pool.close()
    assert checks_busy(now)[1] == before_close[1] - 1
    with pytest.raises(RuntimeError, match="closed"):
        await running


async def test_run_before_start_is_an_error():
    with pytest.raises(RuntimeError, match="before start"):
        await CpuPool("t").run(where_and_square, 1)


async def test_a_ray_address_without_ray_installed_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray now raises ImportError
    with pytest.raises(ConfigError, match="Ray is not installed"):
        await CpuPool("math", ray_address="auto").start()


@pytest.mark.slow
async def test_on_ray_a_check_gives_the_same_result_and_leaves_a_ray_it_joined(local_ray):
    pool = CpuPool("t", workers=1, ray_address="local")
    await pool.start()
    pid, value = await pool.run(where_and_square, 7)
    assert value == 49 and pid != os.getpid()
    pool.close()
    assert local_ray.is_initialized()  # it joined the session's Ray, so it does not stop it


CLOSE_WITH_A_CHECK_RUNNING = """
import asyncio, os, sys, time
from gym_grpc.cpu_pool import CpuPool

async def main():
    pool = CpuPool("exit", workers=2)
    await pool.start()
    print(await pool.run(os.getpid), flush=True)  # a worker's pid
    running = asyncio.ensure_future(pool.run(time.sleep, 60))
    await asyncio.sleep(0.5)  # the sleep is in a worker
    started = time.monotonic()
    pool.close()
    print(round(time.monotonic() - started, 1), flush=True)
    running.cancel()

asyncio.run(main())
"""


def test_close_stops_the_workers_at_once_and_the_process_exits_cleanly():
    """A server stops with a check still running: close() must not wait for it, and the
    process must exit without the traceback CPython 3.11 prints when a pool is left
    winding down at exit (OSError: Bad file descriptor in concurrent.futures)."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-c", CLOSE_WITH_A_CHECK_RUNNING], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    worker, seconds = done.stdout.split()
    assert float(seconds) < 30  # not the 60 s the check would take
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    with pytest.raises(ProcessLookupError):
        os.kill(int(worker), 0)  # the workers are gone with the pool


def fail(message: str) -> None:
    raise ValueError(message)


class NeedsTwoArguments(Exception):
    def __init__(self, a: str, b: str) -> None:  # pickled with args (a,) only: it cannot be unpickled
        super().__init__(a)


def fail_unpicklably() -> None:
    raise NeedsTwoArguments("a", "b")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def touch(path: str) -> None:
    with open(path, "w"):
        pass


async def test_a_checks_error_reaches_its_caller_with_the_workers_traceback(pool):
    with pytest.raises(ValueError, match="no answer") as raised:
        await pool.run(fail, "no answer")
    assert "in the check worker" in "".join(raised.value.__notes__)
    assert "raise ValueError(message)" in "".join(raised.value.__notes__)
    with pytest.raises(TypeError, match="cannot read a check's result"):
        await pool.run(fail_unpicklably)
    assert (await pool.run(where_and_square, 3))[1] == 9  # the worker serves on


async def test_a_check_that_kills_its_worker_twice_fails_and_the_one_sent_after_it_still_runs(pool):
    dying, after = await asyncio.gather(pool.run(die), pool.run(where_and_square, 4), return_exceptions=True)
    assert isinstance(dying, RuntimeError) and "the check's worker died twice" in str(dying)
    assert after[1] == 16
    assert (await pool.run(where_and_square, 5))[1] == 25


async def test_a_check_whose_caller_gave_up_while_it_waited_for_a_worker_never_runs(tmp_path, pool):
    """A worker is sent the check it runs and the next one (so that it never waits for the loop between
    two); a third waits in the pool, and is dropped when its caller gives up."""
    running = asyncio.ensure_future(pool.run(time.sleep, 0.5))  # the one worker, for half a second at least
    next_one = asyncio.ensure_future(pool.run(time.sleep, 0))
    waiting = asyncio.ensure_future(pool.run(touch, str(tmp_path / "ran")))
    await asyncio.sleep(0)  # all three submitted
    waiting.cancel()
    await asyncio.gather(running, next_one)
    await pool.run(where_and_square, 1)  # after the cancelled one, had it been sent
    assert not (tmp_path / "ran").exists()


def exit_at_once(conn) -> None:
    os._exit(3)


async def test_workers_that_die_as_they_start_fail_the_checks_rather_than_start_again_forever(monkeypatch):
    from gym_grpc import cpu_pool

    monkeypatch.setattr(cpu_pool, "_serve", exit_at_once)  # what the spawned workers run
    pool = CpuPool("t", workers=1)
    await pool.start()
    try:
        with pytest.raises(RuntimeError, match=r"a check worker died as it started \(exit code 3\)"):
            await asyncio.wait_for(pool.run(where_and_square, 2), 120)  # not forever, should workers respawn
        with pytest.raises(RuntimeError, match="died as it started"):
            await pool.run(where_and_square, 3)
    finally:
        pool.close()


async def test_a_call_too_big_to_wait_in_a_busy_workers_pipe_waits_for_an_idle_worker(pool):
    """Queued behind a running check, a call waits in the pipe's buffer: one larger than that would block
    the event loop's write until the check ended, so it waits in the pool instead."""
    await pool.run(where_and_square, 1)  # the worker serves
    running = asyncio.ensure_future(pool.run(time.sleep, 1))
    await asyncio.sleep(0)  # sent: the worker runs it
    big = asyncio.ensure_future(pool.run(len, "x" * 1_000_000))
    small = asyncio.ensure_future(pool.run(len, "x" * 10))
    await asyncio.sleep(0)  # both submitted
    (worker,) = pool._processes.workers
    assert len(worker.calls) == 1 and len(pool._processes.waiting) == 2  # neither queued behind the sleep
    await running
    assert await big == 1_000_000 and await small == 10


def wait_for_file(path: str, most_seconds: float = 60.0) -> bool:
    """A check that runs until `path` exists (True), or `most_seconds` (False): a slow check the test ends."""
    deadline = time.monotonic() + most_seconds
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


async def _first_done(*futures: asyncio.Future) -> asyncio.Future:
    done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    return next(iter(done))


async def test_a_check_sent_while_a_worker_starts_waits_for_it_rather_than_behind_a_slow_check(tmp_path):
    """Both checks come before either worker serves: the slow one goes to the first worker that is
    ready, and the quick one waits for the second rather than in the first one's pipe behind it."""
    pool = CpuPool("t", workers=2)
    await pool.start()
    release = str(tmp_path / "release")
    try:
        slow = asyncio.ensure_future(pool.run(wait_for_file, release))
        quick = asyncio.ensure_future(pool.run(where_and_square, 3))
        assert await _first_done(slow, quick) is quick  # the slow one would give up after 60 s
        assert quick.result()[1] == 9
        touch(release)
        assert await slow is True
    finally:
        touch(release)
        pool.close()


async def test_a_check_queued_behind_a_busy_worker_goes_behind_the_one_that_began_last(tmp_path):
    """With every worker busy, a check waits in the pipe of the worker whose check began last: not
    behind one that has been running for long."""
    pool = CpuPool("t", workers=2)
    await pool.start()
    long_release, short_release = str(tmp_path / "long"), str(tmp_path / "short")
    try:
        while not all(worker.ready for worker in pool._processes.workers):
            await asyncio.sleep(0.01)
        slow = asyncio.ensure_future(pool.run(wait_for_file, long_release))
        await asyncio.sleep(0)  # sent to one worker
        short = asyncio.ensure_future(pool.run(wait_for_file, short_release))
        await asyncio.sleep(0)  # sent to the other: both busy
        after = asyncio.ensure_future(pool.run(where_and_square, 4))
        await asyncio.sleep(0)
        assert not pool._processes.waiting  # queued in a worker's pipe, not in the pool
        touch(short_release)
        assert await _first_done(slow, after) is after
        assert after.result()[1] == 16 and await short is True
        touch(long_release)
        assert await slow is True
    finally:
        touch(long_release)
        touch(short_release)
        pool.close()
