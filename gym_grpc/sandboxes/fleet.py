"""A server's sandboxes: how many start at once, how fast, how many live, and which are kept warm.

Sessions `acquire` a sandbox and `release` it when they end. The fleet

- hands out a warm sandbox when it has one (started ahead for the next
  session; `warm_pool` of them are kept while nobody waits);
- otherwise starts one, at most `max_starting` at once and `starts_per_second`
  on average (a token bucket: a burst of sessions is spread, not refused);
- never has more than `max_alive` sandboxes (starting, warm, in use or being
  destroyed) at once: a session beyond that waits for one to be released, as
  long as its caller's deadline allows (queueing, not failing);
- destroys a released sandbox in the background, so that the session's close
  does not wait for it.

A sandbox that fails to start fails the session that wanted it with
SANDBOX_START_FAILED (errors.SandboxStartFailed), counted in `start_failures`;
`states()` gives how many sandboxes are in each state for `status` and the
Prometheus endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque

from gym_grpc import errors

from .provider import Sandbox, SandboxError, SandboxProvider, SandboxSpec

log = logging.getLogger("gym_grpc.sandboxes")


class SandboxFleet:
    def __init__(
        self,
        provider: SandboxProvider,
        spec: SandboxSpec,
        *,
        warm_pool: int = 0,
        max_alive: int = 256,
        max_starting: int = 8,
        starts_per_second: float | None = None,
    ) -> None:
        if warm_pool > max_alive:
            raise errors.ConfigError(f"sandbox warm_pool ({warm_pool}) exceeds max_alive ({max_alive})")
        self.provider = provider
        self.spec = spec
        self.warm_pool = warm_pool
        self.max_alive = max_alive
        self.max_starting = max_starting
        self.starts_per_second = starts_per_second
        self.starting = 0
        self.in_use: set[Sandbox] = set()
        self.warm: deque[Sandbox] = deque()
        self.destroying = 0
        self.waiting = 0
        self.start_failures = 0
        self._changed = asyncio.Condition()
        self._next_start = 0.0  # the token bucket: when the next start may begin (time.monotonic())
        self._filler: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._closed = False

    def states(self) -> dict[str, int]:
        """How many sandboxes are in each state now, and how many sessions wait for one."""
        return {
            "starting": self.starting,
            "warm": len(self.warm),
            "in_use": len(self.in_use),
            "destroying": self.destroying,
            "waiting": self.waiting,
        }

    def alive(self) -> int:
        return self.starting + len(self.warm) + len(self.in_use) + self.destroying

    async def start(self) -> None:
        await self.provider.start()
        self._refill()

    async def acquire(self) -> Sandbox:
        """A sandbox for one session: a warm one, or one started now once the caps allow.
        Waits (cancel it to give up) while the fleet is full; SandboxStartFailed when its start fails."""
        async with self._changed:
            self.waiting += 1
            try:
                while True:
                    while self.warm:
                        sandbox = self.warm.popleft()
                        if sandbox.alive():
                            self.in_use.add(sandbox)
                            self._refill()
                            return sandbox
                        self._destroy(sandbox)  # died while warm
                    if self._closed:
                        raise errors.Unavailable("the sandbox fleet is shut down")
                    if self.alive() < self.max_alive and self.starting < self.max_starting:
                        break
                    await self._changed.wait()
            finally:
                self.waiting -= 1
            self.starting += 1
        try:
            sandbox = await self._start()
        except BaseException:
            await self._settle(started=None)
            raise
        await self._settle(started=sandbox, for_pool=False)
        return sandbox

    async def _start(self) -> Sandbox:
        """Start one sandbox, after the rate limit's turn; SandboxStartFailed with the runtime's reason."""
        if self.starts_per_second:
            now = time.monotonic()
            at = max(now, self._next_start)
            self._next_start = at + 1 / self.starts_per_second
            if at > now:
                await asyncio.sleep(at - now)  # the rate limit's turn, not a wait for something to happen
        try:
            return await self.provider.create(self.spec)
        except SandboxError as e:
            self.start_failures += 1
            log.warning("a sandbox failed to start: %s", e)
            raise errors.SandboxStartFailed(f"the session's sandbox failed to start: {e}") from None

    async def _settle(self, started: Sandbox | None, for_pool: bool = False) -> None:
        async with self._changed:
            self.starting -= 1
            if started is not None:
                if self._closed:
                    self._destroy(started)
                elif for_pool:
                    self.warm.append(started)
                else:
                    self.in_use.add(started)
            self._changed.notify_all()
        self._refill()

    def release(self, sandbox: Sandbox) -> None:
        """The session is done with it: destroy it (in the background)."""
        if sandbox in self.in_use:
            self.in_use.discard(sandbox)
            self._destroy(sandbox)

    def _destroy(self, sandbox: Sandbox) -> None:
        self.destroying += 1
        task = asyncio.ensure_future(self._destroyed(sandbox))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _destroyed(self, sandbox: Sandbox) -> None:
        try:
            await sandbox.destroy()
        except Exception:
            log.exception("destroying sandbox %s failed", sandbox.id)
        finally:
            self.destroying -= 1
            async with self._changed:
                self._changed.notify_all()
            self._refill()

    def _refill(self) -> None:
        """Keep `warm_pool` sandboxes ready while nobody waits and the caps allow."""
        if self.warm_pool and not self._closed and (self._filler is None or self._filler.done()):
            self._filler = asyncio.ensure_future(self._fill())

    async def _fill(self) -> None:
        while True:
            async with self._changed:
                if (
                    self._closed
                    or self.waiting
                    or len(self.warm) + self.starting >= self.warm_pool
                    or self.alive() >= self.max_alive
                    or self.starting >= self.max_starting
                ):
                    return
                self.starting += 1
            try:
                sandbox = await self._start()
            except errors.SandboxStartFailed:
                await self._settle(started=None)
                return  # the next session's own start says why; no retry loop here
            except BaseException:
                await self._settle(started=None)
                raise
            await self._settle(started=sandbox, for_pool=True)

    async def close(self) -> None:
        """Destroy every sandbox (warm and in use) and wait for them to be gone."""
        self._closed = True
        async with self._changed:
            self._changed.notify_all()  # the sessions still waiting give up
        if self._filler is not None:
            self._filler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._filler
        while self.warm:
            self._destroy(self.warm.popleft())
        for sandbox in list(self.in_use):
            self.release(sandbox)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        await self.provider.close()
