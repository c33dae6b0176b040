"""The local CPU vLLM's process layout: its model in a worker process of its own (vLLM's layout on CPU)
or inside its engine core (gym_grpc.engines.local_vllm's): start, generation speed and CPU, for one
engine alone and for two side by side (as CI's two real-engine lanes run).

    python bench/local_engine.py           # the measurement: bench/results/<name>.json + .md
    python bench/local_engine.py --smoke   # 16 requests, one round (a temp dir), to check it works

vLLM on CPU runs its model in a worker process, and its engine core waits for each step of that
worker by spinning on shared memory (gym_grpc/engines/local_vllm/process.py says more). Each round
runs, for each layout in turn (the order alternating from round to round): one engine alone, then
two started side by side. Each engine gets the same work: --requests chat completions (48), at most
--concurrency at a time (8), --max-tokens tokens each (64, ignore_eos, temperature 1, seeded),
after one request that is not counted. Two engines get it at the same time. Per layout and setting,
the medians over --rounds (3) of: seconds from start until the engine serves (two: until both do),
seconds to generate the work (two: the slower engine's), generated tokens a second (two: both
engines' tokens over that time), and the engines' CPU seconds a generated token, split by process
(vLLM names its processes: VLLM::EngineCore, VLLM::Worker; its server is "python").
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import real_engine  # noqa: E402  (the bench directory is not a package)

LAYOUTS = {"worker_process": True, "in_engine_core": False}
SETTINGS = {"alone": 1, "two_side_by_side": 2}


def _by_process(pid: int) -> dict[str, float]:
    """CPU seconds of each live process of the engine started as pid, by process name."""
    cpu: dict[str, float] = defaultdict(float)
    for member, seconds in real_engine._tree_cpu(pid).items():
        try:
            name = Path(f"/proc/{member}/comm").read_text().strip()
        except OSError:
            continue
        cpu[name] += seconds
    return cpu


def _complete(engine: Any, seed: int, max_tokens: int) -> int:
    """One chat completion of max_tokens tokens: the tokens generated."""
    body = {
        "model": engine.model,
        "messages": [{"role": "user", "content": f"Count to {seed}, slowly."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": seed,
    }
    request = urllib.request.Request(
        engine.base_url + "/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())["usage"]["completion_tokens"]


def _generate(engine: Any, args: argparse.Namespace) -> tuple[float, int]:
    """The work on one engine: its seconds and the tokens it generated."""
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        tokens = sum(pool.map(lambda seed: _complete(engine, seed, args.max_tokens), range(1, args.requests + 1)))
    return time.monotonic() - started, tokens


def measure(layout: str, count: int, args: argparse.Namespace, logs: Path) -> dict:
    """Start `count` engines of the layout side by side, give each the work at once, stop them."""
    from gym_grpc.engines import local_vllm

    worker_process = LAYOUTS[layout]
    started = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        starting = [
            pool.submit(local_vllm.start, log_path=logs / f"{layout}-{count}-{i}.log", worker_process=worker_process)
            for i in range(count)
        ]
        engines = [future.result() for future in starting]
    serving = time.monotonic() - started
    try:
        for engine in engines:
            _complete(engine, 0, args.max_tokens)
        before = [_by_process(engine.pid) for engine in engines]
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            done = list(pool.map(lambda engine: _generate(engine, args), engines))
        after = [_by_process(engine.pid) for engine in engines]
    finally:
        for engine in engines:
            local_vllm.stop(engine.pid)
    tokens = sum(count for _, count in done)
    cpu: dict[str, float] = defaultdict(float)
    for old, new in zip(before, after, strict=True):
        for name, seconds in new.items():
            cpu[name] += seconds - old.get(name, 0.0)
    seconds = max(elapsed for elapsed, _ in done)
    return {
        "serving_seconds": round(serving, 1),
        "generation_seconds": round(seconds, 2),
        "tokens": tokens,
        "tokens_per_second": round(tokens / seconds, 1),
        "cpu_ms_per_token": round(1000 * sum(cpu.values()) / tokens, 2),
        "cpu_ms_per_token_by_process": {name: round(1000 * value / tokens, 2) for name, value in sorted(cpu.items())},
        "cores_busy": round(sum(cpu.values()) / seconds, 2),
    }


def _median(runs: list[dict]) -> dict:
    keys = ("serving_seconds", "generation_seconds", "tokens_per_second", "cpu_ms_per_token", "cores_busy")
    return {key: statistics.median(run[key] for run in runs) for key in keys}


def markdown(report: dict) -> str:
    title = "The local CPU vLLM: its model in a worker process or in its engine core"
    lines = real_engine.markdown_head(title, report)
    lines += [
        "| setting | layout | serving (s) | generating the work (s) | tokens/s | engine CPU ms a token | cores busy |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting in SETTINGS:
        for layout in LAYOUTS:
            median = report["medians"][setting][layout]
            lines.append(
                f"| {setting.replace('_', ' ')} | {layout.replace('_', ' ')} | {median['serving_seconds']} | "
                f"{median['generation_seconds']} | {median['tokens_per_second']} | {median['cpu_ms_per_token']} | "
                f"{median['cores_busy']} |"
            )
    lines += ["", "Medians of the rounds; every run, with its CPU by process, is in the JSON file.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48, help="chat completions per engine")
    parser.add_argument("--concurrency", type=int, default=8, help="at most this many at a time, per engine")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens each completion generates")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every layout and setting")
    parser.add_argument("--smoke", action="store_true", help="16 requests, one round; results in a temp dir")
    parser.add_argument("--name", default="local_engine", help="results file name")
    args = parser.parse_args()
    real_engine.bench_run.stop_on_termination()
    if args.smoke:
        args.requests, args.rounds = 16, 1
    from gym_grpc.engines import local_vllm

    load_start = [round(x, 2) for x in os.getloadavg()]
    prepared = local_vllm.prepare()
    machine = real_engine.versions(prepared)
    runs: dict[str, dict[str, list[dict]]] = {setting: {layout: [] for layout in LAYOUTS} for setting in SETTINGS}
    with tempfile.TemporaryDirectory() as directory:
        for round_index in range(args.rounds):
            order = list(LAYOUTS) if round_index % 2 == 0 else list(reversed(LAYOUTS))
            for layout in order:
                for setting, count in SETTINGS.items():
                    result = measure(layout, count, args, Path(directory))
                    runs[setting][layout].append(result)
                    print(f"round {round_index + 1}, {layout}, {setting}: {json.dumps(result)}", file=sys.stderr)
    report = {
        **real_engine.report_head("bench/local_engine.py", args, machine, load_start),
        "workload": {"requests": args.requests, "concurrency": args.concurrency, "max_tokens": args.max_tokens},
        "medians": {setting: {layout: _median(runs[setting][layout]) for layout in LAYOUTS} for setting in SETTINGS},
        "runs": runs,
    }
    real_engine.save(report, markdown(report), args.smoke)


if __name__ == "__main__":
    main()
