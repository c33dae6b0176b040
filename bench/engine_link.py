"""The engine link: what a token-path turn asks of the engine, by the turns of a rollout and by where
its prompt is rendered, on the real CPU vLLM.

    python bench/engine_link.py          # the measurement: bench/results/<name>.json + .md
    python bench/engine_link.py --smoke  # 2 rollouts a cell, T = 2 and 4 (a temp dir), to check it works

One run starts the local vLLM (gym_grpc.engines.local_vllm; or --engine-url/--engine-pid reuses one),
a counting HTTP proxy per model server in front of it (requests by path and bytes sent), and one
`gym-grpc run` with the weather environment behind the simple agent and three vllm_model servers,
all with return_token_ids and token_in_token_out:

  before  render: engine, session_memory: 0 -- every call renders every earlier turn again on the
          engine (/tokenize), as vllm_model did before the session's last prompt was kept (f046f56)
  engine  render: engine -- the session's last prompt kept: two /tokenize a turn
  local   tokenizer_dir and chat_template: the prompt rendered in the model server, the generation only

For each T (--turns, default 2, 4, 8, 16) each server collects --rollouts rollouts (default 10) of
max_steps T, every row asking tool_choice "required" (the 135M model calls no tool unprompted), so a
rollout is T model calls unless the context runs out. Each model server first runs one rollout, not
counted (what it asks once: the template's turn closing, the context length). Per cell: turns per rollout; the engine's
requests per rollout and per turn, by path; KB sent to the engine per rollout and per turn (of it to
/tokenize); the engine's API-server CPU seconds per rollout and per turn (utime+stime of vLLM's API
server process, the one that renders and tokenizes; its engine core is reported apart); gym-grpc's
CPU seconds per rollout and per turn (its server processes: the collector is left out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import real_engine  # noqa: E402  (the bench directory is not a package)

bench_run = real_engine.bench_run


MODES = ("before", "engine", "local")
WEATHER = ("weather", "weather/server.py:WeatherEnv")


class CountingProxy:
    """An HTTP proxy in front of the engine that counts requests by path, and the bytes of their bodies."""

    def __init__(self, engine_url: str) -> None:
        self.engine_root = engine_url.removesuffix("/v1")
        self.requests: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.requests[request.path] += 1
        self.bytes[request.path] += len(body) + len(request.path_qs)
        async with self.session.request(
            request.method, self.engine_root + request.path_qs, data=body or None, headers=_headers(request)
        ) as answer:
            return web.Response(body=await answer.read(), status=answer.status, content_type="application/json")

    async def serve(self, ready: threading.Event, stop: asyncio.Event) -> None:
        self.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), connector=aiohttp.TCPConnector(limit=0)
        )
        app = web.Application(client_max_size=2**30)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"  # type: ignore[union-attr]
        ready.set()
        await stop.wait()
        await runner.cleanup()
        await self.session.close()

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        return Counter(self.requests), Counter(self.bytes)


def _headers(request: web.Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}


class Proxies:
    """A CountingProxy per mode, served by one event loop in a thread of this process."""

    def __init__(self, engine_url: str) -> None:
        self.by_mode = {mode: CountingProxy(engine_url) for mode in MODES}
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        ready = [threading.Event() for _ in MODES]
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        for event in ready:
            event.wait(30)

    def _run(self, ready: list[threading.Event]) -> None:
        asyncio.set_event_loop(self._loop)
        self._stop = asyncio.Event()
        serving = [proxy.serve(event, self._stop) for proxy, event in zip(self.by_mode.values(), ready, strict=True)]
        self._loop.run_until_complete(asyncio.gather(*serving))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def write_config(
    directory: Path, proxies: Proxies, model: str, tokenizer_dir: str, chat_template: str, turns: list[int]
) -> Path:
    """The weather environment, a model server per mode (through its proxy) and an agent per mode and T."""
    models = {}
    for mode, proxy in proxies.by_mode.items():
        config: dict[str, Any] = {"base_url": proxy.url, "model": model, "return_token_ids": True}
        if mode == "before":
            config.update(render="engine", session_memory=0)
        elif mode == "engine":
            config.update(render="engine")
        else:
            config.update(render="local", tokenizer_dir=tokenizer_dir, chat_template=chat_template)
        models[f"{mode}_model"] = config
    agents = {f"{mode}_agent_{t}": (f"{mode}_model", t) for mode in MODES for t in turns}
    return real_engine.write_stack(directory, "engine_link", WEATHER, models, agents)


def write_tasks(directory: Path, count: int, max_output_tokens: int) -> Path:
    return real_engine.write_tasks(directory, count, max_output_tokens, bench_run.WEATHER_ROWS)


def _core_cpu(api_pid: int | None) -> float:
    """CPU seconds of the engine's processes other than its API server (its engine core)."""
    if not api_pid:
        return 0.0
    return sum(cpu for pid, cpu in real_engine._tree_cpu(api_pid).items() if pid != api_pid)


def cell(stack: Any, proxy: CountingProxy, mode: str, turns: int, tasks: Path, tmp: Path, args: Any) -> dict:
    """One mode at one T: collect through its agent, and what the engine was asked meanwhile."""
    out = tmp / f"{mode}_{turns}.jsonl"
    requests_before, bytes_before = proxy.snapshot()
    api_before = bench_run._cpu_seconds(args.engine_pid) if args.engine_pid else 0.0
    core_before = _core_cpu(args.engine_pid)
    stack_before = stack.cpu()
    run = bench_run.collect(stack, f"{mode}_agent_{turns}", tasks, out, args.concurrency, "--timeout", "3600")
    requests_after, bytes_after = proxy.snapshot()
    api = (bench_run._cpu_seconds(args.engine_pid) - api_before) if args.engine_pid else None
    core = _core_cpu(args.engine_pid) - core_before
    gym_grpc = stack.cpu() - stack_before
    rows = real_engine.read_jsonl(out)
    model_calls = sum(row.get("model_calls", 0) for row in rows)
    requests, sent = requests_after - requests_before, bytes_after - bytes_before
    per_rollout, per_turn = 1 / max(len(rows), 1), 1 / max(model_calls, 1)
    return {
        "rollouts": len(rows),
        "failed": run.failed,
        "turns_per_rollout": round(model_calls * per_rollout, 2),
        "requests_per_rollout": {path: round(n * per_rollout, 2) for path, n in sorted(requests.items())},
        "requests_per_turn": {path: round(n * per_turn, 2) for path, n in sorted(requests.items())},
        "kb_sent_per_rollout": round(sum(sent.values()) / 1024 * per_rollout, 1),
        "kb_sent_per_rollout_tokenize": round(sent["/tokenize"] / 1024 * per_rollout, 1),
        "kb_sent_per_turn": round(sum(sent.values()) / 1024 * per_turn, 2),
        "kb_sent_per_turn_tokenize": round(sent["/tokenize"] / 1024 * per_turn, 2),
        "engine_api_cpu_s_per_rollout": None if api is None else round(api * per_rollout, 3),
        "engine_api_cpu_s_per_turn": None if api is None else round(api * per_turn, 4),
        "engine_core_cpu_s_per_rollout": round(core * per_rollout, 2),
        "gym_grpc_cpu_s_per_rollout": round(gym_grpc * per_rollout, 3),
        "gym_grpc_cpu_s_per_turn": round(gym_grpc * per_turn, 4),
        "seconds": round(run.seconds, 1),
    }


def markdown(report: dict) -> str:
    lines = real_engine.markdown_head("The engine link: what a token-path turn asks of the engine", report)
    lines += [
        "",
        "| T (max model calls) | mode | turns / rollout | requests / turn (/tokenize) | KB sent / turn (to /tokenize) "
        "| engine API CPU ms / turn | gym-grpc CPU ms / turn | KB sent / rollout | engine API CPU s / rollout "
        "| gym-grpc CPU s / rollout |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for turns, modes in report["results"].items():
        for mode, r in modes.items():
            per_turn = sum(r["requests_per_turn"].values())
            tokenize = r["requests_per_turn"].get("/tokenize", 0)
            api_ms = "-" if r["engine_api_cpu_s_per_turn"] is None else f"{1000 * r['engine_api_cpu_s_per_turn']:.1f}"
            api_s = "-" if r["engine_api_cpu_s_per_rollout"] is None else f"{r['engine_api_cpu_s_per_rollout']:.3f}"
            lines.append(
                f"| {turns} | {mode} | {r['turns_per_rollout']} | {per_turn:.2f} ({tokenize:.2f}) "
                f"| {r['kb_sent_per_turn']:.2f} ({r['kb_sent_per_turn_tokenize']:.2f}) | {api_ms} "
                f"| {1000 * r['gym_grpc_cpu_s_per_turn']:.1f} | {r['kb_sent_per_rollout']} | {api_s} "
                f"| {r['gym_grpc_cpu_s_per_rollout']:.3f} |"
            )
    lines += ["", *(f"- {note}" for note in report["notes"]), ""]
    return "\n".join(lines)


NOTES = [
    "before: render: engine with session_memory: 0, which renders every earlier turn again on each call, "
    "as vllm_model did on f046f56; engine: the session's last prompt kept (two /tokenize a turn); local: "
    "rendered in the model server with the engine's tokenizer and chat template (the generation only).",
    "Requests and bytes are counted by a proxy between each model server and the engine. Bytes are the "
    "request bodies: a /v1/completions body carries the whole prompt as token ids, which grows with the "
    "conversation in every mode (vLLM keeps no state between requests; its prefix cache makes the "
    "recomputation cheap, not the transfer).",
    "Engine API CPU: utime+stime of vLLM's API server process (it parses requests, renders and tokenizes); "
    "the engine core (the model) is reported apart, per rollout, in the JSON.",
    "gym-grpc CPU: utime+stime of the `gym-grpc run` stack's server processes over the cell (one mode's "
    "agent and model server run at a time; the collector, whose interpreter start-up would swamp a "
    "small cell, is left out): what rendering in the model server costs it, against what it moves off "
    "the engine's API server.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default="2,4,8,16", help="max model calls per rollout, comma-separated")
    parser.add_argument("--rollouts", type=int, default=10, help="rollouts per mode and T")
    parser.add_argument("--concurrency", type=int, default=10, help="rollouts in flight")
    parser.add_argument("--max-output-tokens", type=int, default=48)
    parser.add_argument("--engine-url", help="reuse a running engine (its /v1 URL) instead of starting one")
    parser.add_argument("--engine-pid", type=int, help="the reused engine's API server PID, for its CPU time")
    parser.add_argument("--engine-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--smoke", action="store_true", help="2 rollouts, T = 2 and 4; results in a temp dir")
    parser.add_argument("--name", default="engine_link", help="results file name")
    args = parser.parse_args()
    bench_run.stop_on_termination()
    if args.smoke:
        args.rollouts, args.turns = 2, "2,4"
    turns = [int(t) for t in args.turns.split(",")]
    from gym_grpc.engines import local_vllm

    load_start = [round(x, 2) for x in __import__("os").getloadavg()]
    prepared = local_vllm.prepare()
    machine = real_engine.versions(prepared)
    engine = None
    if args.engine_url:
        engine_url, model = args.engine_url, args.engine_model
    else:
        print("starting the local vLLM ...", file=sys.stderr)
        engine = local_vllm.start(prepared, tied=True)
        engine_url, model, args.engine_pid = engine.base_url, engine.model, engine.pid
    proxies = Proxies(engine_url)
    results: dict[str, dict[str, Any]] = {}
    try:
        with tempfile.TemporaryDirectory() as directory:
            tmp = Path(directory)
            config = write_config(tmp, proxies, model, str(prepared.model_dir), str(local_vllm.CHAT_TEMPLATE), turns)
            stack = bench_run.Stack(config)
            try:
                tasks = write_tasks(tmp, args.rollouts, args.max_output_tokens)
                # What a model server asks once (the template's turn closing, the context length) is
                # not a turn's cost: a rollout of each first, not counted.
                for mode in MODES:
                    bench_run.collect(stack, f"{mode}_agent_{turns[0]}", write_tasks(tmp, 1, 16), tmp / "warm.jsonl", 1)
                for t in turns:
                    for mode in MODES:
                        print(f"T={t} {mode}: {args.rollouts} rollouts ...", file=sys.stderr)
                        result = cell(stack, proxies.by_mode[mode], mode, t, tasks, tmp, args)
                        results.setdefault(str(t), {})[mode] = result
                        print(json.dumps(result), file=sys.stderr)
            finally:
                stack.stop()
    finally:
        proxies.close()
        if engine is not None:
            local_vllm.stop(engine.pid)
    report = {
        **real_engine.report_head("bench/engine_link.py", args, machine, load_start),
        "workload": {
            "environment": "weather",
            "turns": turns,
            "rollouts": args.rollouts,
            "concurrency": args.concurrency,
            "max_output_tokens": args.max_output_tokens,
            "temperature": 1.0,
            "tool_choice": "required",
        },
        "notes": NOTES,
        "results": results,
    }
    real_engine.save(report, markdown(report), args.smoke)


if __name__ == "__main__":
    main()
