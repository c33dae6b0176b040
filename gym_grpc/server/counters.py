"""Live counters of a server: calls by method and status, in flight, latency
percentiles over recent calls, the time agents' rollouts spend per stage, and
the retries of requests to engines by failure class, histories that did
not extend their token ids, by cause, and the sessions open (an environment's)
or not closed (an agent's).

Recording a call costs two clock reads and a few dict and array updates;
percentiles are computed only when someone asks (AdminService.GetCounters).
The same counts are what a server's Prometheus endpoint shows (see
metrics.py): it reads them when scraped, so the calls are counted once.
"""

from __future__ import annotations

import statistics
import time
from array import array
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from gym_grpc.data.rollout_stats import STAGES
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import task_pb2

#: Recent values kept per method (and per stage) for percentiles.
RECENT = 4096

#: Upper bounds (seconds, inclusive) of the latency histogram of each method, for
#: Prometheus: from a sub-millisecond admin call to a rollout of minutes.
LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip


class _Recent:
    """The last RECENT values, in a ring."""

    def __init__(self) -> None:
        self.values = array("d", bytes(8 * RECENT))
        self.count = 0

    def add(self, value: float) -> None:
        self.values[self.count % RECENT] = value
        self.count += 1

    def sorted(self) -> list[float]:
        return sorted(self.values[: min(self.count, RECENT)])


def _percentile(ordered: list[float], fraction: float) -> float:
    if not ordered:
        return 0.0
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


class _Method:
    def __init__(self) -> None:
        self.by_status: Counter[str] = Counter()
        self.in_flight = 0
        self.latency = _Recent()
        #: Calls since start by latency bucket (not cumulative; the last is past every bound).
        self.buckets = array("Q", bytes(8 * (len(LATENCY_BUCKETS) + 1)))
        #: Their total duration in seconds.
        self.seconds = 0.0


class Counters:
    """The counters of one server process."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.methods: dict[str, _Method] = {}
        self.stages = {stage: _Recent() for stage in STAGES}
        self.retries: Counter[str] = Counter()
        self.histories: Counter[str] = Counter()
        #: Turns a weight update caught, by what became of them ("regenerated", "spanning").
        self.caught_by_update: Counter[str] = Counter()
        #: How many sessions are open now (a resources server sets it to read its own).
        self.sessions_open: Callable[[], int] = lambda: 0
        #: Sessions of this agent's rollouts whose CloseSession failed.
        self.sessions_not_closed = 0
        #: An environment with sandboxes: how many are in each state now, and how many failed to start.
        self.sandboxes: Callable[[], dict[str, int]] = dict
        self.sandbox_start_failures: Callable[[], int] = lambda: 0
        #: A model server in front of engines: reads each engine's load now (gym_grpc.engines.load),
        #: when GetCounters is answered or its metrics scraped; None elsewhere.
        self.engine_loads: Callable[[float | None], Coroutine[Any, Any, list[admin_pb.EngineLoad]]] | None = None

    def begin(self, method: str) -> float:
        """A call started; returns the time to pass to end()."""
        counters = self.methods.get(method)
        if counters is None:
            counters = self.methods[method] = _Method()
        counters.in_flight += 1
        return time.monotonic()

    def end(self, method: str, began: float, status: str) -> float:
        """A call finished with `status`; returns its duration in seconds."""
        seconds = time.monotonic() - began
        counters = self.methods[method]
        counters.in_flight -= 1
        counters.by_status[status] += 1
        counters.latency.add(seconds)
        counters.buckets[bisect_left(LATENCY_BUCKETS, seconds)] += 1
        counters.seconds += seconds
        return seconds

    def rollout(self, timings: task_pb2.RolloutTimings) -> None:
        """An agent finished a rollout that spent `timings`."""
        self.stages["model"].add(timings.model_seconds)
        self.stages["tools"].add(timings.tools_seconds)
        self.stages["verify"].add(timings.verify_seconds)

    def retried(self, kind: str) -> None:
        """A request to an engine is retried after a failure of class `kind` (see gym_grpc.engines.retries)."""
        self.retries[kind] += 1

    def history(self, cause: str) -> None:
        """A conversation did not extend the token ids of its earlier turns, for `cause`
        (see servers/models/vllm_model/token_prompts.py)."""
        self.histories[cause] += 1

    def uptime(self) -> float:
        return time.monotonic() - self.started

    def to_proto(self) -> admin_pb.GetCountersResponse:
        reply = admin_pb.GetCountersResponse(
            uptime_seconds=self.uptime(),
            retries=dict(self.retries),
            non_monotonic_histories=dict(self.histories),
            turns_caught_by_update=dict(self.caught_by_update),
            sessions_open=self.sessions_open(),
            sessions_not_closed=self.sessions_not_closed,
            sandboxes=self.sandboxes(),
            sandbox_start_failures=self.sandbox_start_failures(),
        )
        for name, counters in sorted(self.methods.items()):
            ordered = counters.latency.sorted()
            reply.methods.add(
                method=name,
                calls_by_status=dict(counters.by_status),
                in_flight=counters.in_flight,
                p50_ms=1000 * _percentile(ordered, 0.50),
                p95_ms=1000 * _percentile(ordered, 0.95),
                p99_ms=1000 * _percentile(ordered, 0.99),
            )
            reply.in_flight += counters.in_flight
            reply.calls_total += sum(counters.by_status.values())
        for stage, recent in self.stages.items():
            ordered = recent.sorted()
            if ordered:
                reply.stages.add(
                    stage=stage,
                    rollouts=recent.count,
                    mean_seconds=statistics.fmean(ordered),
                    p50_seconds=_percentile(ordered, 0.50),
                    p95_seconds=_percentile(ordered, 0.95),
                )
        return reply
