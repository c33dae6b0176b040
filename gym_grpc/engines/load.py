"""How loaded an engine is, by its own account: vLLM's Prometheus `/metrics`.

A model server reads its engines' load when asked (AdminService.GetCounters, `gym-grpc status`,
a scrape of its own metrics), never on a timer of its own: an engine is asked only while someone
watches. What is read, summed over the series of each name (one per model name, and one per
engine of a data-parallel vLLM), the KV cache usage as the highest:

    vllm:kv_cache_usage_perc       fraction of the KV cache in use, 0 to 1 (despite its name; vLLM
                                   before 0.10 called it vllm:gpu_cache_usage_perc)
    vllm:num_requests_running      requests the engine is generating for now
    vllm:num_requests_waiting      requests queued for room (a full batch, or a full KV cache)
    vllm:num_preemptions_total     requests since start the scheduler evicted from the KV cache to
                                   make room, to be computed again later (wasted work)

Names are checked against vLLM 0.32.0 (tests/data/vllm-0.32.0-metrics.txt, captured from the
local CPU vLLM under load). An engine without them (another server, a hosted API) or one that
cannot be reached gives a load with `error` set, never a failed call.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gym_grpc.v1.admin_service_pb2 import EngineLoad

#: The path of vLLM's Prometheus metrics, from the server root (not under /v1).
PATH = "/metrics"

#: Seconds a read of /metrics may take: a loaded CPU engine answers in milliseconds, and a
#: status line should not wait for one that does not.
READ_TIMEOUT = 2.0

#: Each field's metric names, the first found wins (older vLLMs named the KV cache "gpu").
_KV_CACHE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_RUNNING = ("vllm:num_requests_running",)
_WAITING = ("vllm:num_requests_waiting",)
_PREEMPTIONS = ("vllm:num_preemptions_total", "vllm:num_preemptions")


def parse(url: str, text: str) -> EngineLoad:
    """The load in a Prometheus text exposition of vLLM's; `error` says which metric is missing."""
    samples: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append(sample.value)
    except ValueError as e:
        return EngineLoad(url=url, error=f"its {PATH} is not Prometheus text: {e}")

    def values(names: tuple[str, ...]) -> list[float] | None:
        for name in names:
            if name in samples:
                return [v for v in samples[name] if math.isfinite(v)]
        return None

    kv, running, waiting, preemptions = values(_KV_CACHE), values(_RUNNING), values(_WAITING), values(_PREEMPTIONS)
    if kv is None or running is None or waiting is None or preemptions is None:
        named = zip((_KV_CACHE, _RUNNING, _WAITING, _PREEMPTIONS), (kv, running, waiting, preemptions), strict=True)
        missing = ", ".join(names[0] for names, got in named if got is None)
        return EngineLoad(url=url, error=f"its {PATH} has no {missing}: not a vLLM, or one of another version")
    return EngineLoad(
        url=url,
        kv_cache_usage=max(kv, default=0.0),
        requests_running=round(sum(running)),
        requests_waiting=round(sum(waiting)),
        preemptions_total=round(sum(preemptions)),
    )


def metrics_url(base_url: str) -> str:
    """Where an engine at `base_url` (".../v1", as model servers are configured) serves /metrics."""
    return f"{base_url.rstrip('/').removesuffix('/v1')}{PATH}"


async def read(session: aiohttp.ClientSession, base_url: str, within: float | None = None) -> EngineLoad:
    """The load of the engine at `base_url`, read once (no retries: the next read is the retry), in at
    most READ_TIMEOUT seconds or `within`, when that is shorter (what the caller's deadline leaves)."""
    url = metrics_url(base_url)
    seconds = READ_TIMEOUT if within is None else min(READ_TIMEOUT, within)
    try:
        async with asyncio.timeout(seconds):
            async with session.get(url) as reply:
                text = await reply.text(errors="replace")
                if reply.status != 200:
                    return EngineLoad(url=base_url, error=f"GET {url} answered HTTP {reply.status}")
    except TimeoutError:
        return EngineLoad(url=base_url, error=f"GET {url} did not answer within {seconds:.3g} s")
    except aiohttp.ClientError as e:
        return EngineLoad(url=base_url, error=f"GET {url} failed: {type(e).__name__}: {e}")
    return parse(base_url, text)
