"""Where an environment's CPU-heavy checks run: never on the event loop.

    class MathEnv(ResourcesServer):
        Config = MathConfig                    # extends CpuPoolConfig

        async def start(self) -> None:
            self.pool = CpuPool.from_config(self.name, self.config)
            await self.pool.start()

        async def verify(self, session, response):
            correct = await self.pool.run(check_answer, expected, final_text(response))

By default the checks run in a pool of `verify_workers` spawned processes
(spawn, not fork: forking a process that runs gRPC is unsafe); a worker that
dies is replaced and its check tried once more. With `ray_address` ("auto",
"ray://host:10001", or "local" to start Ray in this process) each check is a
Ray task instead; the function's module travels by value, so the cluster
needs the function's own imports but neither gym_grpc nor the environment.
A check whose caller gives up (a deadline, the verify time-out) is cancelled
on Ray; in the process pool it runs to its end.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from functools import partial
from typing import Any, TypeVar

from pydantic import Field

from gym_grpc.errors import ConfigError
from gym_grpc.resources import ResourcesConfig

log = logging.getLogger("gym_grpc.cpu_pool")

T = TypeVar("T")


class CpuPoolConfig(ResourcesConfig):
    """Settings of an environment that checks in a CpuPool."""

    verify_workers: int = Field(1, ge=1, description="checks that run at once: pool processes, or CPUs of local Ray")
    ray_address: str | None = Field(
        None, description='run checks as Ray tasks: "auto", "ray://host:10001", or "local" to start Ray here'
    )


def _end(pool: ProcessPoolExecutor) -> None:
    """Stop a pool now: cancel what waits, stop its workers (a check still running is
    abandoned: its caller is gone or its worker died) and wait for its manager thread.

    A pool left to wind down on its own (shutdown without waiting) races CPython
    3.11's exit hook when the process exits soon after: "OSError: [Errno 9] Bad
    file descriptor" in concurrent.futures' _python_exit, seen at a server's stop."""
    workers = list(
        (getattr(pool, "_processes", None) or {}).values()
    )  # CPython's own, read before shutdown clears them
    manager = getattr(pool, "_executor_manager_thread", None)
    pool.shutdown(wait=False, cancel_futures=True)
    for worker in workers:
        worker.kill()
    if manager is not None:
        manager.join(timeout=30)


class CpuPool:
    """A process pool, or Ray, behind one `await pool.run(fn, *args)`."""

    def __init__(self, name: str, workers: int = 1, ray_address: str | None = None) -> None:
        self.name = name
        self.workers = workers
        self.ray_address = ray_address
        self._processes: ProcessPoolExecutor | None = None
        self._remote: dict[Callable, Any] = {}
        self._owns_ray = False

    @classmethod
    def from_config(cls, name: str, config: CpuPoolConfig) -> CpuPool:
        return cls(name, config.verify_workers, config.ray_address)

    @property
    def on_ray(self) -> bool:
        return self.ray_address is not None

    async def start(self) -> None:
        """Start the workers (or join Ray) before the first check needs them; blocks a few seconds for Ray."""
        if self.on_ray:
            self._join_ray()
        else:
            self._processes = self._new_processes()

    def close(self) -> None:
        if self._processes is not None:
            _end(self._processes)
        if self._owns_ray:
            import ray

            ray.shutdown()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in a worker; fn must be a module-level function (it is pickled)."""
        if self.on_ray:
            return await self._run_on_ray(fn, *args, **kwargs)
        processes = self._processes
        if processes is None:
            raise RuntimeError(f"{self.name}: CpuPool.run before start")
        call = partial(fn, *args, **kwargs)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(processes, call)
        except BrokenProcessPool:
            # A worker died (the OOM killer, a stray signal): replace the pool once and retry.
            if self._processes is processes:
                log.warning("%s: a check worker died; starting a new pool", self.name)
                self._processes = self._new_processes()
                _end(processes)
            return await loop.run_in_executor(self._processes, call)

    def _new_processes(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"))

    def _join_ray(self) -> None:
        try:
            import ray
        except ImportError:
            raise ConfigError(
                f"server {self.name!r}: config.ray_address is {self.ray_address!r} but Ray is not installed; "
                "pip install 'gym-grpc[ray]', or remove ray_address to check in a local process pool"
            ) from None
        self._owns_ray = not ray.is_initialized()
        if self.ray_address == "local":
            # address="local": a Ray of our own, even when another runs on this machine
            # (a bare ray.init() would join that one, and refuse num_cpus).
            ray.init(address="local", num_cpus=self.workers, include_dashboard=False, ignore_reinit_error=True)
        else:
            try:
                ray.init(address=self.ray_address, ignore_reinit_error=True)
            except ConnectionError as e:
                raise ConfigError(f"server {self.name!r}: cannot reach Ray at {self.ray_address!r}: {e}") from None

    async def _run_on_ray(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        import ray

        remote = self._remote.get(fn)
        if remote is None:
            ray.cloudpickle.register_pickle_by_value(sys.modules[fn.__module__])
            remote = self._remote[fn] = ray.remote(num_cpus=1, max_retries=1)(fn)
        ref = remote.remote(*args, **kwargs)
        try:
            return await asyncio.wrap_future(ref.future())
        except asyncio.CancelledError:
            ray.cancel(ref)  # interrupts the task (KeyboardInterrupt in it), so it can clean up
            raise
