"""Where the CPU of one rollout goes, on the HTTP-engine path, against the raw gRPC floor.

`python bench/run.py --only cpu_split` runs it. The weather workload of the peer
benchmark (vllm_model on Chat Completions with token ids, in front of
instant_engine.py; the simple agent; the weather environment; `gym-grpc collect` as
its own process) is collected `repeats` times; each time, the CPU of every process
(from /proc, and the collector's from wait4) over the collection, per rollout. The
raw floor is raw_echo.py's CPU per unary call (client + server) in the same run, so
"raw-call equivalents" = CPU per rollout / CPU per raw call (rollout-sized payload). The
same with a small payload, times the rollout's five gRPC exchanges (four unary calls, and
the collector's run, a message each way on a RunMany call), is what its calls alone
would cost as unary calls with no framework at all. A last collection runs
with `profiling_enabled` (yappi in every server, CPU clock) and its logs are kept next
to the results: yappi slows the servers about twofold, so read them for shares, not
for times.

Each collection is made twice, alternately: with a process per server, and with the
three servers in one process (a `process:` group: the agent calls its model server and
environment in-process, so the rollout's only gRPC traffic is the collector's run).
"""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import nemo_gym_peer
import run as bench

#: A rollout of the weather workload makes these calls (the collector's run on RunMany, two
#: CreateResponse, one CallTool, one Verify; the environment is stateless).
GRPC_CALLS, HTTP_CALLS = 5, 2

#: The servers in one process: the overrides of `gym-grpc run`, and the gRPC calls left per rollout (its run).
ONE_PROCESS = tuple(f"servers.{name}.process=rollout" for name in ("policy_model", "env", "agent"))
ONE_PROCESS_GRPC_CALLS = 1


def _one(tmp: Path, engine: bench.InstantEngine, tasks: Path, window: int, *overrides: str) -> dict:
    stack = bench.Stack(nemo_gym_peer._gym_grpc_config(tmp, "weather", engine.url), *overrides)
    try:
        names = bench.server_names(stack)
        bench.collect(stack, "agent", tasks, tmp / "warm.jsonl", window, "--limit", "1000")
        before = {pid: bench._cpu_seconds(pid) for pid in stack.pids}
        engine_before = engine.cpu()
        run = bench.collect(stack, "agent", tasks, tmp / "out.jsonl", window)
        per_process = {names[pid]: bench._cpu_seconds(pid) - before[pid] for pid in stack.pids}
        engine_cpu = engine.cpu() - engine_before
    finally:
        stack.stop()
    per_process["collector"] = run.collector_cpu
    ms = {name: round(1000 * cpu / run.rollouts, 3) for name, cpu in per_process.items()}
    return {
        "rollouts": run.rollouts,
        "failed": run.failed,
        "rollouts_per_second": round(run.rollouts / run.seconds, 1),
        "cpu_ms_per_rollout": round(sum(ms.values()), 3),
        "by_process_ms": ms,
        "engine_cpu_ms_per_rollout": round(1000 * engine_cpu / run.rollouts, 3),
    }


def _summary(runs: list[dict], raw: dict) -> dict:
    median = statistics.median(r["cpu_ms_per_rollout"] for r in runs)
    processes = list(runs[0]["by_process_ms"])
    return {
        "runs": runs,
        "median_cpu_ms_per_rollout": median,
        "median_rollouts_per_second": statistics.median(r["rollouts_per_second"] for r in runs),
        "median_by_process_ms": {p: statistics.median(r["by_process_ms"][p] for r in runs) for p in processes},
        "raw_call_equivalents": round(median / raw["cpu_ms_per_call"], 2),
    }


def bench_cpu_split(tmp: Path, rollouts: int, window: int, repeats: int, raw_calls: int, profiles: Path | None) -> dict:
    raw = bench.bench_raw(raw_calls, [256])[0]
    small = bench.bench_raw(raw_calls, [256], "small")[0]
    tasks = tmp / "cpu_split_tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in nemo_gym_peer.task_rows("weather", rollouts)))
    engine = bench.InstantEngine(tmp)
    runs: list[dict] = []
    one_process: list[dict] = []
    try:
        for _ in range(repeats):  # alternately, so that the machine's load falls on both alike
            runs.append(_one(tmp, engine, tasks, window))
            one_process.append(_one(tmp, engine, tasks, window, *ONE_PROCESS))
        profiled = None
        if profiles is not None:
            logs = tmp / "profiles"
            shutil.rmtree(logs, ignore_errors=True)
            profiling = ("profiling_enabled=true", f"profiling_results_dirpath={logs}")
            profiled = _one(tmp, engine, tasks, window, *profiling)
            profiled_one = _one(tmp, engine, tasks, window, *profiling, *ONE_PROCESS)
            profiles.mkdir(parents=True, exist_ok=True)
            for log in sorted(logs.glob("*.log")):
                lines = log.read_text().splitlines()
                (profiles / log.name).write_text("\n".join(lines[:80]) + "\n")  # the header and the top 79
    finally:
        engine.stop()
    return {
        "workload": "weather: vllm_model (Chat Completions, token ids) -> instant_engine.py, simple agent, weather",
        "grpc_calls_per_rollout": GRPC_CALLS,
        "http_calls_per_rollout": HTTP_CALLS,
        "in_flight": window,
        "raw": raw,
        "raw_small": small,
        "floor_of_its_grpc_calls_ms": round(GRPC_CALLS * small["cpu_ms_per_call"], 3),
        **_summary(runs, raw),
        "profiled": profiled,
        "one_process": {
            "overrides": list(ONE_PROCESS),
            "grpc_calls_per_rollout": ONE_PROCESS_GRPC_CALLS,
            **_summary(one_process, raw),
            "profiled": profiled_one if profiles is not None else None,
        },
        "profiles": str(profiles.relative_to(bench.REPO)) if profiles is not None else None,
    }


def table(result: dict) -> str:
    raw = result["raw"]
    one = result["one_process"]
    lines = [
        f"raw grpc.aio unary, rollout-sized payload, {raw['in_flight']} in flight: {raw['cpu_ms_per_call']} ms CPU "
        f"per call; with a small payload: {result['raw_small']['cpu_ms_per_call']} ms, so the rollout's "
        f"{result['grpc_calls_per_rollout']} gRPC calls cost {result['floor_of_its_grpc_calls_ms']} ms at the floor",
        "",
        "| process | CPU ms per rollout (median) |",
        "|---|---|",
    ]
    for layout in (result, one):
        for name, ms in layout["median_by_process_ms"].items():
            lines.append(f"| {name} | {ms} |")
        lines.append(
            f"| **all** | **{layout['median_cpu_ms_per_rollout']}** = {layout['raw_call_equivalents']} raw calls "
            f"({layout['grpc_calls_per_rollout']} gRPC + {result['http_calls_per_rollout']} HTTP calls per rollout), "
            f"{layout['median_rollouts_per_second']} rollouts/s |"
        )
    return "\n".join(lines)
