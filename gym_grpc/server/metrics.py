"""A server's live metrics for Prometheus, on an HTTP port of its own (off by default).

The counting is the server's `Counters` (counters.py), which AdminService.GetCounters
reads too: the endpoint renders those counts when it is scraped and adds nothing to
a call's path. Each worker process of a server serves its own endpoint (the kernel
hands a worker its own connections, so no worker sees another's calls); the
registry lists every worker's address (Replica.workers) and `gym-grpc status`
shows them. Sum over the workers in the query, e.g.
`sum by (server, method, code) (rate(gym_server_calls_total[1m]))`.

The endpoint is prometheus_client's own HTTP server, in a thread of its own. A
scrape copies each count without a lock (each copy is atomic under the GIL), so
two families may be a call apart while calls run; a histogram's count is the sum
of its buckets, always.

    gym_server_info{server, role, worker, version}             1
    gym_server_calls_total{server, method, code}               finished calls, by gRPC status code name
    gym_server_call_duration_seconds{server, method}           histogram of their durations
    gym_server_calls_in_flight{server, method}                 calls running now
    gym_server_engine_retries_total{server, kind}              model servers: retried engine requests
    gym_server_non_monotonic_histories_total{server, cause}    model servers: histories that broke token ids
    gym_server_turns_caught_by_update_total{server, outcome}   model servers: turns a weight update caught
    gym_engine_kv_cache_usage{server, engine}                  model servers: each engine's KV cache in use, 0-1
    gym_engine_requests_running{server, engine}                model servers: requests each engine generates for
    gym_engine_requests_waiting{server, engine}                model servers: requests queued in each engine
    gym_engine_preemptions_total{server, engine}               model servers: requests each engine evicted
    gym_engine_load_up{server, engine}                         model servers: 1 when the engine's load was read
    process_*                                                  CPU, memory, open files of the process
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from gym_grpc.server.counters import LATENCY_BUCKETS, Counters

#: The path a scraper asks for (prometheus_client answers any path but /favicon.ico).
PATH = "/metrics"

#: Seconds a scrape waits for a model server's engines' load (each read is bounded below this).
ENGINE_READ_SECONDS = 3.0

_BOUNDS = [f"{bound:g}" for bound in LATENCY_BUCKETS] + ["+Inf"]


class Measured(Protocol):
    """What the endpoint reads from the server it reports on (a `GymServer`)."""

    @property
    def name(self) -> str: ...
    @property
    def counters(self) -> Counters: ...


class CountersCollector(Collector):
    """The metric families of one server, read from its counters at each scrape."""

    def __init__(self, app: Measured, labels: dict[str, str], loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.app = app
        self.labels = labels
        #: The server's event loop, where an engine's load is read (a scrape runs in a thread of its own).
        self.loop = loop

    def collect(self) -> Iterator[Metric]:
        server = self.app.name
        counters = self.app.counters
        info = InfoMetricFamily("gym_server", "What this process serves.")
        info.add_metric([], {"server": server, **self.labels})
        yield info
        calls = CounterMetricFamily(
            "gym_server_calls",
            "Finished calls, by method and gRPC status code name.",
            labels=["server", "method", "code"],
        )
        durations = HistogramMetricFamily(
            "gym_server_call_duration_seconds",
            "Durations of the finished calls, by method, in seconds.",
            labels=["server", "method"],
        )
        in_flight = GaugeMetricFamily(
            "gym_server_calls_in_flight", "Calls running now, by method.", labels=["server", "method"]
        )
        for method, state in list(counters.methods.items()):
            for code, count in sorted(dict(state.by_status).items()):
                calls.add_metric([server, method, code], count)
            buckets = list(itertools.accumulate(state.buckets.tolist()))
            durations.add_metric([server, method], list(zip(_BOUNDS, buckets, strict=True)), state.seconds)
            in_flight.add_metric([server, method], state.in_flight)
        yield from (calls, durations, in_flight)
        yield _by_label(
            "gym_server_engine_retries",
            "Model servers: requests to engines retried, by failure class.",
            server,
            "kind",
            dict(counters.retries),
        )
        yield _by_label(
            "gym_server_non_monotonic_histories",
            "Model servers: conversations whose history did not extend their token ids, by cause.",
            server,
            "cause",
            dict(counters.histories),
        )
        yield _by_label(
            "gym_server_turns_caught_by_update",
            "Model servers: turns a weight update caught, by what became of them.",
            server,
            "outcome",
            dict(counters.caught_by_update),
        )
        yield from self._engines(server, counters)
        sessions = GaugeMetricFamily(
            "gym_server_sessions_open", "Resources servers: sessions open now.", labels=["server"]
        )
        sessions.add_metric([server], counters.sessions_open())
        not_closed = CounterMetricFamily(
            "gym_server_sessions_not_closed",
            "Agents: sessions of their rollouts whose CloseSession failed.",
            labels=["server"],
        )
        not_closed.add_metric([server], counters.sessions_not_closed)
        yield from (sessions, not_closed)
        sandboxes = counters.sandboxes()
        if sandboxes:
            by_state = GaugeMetricFamily(
                "gym_server_sandboxes",
                "Environments with sandboxes: sandboxes by state now (waiting: sessions queued for one).",
                labels=["server", "state"],
            )
            for name, count in sandboxes.items():
                by_state.add_metric([server, name], count)
            failed = CounterMetricFamily(
                "gym_server_sandbox_start_failures",
                "Environments with sandboxes: sandboxes that failed to start.",
                labels=["server"],
            )
            failed.add_metric([server], counters.sandbox_start_failures())
            yield from (by_state, failed)

    def _engines(self, server: str, counters: Counters) -> Iterator[Metric]:
        """A model server's engines' load, read now on the server's loop (gym_grpc.engines.load)."""
        if counters.engine_loads is None or self.loop is None:
            return
        try:
            loads = asyncio.run_coroutine_threadsafe(counters.engine_loads(None), self.loop).result(ENGINE_READ_SECONDS)
        except (TimeoutError, RuntimeError):  # a loop that is busy or closing: no engine figures this scrape
            return
        labels = ["server", "engine"]
        up = GaugeMetricFamily("gym_engine_load_up", "Model servers: 1 when the engine's load was read.", labels=labels)
        kv = GaugeMetricFamily(
            "gym_engine_kv_cache_usage", "Model servers: fraction of each engine's KV cache in use.", labels=labels
        )
        running = GaugeMetricFamily(
            "gym_engine_requests_running", "Model servers: requests each engine is generating for.", labels=labels
        )
        waiting = GaugeMetricFamily(
            "gym_engine_requests_waiting", "Model servers: requests queued in each engine.", labels=labels
        )
        preemptions = CounterMetricFamily(
            "gym_engine_preemptions",
            "Model servers: requests each engine evicted from its KV cache, since the engine started.",
            labels=labels,
        )
        for load in loads:
            key = [server, load.url]
            up.add_metric(key, 0 if load.error else 1)
            if not load.error:
                kv.add_metric(key, load.kv_cache_usage)
                running.add_metric(key, load.requests_running)
                waiting.add_metric(key, load.requests_waiting)
                preemptions.add_metric(key, load.preemptions_total)
        yield from (up, kv, running, waiting, preemptions)


def _by_label(name: str, documentation: str, server: str, label: str, counts: dict[str, int]) -> Metric:
    family = CounterMetricFamily(name, documentation, labels=["server", label])
    for value, count in sorted(counts.items()):
        family.add_metric([server, value], count)
    return family


class Endpoint:
    """A running metrics endpoint: its address, and how to stop it."""

    def __init__(self, httpd: WSGIServer, host: str) -> None:
        self._httpd = httpd
        self.host = host
        self.port: int = httpd.server_port

    @property
    def address(self) -> str:
        """ "host:port", as GetServerInfoResponse.metrics_address says it."""
        return f"{self.host}:{self.port}"

    async def stop(self) -> None:
        # shutdown() waits for the serving thread's next poll (up to 0.5 s): not on the event loop.
        await asyncio.to_thread(self._httpd.shutdown)
        self._httpd.server_close()


def serve(app: Measured, host: str, port: int, labels: dict[str, Any]) -> Endpoint:
    """Serve `app`'s metrics on host:port (0: a free port); OSError naming `metrics_port` when
    that port cannot be bound. `labels` go on gym_server_info (role, worker, version). Called on
    the server's event loop, where a scrape reads a model server's engines' load."""
    registry = CollectorRegistry()
    loop = asyncio.get_running_loop()
    registry.register(CountersCollector(app, {k: str(v) for k, v in labels.items()}, loop))
    ProcessCollector(registry=registry)
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(
            f"server {app.name!r} could not serve its metrics on {host}:{port} (metrics_port): {e.strerror or e}"
        ) from None
    return Endpoint(httpd, host)
