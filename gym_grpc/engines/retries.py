"""How a request to an engine is retried: bounded per failure class, with jittered
exponential backoff, inside a total budget that never outlives the caller's deadline.

A failed attempt falls in one of four classes, each with its own number of retries:

* ``connect``: no connection (refused, reset, connect time-out), or it dropped
  before the whole answer arrived;
* ``server_error``: HTTP 500, 502, 503 or 504;
* ``rate_limited``: HTTP 429;
* ``timeout``: no answer within the read time-out.

The n-th retry of a class waits ``backoff_seconds * 2**(n-1)`` (at most
``max_backoff_seconds``) times a random factor in [0.5, 1), so that thousands of
requests that failed together do not come back together. A 429 or 503 with
Retry-After waits at least what the engine asked. From its first failure a
request retries for at most ``retry_budget_seconds``, and never past the
deadline of the call that made it: a retry that could not start in time is
given up at once, with the cause.
"""

from __future__ import annotations

import random
import time
import typing
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from typing import Annotated, Literal

from pydantic import BaseModel, Field

from gym_grpc import errors
from gym_grpc.rpc import transport

FailureClass = Literal["connect", "server_error", "rate_limited", "timeout"]
FAILURE_CLASSES: tuple[FailureClass, ...] = typing.get_args(FailureClass)


class RetrySettings(BaseModel):
    """The retry keys of an engine's config."""

    max_retries: int = Field(5, ge=0, description="retries of each failure class that `retries` does not list")
    retries: dict[FailureClass, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        description="retries per failure class: connect, server_error (HTTP 500/502/503/504), "
        "rate_limited (HTTP 429), timeout (no answer within read_timeout)",
    )
    backoff_seconds: float = Field(0.5, ge=0, description="first retry delay of a class; doubles each time, jittered")
    max_backoff_seconds: float = Field(10.0, ge=0, description="longest retry delay (Retry-After may ask for more)")
    retry_budget_seconds: float | None = Field(
        300.0, gt=0, description="most seconds a request spends retrying, from its first failure; null: no limit"
    )
    startup_wait_seconds: float = Field(
        300.0,
        ge=0,
        description="how long requests wait for an engine that never answered yet (still loading) "
        "before connection errors count as failures",
    )

    def retry_limit(self, kind: FailureClass) -> int:
        return self.retries.get(kind, self.max_retries)

    def backoff(self, retry: int) -> float:
        """The jittered wait before the `retry`-th retry (from 1)."""
        delay = min(self.backoff_seconds * 2 ** (retry - 1), self.max_backoff_seconds)
        return delay * (0.5 + random.random() / 2)


@dataclass(frozen=True)
class Failure:
    """One failed attempt: its class, what happened, and the wait the engine asked for (Retry-After)."""

    kind: FailureClass
    cause: str
    retry_after: float | None = None


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header as seconds from now: delay-seconds or an HTTP date; None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max((when - datetime.now(UTC)).total_seconds(), 0.0)


class Retries:
    """The retries of one request: counts per class, and the end of its budget."""

    def __init__(self, settings: RetrySettings, what: str) -> None:
        self.settings = settings
        self.what = what
        self.counts: dict[FailureClass, int] = {}  # a dict: one per request, where a Counter costs 1-2 µs
        self._budget_ends: float | None = None

    def _limits(self) -> tuple[float | None, float | None]:
        """Seconds left until the caller's deadline and until the end of the budget (None: no limit)."""
        budget = None if self._budget_ends is None else max(self._budget_ends - time.monotonic(), 0.0)
        return transport.timeout_for(None), budget

    def time_left(self) -> float | None:
        """Seconds the next attempt may take."""
        deadline, budget = self._limits()
        if budget is None or deadline is None:
            return deadline if budget is None else budget
        return min(deadline, budget)

    def _budget_binds(self) -> bool:
        """Whether the budget ends before the caller's deadline."""
        deadline, budget = self._limits()
        return budget is not None and (deadline is None or budget < deadline)

    def _limit(self) -> str:
        if self._budget_binds():
            return f"the retry budget (retry_budget_seconds: {self.settings.retry_budget_seconds:g})"
        return "the caller's deadline"

    def out_of_time(self) -> errors.GymError:
        """The error of a request whose time ran out during an attempt."""
        if self._budget_binds():
            return errors.Unavailable(
                f"{self.what}: {self._limit()} ran out during a request", reason=errors.Reason.ENGINE_UNAVAILABLE
            )
        return errors.DeadlineExceeded(f"{self.what}: the caller's deadline ran out during a request")

    def check_wait(self, delay: float, cause: str) -> None:
        """Raise UNAVAILABLE, naming `cause`, when a wait of `delay` s would end past the budget or the deadline."""
        left = self.time_left()
        if left is not None and delay >= left:
            raise errors.Unavailable(
                f"{self.what}: {cause}; the next try (in {delay:.1f} s) would start after {self._limit()}",
                reason=errors.Reason.ENGINE_UNAVAILABLE,
            )

    def wait_before_retry(self, failure: Failure) -> float:
        """Count a retry of `failure`'s class and return the seconds to wait before it;
        raise UNAVAILABLE when the class has no retries left or the wait would not end in time."""
        retry = self.counts[failure.kind] = self.counts.get(failure.kind, 0) + 1
        limit = self.settings.retry_limit(failure.kind)
        if retry > limit:
            raise errors.Unavailable(
                f"{self.what}: {failure.cause}; gave up after {limit} {failure.kind} retries",
                reason=errors.Reason.ENGINE_UNAVAILABLE,
            )
        if self._budget_ends is None and self.settings.retry_budget_seconds is not None:
            self._budget_ends = time.monotonic() + self.settings.retry_budget_seconds
        delay = self.settings.backoff(retry)
        if failure.retry_after is not None:
            delay = max(delay, failure.retry_after)
        self.check_wait(delay, failure.cause)
        return delay
