"""What every link to one engine has, whatever it speaks (HTTP/JSON: http.py; vLLM's gRPC: vllm_grpc.py).

Its address, settings and counters, and the loop that runs a request to it:
bounded retries per failure class (`gym_grpc.engines.retries`), each retry logged
with its cause and counted, inside the deadline of the call that made it; and,
while the engine never answered (vLLM loading its model), a wait of up to
`startup_wait_seconds` instead of counting connection failures, so a collect
started early loses no rollouts. A transport says which of its errors are which
failure (`_failure`), and that the engine answered (`_heard_from`); an answer
not worth retrying is an EngineError.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from gym_grpc import errors
from gym_grpc.engines.retries import Failure, Retries
from gym_grpc.engines.settings import EngineSettings
from gym_grpc.server.counters import Counters

log = logging.getLogger("gym_grpc.engines")

T = TypeVar("T")


class EngineError(errors.GymError):
    """An engine answered with an error that is not worth retrying (an HTTP status, or a gRPC one
    as the HTTP status it stands for). Its status code follows the HTTP status: 401/403
    FAILED_PRECONDITION (ENGINE_AUTH_FAILED), other 4xx INVALID_ARGUMENT (ENGINE_REJECTED_REQUEST),
    else INTERNAL (ENGINE_FAILED: a 5xx that is not retried, such as 501, or an answer that is not
    JSON)."""

    def __init__(self, status: int, detail: str, url: str, *, answered: str | None = None) -> None:
        # `answered`: what the engine's own protocol said, when it is not HTTP (a gRPC status, whose
        # HTTP counterpart is `status`).
        text = f"engine {url} answered {answered or f'HTTP {status}'}: {detail}"
        code, reason = grpc.StatusCode.INTERNAL, errors.Reason.ENGINE_FAILED
        if status in (401, 403):
            text, code = f"{text} (check the API key)", grpc.StatusCode.FAILED_PRECONDITION
            reason = errors.Reason.ENGINE_AUTH_FAILED
        elif 400 <= status < 500:
            code, reason = grpc.StatusCode.INVALID_ARGUMENT, errors.Reason.ENGINE_REJECTED_REQUEST
        super().__init__(text, code=code, reason=reason, metadata={"engine": url, "http_status": str(status)})
        self.status = status
        self.detail = detail
        self.url = url


class EngineLink:
    """One engine behind one address, and how requests to it are retried."""

    def __init__(self, base_url: str, settings: EngineSettings, counters: Counters | None = None) -> None:
        self.base_url = base_url
        self.settings = settings
        self.counters = counters or Counters()
        #: Set once the engine answered anything (even an error): it is up.
        self._answered = asyncio.Event()
        self._first_request: float | None = None
        self._waiting_since: float | None = None

    def _failure(self, error: Exception) -> Failure | None:
        """The failure class of an error worth retrying; None for one that is the engine's answer."""
        raise NotImplementedError

    def _heard_from(self) -> None:
        """The engine answered (anything): it is up, and requests waiting for it to start go on."""
        if not self._answered.is_set():
            self._answered.set()
            if self._waiting_since is not None:
                log.warning("engine %s answered after %.1f s", self.base_url, time.monotonic() - self._waiting_since)

    async def _retried(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """`attempt()` until it returns, retrying what `_failure` classes; `what` names the request in logs.

        Raises what `_failure` does not class, and a GymError (UNAVAILABLE, DEADLINE_EXCEEDED)
        when retries, budget or deadline run out."""
        retries = Retries(self.settings, what)
        if self._first_request is None:
            self._first_request = time.monotonic()
        startup_waits = 0
        while True:
            try:
                async with asyncio.timeout(retries.time_left()):  # no task per request, as wait_for makes
                    return await attempt()
            except Exception as e:
                failure = self._failure(e)
                if failure is None:
                    if isinstance(e, TimeoutError):  # the deadline or the retry budget
                        raise retries.out_of_time() from None
                    raise
            if failure.kind == "connect" and not self._answered.is_set():
                if await self._wait_for_start(failure, retries, startup_waits + 1):
                    startup_waits += 1
                    continue
                failure = dataclasses.replace(failure, cause=f"{failure.cause} (the engine never answered)")
            delay = retries.wait_before_retry(failure)
            self.counters.retried(failure.kind)
            log.warning(
                "%s: %s (%s retry %d of %d); retrying in %.2f s",
                what,
                failure.cause,
                failure.kind,
                retries.counts[failure.kind],
                self.settings.retry_limit(failure.kind),
                delay,
            )
            await asyncio.sleep(delay)

    async def _wait_for_start(self, failure: Failure, retries: Retries, wait: int) -> bool:
        """While the engine has never answered (still loading), wait for it instead of
        counting a connection failure, up to startup_wait_seconds from the first
        request; False once that is over. The `wait`-th wait of a request backs off
        like a retry, and wakes as soon as any request gets through."""
        assert self._first_request is not None
        left = self.settings.startup_wait_seconds - (time.monotonic() - self._first_request)
        if left <= 0:
            return False
        if self._waiting_since is None:
            self._waiting_since = time.monotonic()
            log.warning(
                "engine %s does not answer yet (%s); waiting up to %.0f s for it to start (startup_wait_seconds)",
                self.base_url,
                failure.cause,
                left,
            )
        delay = min(self.settings.backoff(wait), left)
        retries.check_wait(delay, failure.cause)
        self.counters.retried("connect")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._answered.wait(), delay)
        return True

    async def close(self) -> None:
        """Close the connections to the engine."""
