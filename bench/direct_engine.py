"""gym-grpc against a minimal direct script on the real CPU vLLM: is the framework ever the limit?

    python bench/direct_engine.py --rollouts 96 --concurrency 16   # bench/results/<name>.json + .md
    python bench/direct_engine.py --smoke                          # a few minutes (temp dir)

The workload is real_engine.py's token-in-token-out one (the multi_step refund
environment, simple agent, vllm_model on /v1/completions with token ids, temperature
1.0, tool_choice required), with one sampling seed per task so that a request sent
twice samples the same tokens.

1. Record: the rollouts are collected once through gym-grpc with its vllm_model
   pointed at a recording proxy in front of the engine. The proxy keeps the body of
   every generation request (/inference/v1/generate, where the engine serves it, as
   the local vLLM does; else /v1/completions), and the seed says which rollout it
   belongs to.
2. Then, in turn, `rounds` times: gym-grpc (vllm_model straight to the engine,
   `gym-grpc collect` as its own process) and the direct script: per rollout, the
   recorded request bodies POSTed to the engine one after the other (each turn
   waits for the answer of the one before), with the same number of rollouts in
   flight, over one aiohttp session, and nothing else. The direct script does less
   than any real loop would (no chat template, no tool, no parsing, no /tokenize
   call for the tool outputs), so it is an upper bound on what the engine allows.

Reported per round: rollouts/s, generated tokens/s (the answers' token ids), and the
CPU of gym-grpc's processes (or the script's) as a share of the engine's process
tree; then the medians and gym-grpc / direct. Both sides run against a warm prefix
cache (the recording pass filled it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_engine  # noqa: E402  (the bench directory is not a package)

bench_run = real_engine.bench_run
REPO = real_engine.REPO


# --- the recording proxy -------------------------------------------------------


#: The paths of the engine's generation requests: the prompt's ids and the seed in each one's body.
GENERATIONS = {
    "/inference/v1/generate": lambda body: (body["token_ids"], body["sampling_params"]["seed"]),
    "/v1/completions": lambda body: (body["prompt"], body["seed"]),
}


class Recorder:
    """An HTTP proxy in front of the engine that keeps every generation request (path and body) by its seed."""

    def __init__(self, engine_url: str) -> None:
        self.engine_root = engine_url.removesuffix("/v1")
        self.requests: dict[int, list[tuple[str, dict[str, Any]]]] = defaultdict(list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.path in GENERATIONS:
            parsed = json.loads(body)
            self.requests[GENERATIONS[request.path](parsed)[1]].append((request.path, parsed))
        async with self.session.request(
            request.method, self.engine_root + request.path_qs, data=body, headers={"Content-Type": "application/json"}
        ) as answer:
            return web.Response(body=await answer.read(), status=answer.status, content_type="application/json")

    async def serve(self, ready: asyncio.Future[str], stop: asyncio.Event) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=2**30)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        ready.set_result(f"http://127.0.0.1:{port}/v1")
        await stop.wait()
        await runner.cleanup()
        await self.session.close()

    def rollouts(self) -> list[list[tuple[str, dict[str, Any]]]]:
        """The recorded requests of each rollout, turn by turn (each turn's prompt is longer)."""
        return [
            sorted(turns, key=lambda turn: len(GENERATIONS[turn[0]](turn[1])[0]))
            for _, turns in sorted(self.requests.items())
        ]


# --- the direct script -----------------------------------------------------------


async def direct(engine_url: str, rollouts: list[list[tuple[str, dict[str, Any]]]], concurrency: int) -> dict[str, Any]:
    """The recorded requests straight to the engine: `concurrency` rollouts at a time, each
    rollout's turns one after the other. Rollouts/s and generated tokens/s."""
    todo = iter(rollouts)
    generated = 0
    failed = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=connector) as session:

        async def worker() -> None:
            nonlocal generated, failed
            for turns in todo:
                for path, body in turns:
                    async with session.post(engine_url.removesuffix("/v1") + path, json=body) as answer:
                        if answer.status != 200:
                            failed += 1
                            break
                        choice = (await answer.json())["choices"][0]
                        generated += len(choice.get("token_ids") or [])

        started = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.monotonic() - started
    done = len(rollouts) - failed
    return {
        "rollouts": done,
        "failed": failed,
        "seconds": round(seconds, 2),
        "rollouts_per_second": round(done / seconds, 3),
        "generated_tokens": generated,
        "generated_tokens_per_second": round(generated / seconds, 1),
    }


# --- one run ---------------------------------------------------------------------


def write_config(directory: Path, engine_url: str, proxy_url: str, model: str, max_steps: int) -> Path:
    """Two vllm_model servers on the token-in-token-out path, one through the proxy, each with its agent."""
    servers: dict[str, Any] = {
        "multi_step": {"entrypoint": f"{REPO}/servers/resources/multi_step/server.py:CustomerSupportEnv"}
    }
    for name, url in (("direct", engine_url), ("recorded", proxy_url)):
        servers[f"{name}_model"] = {
            "entrypoint": f"{REPO}/servers/models/vllm_model/server.py:VLLMModel",
            "config": {
                "base_url": url,
                "api_key": "EMPTY",
                "model": model,
                "return_token_ids": True,
                "token_in_token_out": True,
                "prefix_token_ids": "check",
                "read_timeout": 600,
            },
        }
        servers[f"{name}_agent"] = {
            "entrypoint": f"{REPO}/servers/agents/simple_agent/agent.py:SimpleAgent",
            "config": {"model_server": f"{name}_model", "resources_server": "multi_step", "max_steps": max_steps},
        }
    file = directory / "direct_engine.yaml"
    file.write_text(json.dumps({"registry": {"port": 0}, "servers": servers}))
    return file


def write_tasks(directory: Path, count: int, max_output_tokens: int) -> Path:
    """real_engine.py's task rows, each with its own sampling seed (its index)."""
    file = real_engine.write_tasks(directory, count, max_output_tokens)
    rows = [json.loads(line) for line in file.read_text().splitlines()]
    for i, row in enumerate(rows):
        row["responses_create_params"]["seed"] = i
    file.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return file


def gym_grpc_round(stack, engine_pid: int, tmp: Path, tasks: Path, concurrency: int) -> dict[str, Any]:
    out = tmp / "gym_grpc.jsonl"
    stack_before, engine_before = real_engine._tree_cpu(stack.process.pid), real_engine._tree_cpu(engine_pid)
    run = bench_run.collect(stack, "direct_agent", tasks, out, concurrency, "--timeout", "1800")
    stack_after, engine_after = real_engine._tree_cpu(stack.process.pid), real_engine._tree_cpu(engine_pid)
    rows = real_engine.read_jsonl(out)
    generated = sum(len(g) for row in rows for _, g in real_engine._turns(row["response"]["output"]))
    cpu = real_engine._delta(stack_before, stack_after) + run.collector_cpu
    engine_cpu = real_engine._delta(engine_before, engine_after)
    return {
        "rollouts": run.rollouts,
        "failed": run.failed,
        "seconds": round(run.seconds, 2),
        "rollouts_per_second": round(run.rollouts / run.seconds, 3),
        "generated_tokens": generated,
        "generated_tokens_per_second": round(generated / run.seconds, 1),
        "model_calls": sum(row.get("model_calls", 0) for row in rows),
        "cpu_seconds": round(cpu, 2),
        "engine_cpu_seconds": round(engine_cpu, 2),
        "cpu_share_of_engine": round(cpu / engine_cpu, 4),
    }


def direct_round(engine_url: str, engine_pid: int, rollouts: list, concurrency: int) -> dict[str, Any]:
    engine_before = real_engine._tree_cpu(engine_pid)
    own = resource.getrusage(resource.RUSAGE_SELF)
    result = asyncio.run(direct(engine_url, rollouts, concurrency))
    after = resource.getrusage(resource.RUSAGE_SELF)
    engine_cpu = real_engine._delta(engine_before, real_engine._tree_cpu(engine_pid))
    cpu = (after.ru_utime + after.ru_stime) - (own.ru_utime + own.ru_stime)
    return {
        **result,
        "model_calls": sum(len(turns) for turns in rollouts),
        "cpu_seconds": round(cpu, 2),
        "engine_cpu_seconds": round(engine_cpu, 2),
        "cpu_share_of_engine": round(cpu / engine_cpu, 4),
    }


def record(stack, tmp: Path, tasks: Path, concurrency: int) -> None:
    """The recording pass (through the proxy, which runs in a thread of this process)."""
    run = bench_run.collect(stack, "recorded_agent", tasks, tmp / "recorded.jsonl", concurrency, "--timeout", "1800")
    if run.failed:
        print(f"recording: {run.failed} rollouts failed; they are replayed as far as they went", file=sys.stderr)


def medians(rounds: list[dict[str, Any]]) -> dict[str, float]:
    keys = ("rollouts_per_second", "generated_tokens_per_second", "cpu_share_of_engine")
    return {key: round(statistics.median(r[key] for r in rounds), 4) for key in keys}


def markdown(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [
        *real_engine.markdown_head("gym-grpc against a direct script on a real engine", report),
        f"Workload: multi_step refund, simple agent, max_steps {w['max_steps']}, token in token out, temperature "
        f"1.0 with a seed per task, tool_choice required, max_output_tokens {w['max_output_tokens']}, "
        f"{w['concurrency']} rollouts in flight, {w['rollouts']} rollouts per round, {w['recorded_requests']} "
        "recorded generation requests.",
        "",
        "| round | gym-grpc rollouts/s | direct rollouts/s | gym-grpc tokens/s | direct tokens/s "
        "| gym-grpc CPU / engine CPU | direct CPU / engine CPU |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (g, d) in enumerate(zip(report["gym_grpc"], report["direct"], strict=True), 1):
        lines.append(
            f"| {i} | {g['rollouts_per_second']} | {d['rollouts_per_second']} | {g['generated_tokens_per_second']} "
            f"| {d['generated_tokens_per_second']} | {100 * g['cpu_share_of_engine']:.2f}% "
            f"| {100 * d['cpu_share_of_engine']:.2f}% |"
        )
    g, d, ratio = report["median"]["gym_grpc"], report["median"]["direct"], report["ratio"]
    lines += [
        f"| median | {g['rollouts_per_second']} | {d['rollouts_per_second']} | {g['generated_tokens_per_second']} "
        f"| {d['generated_tokens_per_second']} | {100 * g['cpu_share_of_engine']:.2f}% "
        f"| {100 * d['cpu_share_of_engine']:.2f}% |",
        "",
        f"gym-grpc / direct: rollouts/s {100 * ratio['rollouts_per_second']:.1f}%, generated tokens/s "
        f"{100 * ratio['generated_tokens_per_second']:.1f}% (medians).",
        "",
        *[f"- {note}" for note in NOTES],
        "",
    ]
    return "\n".join(lines)


NOTES = [
    "The direct script replays, per rollout, the generation requests gym-grpc's vllm_model sent in a "
    "recording pass (/inference/v1/generate where the engine serves it, else /v1/completions; same prompts, "
    "sampling parameters, seed and tool-call grammar), turn after turn, at the same concurrency; it sends no "
    "/tokenize call, runs no tool and parses nothing. gym-grpc also renders each tool output with a /tokenize "
    "call, which the engine serves.",
    "Rounds alternate (gym-grpc, then direct) after the recording pass, which warmed the engine's prefix cache "
    "for both. A round of gym-grpc is `gym-grpc collect` as its own process, timed from its start to its last "
    "row; the direct script is timed from its first request to its last answer.",
    "CPU: utime + stime of every process under `gym-grpc run` and of the collector (or of the direct script's "
    "process), over the round, against the engine's whole process tree.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=96, help="rollouts per round")
    parser.add_argument("--concurrency", type=int, default=16, help="rollouts in flight")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each, alternating")
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-output-tokens", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="8 rollouts, one round; results in a temp dir")
    parser.add_argument("--name", default="direct_engine", help="results file name")
    args = parser.parse_args()
    bench_run.stop_on_termination()
    if args.smoke:
        args.rollouts, args.concurrency, args.rounds = 8, 4, 1
    from gym_grpc.engines import local_vllm

    load_start = [round(x, 2) for x in os.getloadavg()]
    prepared = local_vllm.prepare()
    machine = real_engine.versions(prepared)
    print("starting the local vLLM ...", file=sys.stderr)
    engine = local_vllm.start(prepared, tied=True)
    report: dict[str, Any] = {"gym_grpc": [], "direct": []}
    loop = asyncio.new_event_loop()
    try:
        recorder = Recorder(engine.base_url)
        ready: asyncio.Future[str] = loop.create_future()
        stop = asyncio.Event()
        proxy = threading.Thread(target=loop.run_until_complete, args=(recorder.serve(ready, stop),), daemon=True)
        proxy.start()
        while not ready.done():
            time.sleep(0.05)
        with tempfile.TemporaryDirectory() as directory:
            tmp = Path(directory)
            stack = bench_run.Stack(write_config(tmp, engine.base_url, ready.result(), engine.model, args.max_steps))
            try:
                tasks = write_tasks(tmp, args.rollouts, args.max_output_tokens)
                print(f"recording {args.rollouts} rollouts ...", file=sys.stderr)
                record(stack, tmp, tasks, args.concurrency)
                loop.call_soon_threadsafe(stop.set)  # the proxy's work is done: it costs the rounds nothing
                proxy.join(timeout=30)
                rollouts = recorder.rollouts()
                for i in range(args.rounds):
                    print(f"round {i + 1}: gym-grpc ...", file=sys.stderr)
                    report["gym_grpc"].append(gym_grpc_round(stack, engine.pid, tmp, tasks, args.concurrency))
                    print(json.dumps(report["gym_grpc"][-1]), file=sys.stderr)
                    print(f"round {i + 1}: direct ...", file=sys.stderr)
                    report["direct"].append(direct_round(engine.base_url, engine.pid, rollouts, args.concurrency))
                    print(json.dumps(report["direct"][-1]), file=sys.stderr)
            finally:
                stack.stop()
    finally:
        local_vllm.stop(engine.pid)
    g, d = medians(report["gym_grpc"]), medians(report["direct"])
    report = {
        **real_engine.report_head("bench/direct_engine.py", args, machine, load_start),
        "workload": {**real_engine.workload(args), "recorded_requests": sum(len(turns) for turns in rollouts)},
        **report,
        "median": {"gym_grpc": g, "direct": d},
        "ratio": {key: round(g[key] / d[key], 4) for key in ("rollouts_per_second", "generated_tokens_per_second")},
        "notes": NOTES,
    }
    target = Path(tempfile.gettempdir()) if args.smoke else REPO / "bench" / "results"
    (target / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (target / f"{args.name}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"results: {target / args.name}.json and .md", file=sys.stderr)


if __name__ == "__main__":
    main()
