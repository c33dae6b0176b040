"""The event loop every gym-grpc process runs on: uvloop when it is installed, else asyncio's,
the garbage collector's settings for a long-running server, and a start that a signal stops.

uvloop (libuv) runs asyncio's callbacks, timers and sockets in C; grpc.aio
works on it, and so does aiohttp. A server process spends much of its CPU
in the event loop itself, so this is a cheap, broad saving. Set
GYM_GRPC_EVENT_LOOP=asyncio to use asyncio's own loop instead (to rule the
loop out when something misbehaves).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: The environment variable that picks the loop: "uvloop" (the default when installed) or "asyncio".
VARIABLE = "GYM_GRPC_EVENT_LOOP"


def name() -> str:
    """The loop `run` uses in this process."""
    if os.environ.get(VARIABLE, "uvloop") == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


#: Allocations between two young-generation collections (CPython's default is 700).
GC_YOUNG_THRESHOLD = 20_000


def _tune_gc() -> None:
    """Collect cycles less often. A server allocates and frees several objects per
    call (messages, futures, call objects), and CPython's default of a collection
    every 700 net allocations spent ~10% of a busy server's CPU walking them. The
    objects made at start-up (modules, configs) are frozen out of every collection."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the chosen loop."""
    _tune_gc()
    if name() == "uvloop":
        import uvloop

        return uvloop.run(coroutine)
    return asyncio.run(coroutine)


def stop_on_signals(stop: asyncio.Event) -> list[int]:
    """Have SIGTERM and SIGINT (Ctrl-C) set `stop`, on the running loop, from now on; the signals
    received, in order (a process that exits 128 + the signal reads the first)."""
    received: list[int] = []

    def on_signal(sig: int) -> None:
        received.append(sig)
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return received


async def stopped_first(work: Awaitable[object], stop: asyncio.Event) -> bool:
    """Await `work` unless `stop` is set first: then cancel it, wait for its own clean-up (an
    `except`/`finally` of its that stops what it started), and return True. For a process's start,
    which may take minutes or hang, so that Ctrl-C or SIGTERM stops it then too."""
    working = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({working, stopping}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this caller cancelled: the work with it
        working.cancel()
        raise
    finally:
        stopping.cancel()
    if working.done():
        working.result()  # its exception, if it failed
        return False
    working.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await working
    return True
