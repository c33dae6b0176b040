"""An admission controller's decisions for Prometheus: `collect --admission engine --admission-metrics-port`.

The controller runs in the client (client/admission.py), which serves no gRPC, so `gym-grpc status`
cannot ask it; this endpoint is where a dashboard reads what it decided, beside the engines' own
gauges that the model servers serve (gym_engine_*: what it decided from). Rendered when scraped
from the `Admission`'s own state, nothing counted twice.

    gym_admission_window                      rollouts the controller lets run at once now
    gym_admission_rollouts_in_flight          rollouts running now
    gym_admission_floor, gym_admission_ceiling where the window may go
    gym_admission_decisions_total{action}     decisions: start, grow, hold, trim, cut
    gym_admission_preemptions_seen_total      engine preemptions seen between reads
    gym_admission_kv_cache_usage              the fullest engine KV cache at the last read, 0-1
    gym_admission_requests_waiting            requests queued in the engines at the last read
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gym_grpc.client.admission import Admission
from gym_grpc.server.metrics import Endpoint


class _AdmissionCollector(Collector):
    def __init__(self, admission: Admission) -> None:
        self.admission = admission

    def collect(self) -> Iterator[Metric]:
        a = self.admission
        limits = a.controller.limits
        yield GaugeMetricFamily("gym_admission_window", "rollouts the controller lets run at once", a.controller.window)
        yield GaugeMetricFamily("gym_admission_rollouts_in_flight", "rollouts running now", a.in_flight())
        yield GaugeMetricFamily("gym_admission_floor", "the window's floor", limits.floor)
        yield GaugeMetricFamily("gym_admission_ceiling", "the window's ceiling", limits.ceiling)
        decisions = CounterMetricFamily("gym_admission_decisions", "the controller's decisions", labels=["action"])
        for action, count in sorted(a.actions.items()):
            decisions.add_metric([action], count)
        yield decisions
        yield CounterMetricFamily("gym_admission_preemptions_seen", "engine preemptions seen", a.preempted)
        load = a.last_load
        if load is not None:
            yield GaugeMetricFamily(
                "gym_admission_kv_cache_usage", "fullest KV cache at the last read", load.kv_cache_usage
            )
            yield GaugeMetricFamily(
                "gym_admission_requests_waiting", "requests queued at the last read", load.requests_waiting
            )


def serve(admission: Admission, host: str, port: int) -> Endpoint:
    """Serve `admission`'s metrics on host:port (0: a free port); OSError naming the option when it
    cannot be bound."""
    registry = CollectorRegistry()
    registry.register(_AdmissionCollector(admission))
    try:
        httpd, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"--admission-metrics-port: cannot serve on {host}:{port}: {e.strerror or e}") from None
    return Endpoint(httpd, host)
