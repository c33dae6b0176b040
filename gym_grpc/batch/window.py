"""How many rollouts a batch runs at once: `--max-in-flight` when it is given, else no more than
end in time, up to `MOST`.

A rollout's deadline (`--timeout`) counts from the moment it starts. When the engine behind the
agents serves fewer than are started (a real engine on a CPU makes 10-20 tokens a second), the
rest wait in its queue, on their deadlines: with a window of 4,096 against such an engine every
rollout failed. So unless `--max-in-flight` says how many (then exactly that many run at once),
the window starts small and widens as rollouts end well within their deadline, and narrows when
they do not:

* it starts at `START`;
* a rollout that ends within a quarter of its deadline widens it by one, up to `MOST` (against a
  fast engine it doubles each time the rollouts in flight end: a few seconds to 4,096);
* one that takes more than half its deadline, or fails past it, halves it (down to 1), at most once
  per window's worth of rollouts ended, as TCP's congestion window does once per round trip.

This is a guard that keeps the default from failing, not a controller that reads the engine's
load; what it does is reported once (`note`), for the summary to tell. The controller that does
read the engines' load (`collect --admission engine`, client/admission.py) sets the size through
`resize` instead.
"""

from __future__ import annotations

import asyncio

#: The window's first size, when it adapts.
START = 16

#: The most it widens to.
MOST = 4096


class Window:
    """The rollouts running now and how many may: `acquire` before one starts, `release` when it ends."""

    def __init__(self, most: int, deadline: float | None, *, adapts: bool = True) -> None:
        if most < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.most = most
        self.deadline = deadline if adapts else None  # without a deadline to keep to, it stays as it is
        self.size = min(most, START) if adapts else most
        self.running = 0
        #: Rollouts ended so far (an admission controller paces its growth by them).
        self.ended = 0
        #: The smallest size it narrowed to, when it did (for the summary to say).
        self.narrowest: int | None = None
        self._room = asyncio.Event()
        self._ended_since_narrowing = most  # narrowing is allowed at once

    @classmethod
    def sized(cls, max_in_flight: int | None, deadline: float | None) -> Window:
        """Exactly `max_in_flight` at once when it is given; else one that adapts, up to MOST."""
        return cls(MOST, deadline) if max_in_flight is None else cls(max_in_flight, deadline, adapts=False)

    def resize(self, size: int) -> None:
        """Let `size` run at once from now (an admission controller's window, client/admission.py);
        past a smaller size, the rollouts running end as they would and no new one starts."""
        self.size = size
        if self.running < self.size:
            self._room.set()

    async def acquire(self) -> None:
        while self.running >= self.size:
            self._room.clear()
            await self._room.wait()
        self.running += 1

    def release(self, seconds: float, past_deadline: bool = False) -> None:
        """A rollout ended after `seconds` (`past_deadline`: it failed with DEADLINE_EXCEEDED)."""
        self.running -= 1
        self.ended += 1
        self._ended_since_narrowing += 1
        if self.deadline is not None:
            if past_deadline or seconds > self.deadline / 2:
                if self._ended_since_narrowing >= self.size and self.size > 1:
                    self.size //= 2
                    self._ended_since_narrowing = 0
                    self.narrowest = self.size if self.narrowest is None else min(self.narrowest, self.size)
            elif seconds < self.deadline / 4 and self.size < self.most:
                self.size += 1
        if self.running < self.size:
            self._room.set()

    def note(self) -> str | None:
        """What to tell when the window narrowed: the rollouts were slow for their deadline."""
        if self.narrowest is None:
            return None
        return (
            f"rollouts took more than half of their --timeout ({self.deadline:g} s), so at most "
            f"{self.narrowest:,} ran at once at times: what they call (an engine, most likely) serves "
            "fewer at once than were started; --max-in-flight N runs exactly N at once"
        )
