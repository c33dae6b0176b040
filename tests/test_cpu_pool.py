"""CpuPool: checks run in another process, survive a dead worker, and run the same on Ray."""

import os
import signal
import sys

import pytest

from gym_grpc.cpu_pool import CpuPool
from gym_grpc.errors import ConfigError


def where_and_square(x: int) -> tuple[int, int]:
    return os.getpid(), x * x


async def test_a_check_runs_in_another_process():
    pool = CpuPool("t", workers=1)
    await pool.start()
    try:
        pid, value = await pool.run(where_and_square, 7)
        assert value == 49 and pid != os.getpid()
    finally:
        pool.close()


async def test_a_dead_worker_is_replaced_and_its_check_tried_again():
    pool = CpuPool("t", workers=1)
    await pool.start()
    try:
        first, _ = await pool.run(where_and_square, 2)
        os.kill(first, signal.SIGKILL)
        second, value = await pool.run(where_and_square, 3)
        assert value == 9 and second != first
    finally:
        pool.close()


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
