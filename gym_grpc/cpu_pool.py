"""Where an environment's CPU-heavy checks run: never on the event loop.

    class MathEnv(ResourcesServer):
        Config = MathConfig                    # extends CpuPoolConfig

        async def start(self) -> None:
            self.pool = CpuPool.from_config(self.name, self.config)
            await self.pool.start()

        async def verify(self, session, response):
            correct = await self.pool.run(check_answer, expected, final_text(response))

By default the checks run in `verify_workers` spawned processes (spawn, not
fork: forking a process that runs gRPC is unsafe), each with a pipe that the
event loop itself reads: a worker is sent the check it runs and the next one,
and the others wait here, in order. A worker that dies is replaced and its
check tried once more. No thread stands between the loop and the workers, as
two do in concurrent.futures' process pool (its manager thread and its queue's
feeder), which cost the server about three times the CPU per check
(bench/check_pool.py). With `ray_address` ("auto",
"ray://host:10001", or "local" to start Ray in this process) each check is a
Ray task instead; the function's module travels by value, so the cluster
needs the function's own imports but neither gym_grpc nor the environment.
A check whose caller gives up (a deadline, the verify time-out) is cancelled
on Ray; in a worker process it runs to its end, and one still waiting for a
worker is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import sys
import time
import traceback
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
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


def _serve(conn: Connection) -> None:
    """A worker process: run each call that comes through the pipe, send back its result or its error,
    until the pipe closes (the pool closed, or the server process is gone)."""
    conn.send(_READY)
    while True:
        try:
            fn, args, kwargs = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):  # Ctrl-C reaches the whole process group: the server stops us
            return
        try:
            reply: tuple[Any, ...] = (True, fn(*args, **kwargs))
        except BaseException as e:  # the caller gets it, as it would from a call in its own process
            reply = (False, e, traceback.format_exc())
        try:
            conn.send(reply)
        except Exception as e:  # the result (or the error) does not pickle
            conn.send((False, TypeError(f"{getattr(fn, '__name__', fn)!r}: cannot send its result back: {e}"), ""))


#: A worker's first message: it serves from now on (it was spawned, has imported what it needs and reads).
_READY = "ready"

#: Calls sent to a worker at once: the one it runs and the next, already in its pipe, so that it never
#: waits a round trip through the event loop between two checks when checks are waiting.
_DEPTH = 2

#: The largest call sent to a worker that is running one: it waits in the pipe's buffer (64 KiB on Linux)
#: until the running check ends, so it must fit there, or the event loop would block writing it. A
#: larger call waits for an idle worker, which reads it as it is written.
_QUEUED_BYTES = 32 * 1024


@dataclass(eq=False)
class _Call:
    message: bytes  # the pickled (fn, args, kwargs)
    future: asyncio.Future[Any]
    died: bool = False  # its worker died running it once


@dataclass(eq=False)
class _Worker:
    process: BaseProcess
    conn: Connection
    ready: bool = False
    calls: deque[_Call] = field(default_factory=deque)  # sent, in order: the first is the one it runs
    since: float = 0.0  # time.monotonic() when the check it runs began


@dataclass(eq=False)
class _Workers:
    """Worker processes, each with a pipe of its own read by the event loop, and the calls waiting."""

    name: str
    count: int
    loop: asyncio.AbstractEventLoop
    workers: list[_Worker] = field(default_factory=list)
    waiting: deque[_Call] = field(default_factory=deque)
    broken: RuntimeError | None = None  # set when workers die before they serve: starting more would loop
    ran: float = 0.0  # seconds the workers spent on the checks they answered

    def __post_init__(self) -> None:
        _LIVE.add(self)
        for _ in range(self.count):
            self._spawn()

    def busy_seconds(self, now: float) -> float:
        """Seconds the workers spent on checks so far, the checks they run now included."""
        return self.ran + sum(now - w.since for w in self.workers if w.calls)

    def _spawn(self) -> None:
        context = multiprocessing.get_context("spawn")
        ours, theirs = context.Pipe()
        process = context.Process(target=_serve, args=(theirs,), name=f"{self.name}-check", daemon=True)
        process.start()
        theirs.close()
        worker = _Worker(process, ours)
        self.loop.add_reader(ours.fileno(), self._answered, worker)
        self.workers.append(worker)

    def submit(self, call: _Call) -> None:
        if self.broken is not None:
            raise self.broken
        self.waiting.append(call)
        self._dispatch()

    def _dispatch(self) -> None:
        while self.waiting:
            call = self.waiting[0]
            if call.future.done():  # its caller gave up while it waited
                self.waiting.popleft()
                continue
            worker = self._worker_for(call)
            if worker is None:
                return
            self.waiting.popleft()
            try:
                worker.conn.send_bytes(call.message)
            except OSError:  # it died (a broken pipe): the call goes back first in line
                self.waiting.appendleft(call)
                self._died(worker)
                return
            if not worker.calls:
                worker.since = time.monotonic()
            worker.calls.append(call)

    def _worker_for(self, call: _Call) -> _Worker | None:
        """The worker to send `call` to now, or None: it waits in the pool.

        An idle worker, if one is. Otherwise the call would wait in a busy worker's pipe, behind a
        check that may run for long (a code_exec candidate, up to its time limit): that is done only
        when no worker is still starting (it will serve soon, and a call queued behind a slow check
        would miss it), for a call that fits the pipe, and behind the check that began last."""
        ready = [w for w in self.workers if w.ready]
        idle = next((w for w in ready if not w.calls), None)
        if idle is not None or len(ready) < len(self.workers) or len(call.message) > _QUEUED_BYTES:
            return idle
        room = [w for w in ready if len(w.calls) < _DEPTH]
        return max(room, key=lambda w: w.since, default=None)

    def _answered(self, worker: _Worker) -> None:
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            self._died(worker)
            return
        except Exception as e:  # a result (an exception of a class that needs arguments) that does not unpickle
            reply = (False, TypeError(f"{self.name}: cannot read a check's result: {e!r}"), "")
        if not worker.ready:
            worker.ready = reply == _READY
            self._dispatch()
            return
        call = worker.calls.popleft()
        now = time.monotonic()
        self.ran += now - worker.since
        worker.since = now  # the next call in its pipe, if any, begins now
        if not call.future.done():
            if reply[0]:
                call.future.set_result(reply[1])
            else:
                error = reply[1]
                if reply[2]:
                    error.add_note(f"in the check worker (pid {worker.process.pid}):\n{reply[2]}")
                call.future.set_exception(error)
        self._dispatch()

    def _died(self, worker: _Worker) -> None:
        """A worker is gone (the OOM killer, a stray signal): a new one takes its place; the call it ran
        is tried once more, first in line, and the one sent after it goes back in line unharmed."""
        self._drop(worker)
        self.workers.remove(worker)
        code = worker.process.exitcode
        if not worker.ready:  # it never served: a new one would die the same way (an import that fails)
            self.broken = RuntimeError(f"{self.name}: a check worker died as it started (exit code {code})")
            for call in self.waiting:
                if not call.future.done():
                    call.future.set_exception(self.broken)
            self.waiting.clear()
            return
        log.warning("%s: a check worker died (exit code %s); starting a new one", self.name, code)
        self._spawn()
        if worker.calls:
            running, *unstarted = worker.calls
            self.waiting.extendleft(reversed(unstarted))
            if not running.future.done():
                if running.died:
                    running.future.set_exception(RuntimeError(f"{self.name}: the check's worker died twice running it"))
                else:
                    running.died = True
                    self.waiting.appendleft(running)
        self._dispatch()

    def _drop(self, worker: _Worker) -> None:
        self.loop.remove_reader(worker.conn.fileno())
        worker.conn.close()
        worker.process.kill()  # a no-op when it is gone; a worker left hanging must not run on
        worker.process.join(timeout=5)

    def close(self) -> None:
        """Stop every worker now: a check still running is abandoned (its caller is gone), and the
        calls still waiting fail."""
        _LIVE.discard(self)
        for worker in self.workers:
            self._drop(worker)
        for call in [*(c for w in self.workers for c in w.calls), *self.waiting]:
            if not call.future.done():
                call.future.set_exception(RuntimeError(f"{self.name}: the pool closed"))
        self.workers.clear()
        self.waiting.clear()


#: The pools of worker processes of this process that are not closed (checks_busy).
_LIVE: weakref.WeakSet[_Workers] = weakref.WeakSet()


def checks_busy(now: float) -> tuple[float, int]:
    """Seconds this process's pool workers spent on checks so far (those running now included), and how
    many workers the pools have: what an agent reports of its checks (RunManyResponse.load). Checks on
    Ray are not counted: Ray places them."""
    pools = list(_LIVE)
    return sum(pool.busy_seconds(now) for pool in pools), sum(pool.count for pool in pools)


class CpuPool:
    """A process pool, or Ray, behind one `await pool.run(fn, *args)`."""

    def __init__(self, name: str, workers: int = 1, ray_address: str | None = None) -> None:
        self.name = name
        self.workers = workers
        self.ray_address = ray_address
        self._processes: _Workers | None = None
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
        elif self._processes is None:
            self._processes = _Workers(self.name, self.workers, asyncio.get_running_loop())

    def close(self) -> None:
        if self._processes is not None:
            self._processes.close()
            self._processes = None
        if self._owns_ray:
            import ray

            ray.shutdown()

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in a worker; fn must be a module-level function (it is pickled)."""
        if self.on_ray:
            return await self._run_on_ray(fn, *args, **kwargs)
        processes = self._processes
        if processes is None:
            raise RuntimeError(f"{self.name}: CpuPool.run before start (or after close)")
        try:
            message = ForkingPickler.dumps((fn, args, kwargs))
        except Exception as e:
            raise TypeError(f"{self.name}: cannot send {fn!r} and its arguments to a worker: {e}") from e
        call = _Call(bytes(message), asyncio.get_running_loop().create_future())
        processes.submit(call)
        return await call.future

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
