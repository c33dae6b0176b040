"""What handing a check to another process costs the server that asks: gym_grpc.cpu_pool.CpuPool beside
concurrent.futures' ProcessPoolExecutor (`loop.run_in_executor`, what CpuPool used before), in one run.

    python bench/check_pool.py --name 2core-epyc     # bench/results/2core-epyc-check_pool.json
    python bench/check_pool.py --smoke               # seconds; results in a temp dir

Each pool has one spawned worker process and runs under uvloop, as a server does. Two functions: a
trivial one (an addition: the cost of the hand-off alone) and the math environment's check_answer
(math-verify, the check a GRPO group runs once per rollout). Each is called `--calls` times, one at a
time and 8 at a time, the two pools alternating for `--rounds` rounds; per call: the calling process's
CPU (time.process_time), the worker's (/proc), and the wall time. Medians of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_spec = importlib.util.spec_from_file_location("bench_real_engine", REPO / "bench" / "real_engine.py")
assert _spec is not None and _spec.loader is not None
bench_real = sys.modules["bench_real_engine"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_real)
bench_run = bench_real.bench_run

from gym_grpc.cpu_pool import CpuPool  # noqa: E402
from servers.resources.math.server import check_answer  # noqa: E402

Call = Callable[..., Awaitable[Any]]


def add(a: int, b: int) -> int:
    return a + b


def math_check(i: int) -> tuple[bool, str]:
    """A GRPO-like stream: 8 answers to each expected one, right and wrong in turn."""
    expected = i // 8 % 17 + 2
    return check_answer(str(expected), f"The answer is {expected + i % 2}.", 5)


WORKLOADS: dict[str, Callable[[int], Any]] = {"trivial": lambda i: (add, i, 1), "math_check": lambda i: (math_check, i)}


async def _measure(call: Call, worker_pid: int, workload: str, calls: int, in_flight: int) -> dict[str, float]:
    make = WORKLOADS[workload]
    slots = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with slots:
            await call(*make(i))

    caller, worker, wall = time.process_time(), bench_run._cpu_seconds(worker_pid), time.monotonic()
    await asyncio.gather(*(one(i) for i in range(calls)))
    return {
        "caller_cpu_ms": round((time.process_time() - caller) / calls * 1000, 4),
        "worker_cpu_ms": round((bench_run._cpu_seconds(worker_pid) - worker) / calls * 1000, 4),
        "wall_ms": round((time.monotonic() - wall) / calls * 1000, 4),
    }


async def _with_executor(workload: str, calls: int, in_flight: int) -> dict[str, float]:
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    loop = asyncio.get_running_loop()

    async def call(fn: Callable[..., Any], *args: Any) -> Any:
        return await loop.run_in_executor(pool, fn, *args)

    try:
        for i in range(200):  # the worker up, math-verify imported and warm
            await call(*WORKLOADS[workload](i))
        (pid,) = [p.pid for p in pool._processes.values()]  # type: ignore[union-attr]  # CPython's own
        return await _measure(call, pid, workload, calls, in_flight)
    finally:
        pool.shutdown()


async def _with_cpu_pool(workload: str, calls: int, in_flight: int) -> dict[str, float]:
    pool = CpuPool("bench", workers=1)
    await pool.start()
    try:
        for i in range(200):
            await pool.run(*WORKLOADS[workload](i))
        pid = await pool.run(os.getpid)
        return await _measure(pool.run, pid, workload, calls, in_flight)
    finally:
        pool.close()


async def bench(calls: int, rounds: int) -> dict[str, Any]:
    pools = {"process_pool_executor": _with_executor, "cpu_pool": _with_cpu_pool}
    results: dict[str, Any] = {}
    for workload in WORKLOADS:
        for in_flight in (1, 8):
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in pools}
            for _ in range(rounds):
                for name, measure in pools.items():
                    runs[name].append(await measure(workload, calls, in_flight))
            row: dict[str, Any] = {"runs": runs}
            for name in pools:
                row[name] = {key: statistics.median(r[key] for r in runs[name]) for key in runs[name][0]}
            row["caller_cpu_ratio"] = round(
                row["process_pool_executor"]["caller_cpu_ms"] / row["cpu_pool"]["caller_cpu_ms"], 2
            )
            results[f"{workload}, {in_flight} in flight"] = row
            before, after = row["process_pool_executor"]["caller_cpu_ms"], row["cpu_pool"]["caller_cpu_ms"]
            print(f"{workload}, {in_flight} in flight: caller CPU ms a call {before}, now {after}", file=sys.stderr)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="local", help="results go to bench/results/NAME-check_pool.json")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="200 calls, 1 round, results in a temp dir")
    args = parser.parse_args()
    bench_run.stop_on_termination()
    if args.smoke:
        args.calls, args.rounds = 200, 1
    import uvloop

    load_start = [round(x, 2) for x in os.getloadavg()]
    report = bench_real.report_head("bench/check_pool.py", args, bench_real.versions(None), load_start)
    report["settings"] = {"calls": args.calls, "rounds": args.rounds, "workers": 1}
    report["results"] = uvloop.run(bench(args.calls, args.rounds))
    report["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    directory = Path(tempfile.mkdtemp()) if args.smoke else REPO / "bench" / "results"
    path = directory / f"{args.name}-check_pool.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
