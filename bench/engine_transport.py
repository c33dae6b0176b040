"""HTTP or gRPC to the engine: what a token-path turn costs the model server, the engine's front end, and
the rollout's time, on the real CPU vLLM served both ways.

    python bench/engine_transport.py          # the measurement: bench/results/<name>.json + .md
    python bench/engine_transport.py --smoke  # 2 rollouts a cell, 1 repeat; results in a temp dir

One run starts the local vLLM twice, its OpenAI-compatible HTTP server and its gRPC server (the same
model and engine options; or reuses them: --http-url/--http-pid, --grpc-url/--grpc-pid), and one
`gym-grpc run` with the weather environment behind the simple agent and two vllm_model servers, both on
the token path with prompts rendered in the model server:

  http  base_url http://...: /v1/completions with the prompt's ids, JSON answers with the text,
        the generated ids and their log-probs
  grpc  base_url grpc://...: VllmEngine.Generate, ids in, ids and log-probs out; the text decoded in
        the model server with the tokenizer the engine sent

Each mode collects --rollouts rollouts of at most --turns model calls at --concurrency 1 (the time a turn
takes: the rollout's wall time over its turns, tool calls included, the same in both modes) and at
--load-concurrency (CPU per turn under load), repeated --repeats times with the modes in turn; medians.
CPU is utime+stime: the model server's processes, the engine's front end (vLLM's API server process,
or its gRPC server process: parsing, detokenizing, the event loop) and its engine core (the model).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import engine_link  # noqa: E402
import real_engine  # noqa: E402  (the bench directory is not a package)

bench_run = real_engine.bench_run


MODES = ("http", "grpc")


def write_config(
    directory: Path, urls: dict[str, str], model: str, tokenizer_dir: str, template: str, turns: int
) -> Path:
    models = {}
    for mode, url in urls.items():
        config: dict[str, Any] = {"base_url": url, "model": model, "return_token_ids": True, "chat_template": template}
        if mode == "http":
            config["tokenizer_dir"] = tokenizer_dir  # the gRPC one fetches the engine's (GetTokenizer)
        models[f"{mode}_model"] = config
    agents = {f"{mode}_agent": (f"{mode}_model", turns) for mode in urls}
    return real_engine.write_stack(directory, "engine_transport", engine_link.WEATHER, models, agents)


def _cpu(pids: list[int]) -> float:
    return sum(bench_run._cpu_seconds(pid) for pid in pids)


def cell(stack: Any, mode: str, engine_pid: int, tasks: Path, concurrency: int, tmp: Path) -> dict:
    model_pids = stack.run.pids(f"{mode}_model")
    model_before, front_before = _cpu(model_pids), bench_run._cpu_seconds(engine_pid)
    core_before = engine_link._core_cpu(engine_pid)
    out = tmp / f"{mode}.jsonl"
    run = bench_run.collect(stack, f"{mode}_agent", tasks, out, concurrency, "--timeout", "3600")
    model = _cpu(model_pids) - model_before
    front = bench_run._cpu_seconds(engine_pid) - front_before
    core = engine_link._core_cpu(engine_pid) - core_before
    rows = real_engine.read_jsonl(out)
    turns = max(sum(row.get("model_calls", 0) for row in rows), 1)
    return {
        "rollouts": len(rows),
        "failed": run.failed,
        "turns": turns,
        "seconds": round(run.seconds, 2),
        "ms_per_turn": round(1000 * run.seconds / turns, 1),
        "model_server_cpu_ms_per_turn": round(1000 * model / turns, 2),
        "engine_front_cpu_ms_per_turn": round(1000 * front / turns, 2),
        "engine_core_cpu_ms_per_turn": round(1000 * core / turns, 1),
    }


KEYS = ("ms_per_turn", "model_server_cpu_ms_per_turn", "engine_front_cpu_ms_per_turn", "engine_core_cpu_ms_per_turn")


def summary(cells: list[dict]) -> dict:
    return {key: round(statistics.median(c[key] for c in cells), 2) for key in KEYS} | {
        "failed": sum(c["failed"] for c in cells),
        "turns": sum(c["turns"] for c in cells),
    }


def markdown(report: dict) -> str:
    lines = real_engine.markdown_head("HTTP or gRPC to the engine: a token-path turn", report)
    w = report["workload"]
    lines += [
        "",
        f"Weather rollouts of at most {w['turns']} model calls, {w['rollouts']} a cell, {w['repeats']} repeats "
        "with the modes in turn; medians of the repeats (ratio gRPC / HTTP).",
        "",
        "| rollouts at once | mode | ms / turn | model-server CPU ms / turn | engine front-end CPU ms / turn "
        "| engine core CPU ms / turn | turns (failed rollouts) |",
        "|---|---|---|---|---|---|---|",
    ]
    for concurrency, modes in report["summary"].items():
        http = modes["http"]
        for mode, s in modes.items():
            shown = [
                f"{s[key]}" + ("" if mode == "http" or not http[key] else f" ({s[key] / http[key]:.2f}x)")
                for key in KEYS
            ]
            lines.append(f"| {concurrency} | {mode} | {' | '.join(shown)} | {s['turns']} ({s['failed']}) |")
    lines += ["", *(f"- {note}" for note in report["notes"]), ""]
    return "\n".join(lines)


NOTES = [
    "http: vllm_model to vLLM's OpenAI-compatible server, /v1/completions with the prompt's ids (rendered in "
    "the model server); grpc: to vLLM's gRPC server (vllm.entrypoints.launchers.grpc_server), Generate; the "
    "text decoded in the model server. Same model, same engine options, both engines idle but for this.",
    "ms / turn: the collect's wall time over its model calls, tool calls and the agent included; at 1 rollout "
    "at once it is a turn's latency. Engine front end: the process that serves the protocol (vLLM's API server, "
    "or its gRPC server); engine core: its child processes (the model).",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=4, help="most model calls per rollout")
    parser.add_argument("--rollouts", type=int, default=8, help="rollouts per cell")
    parser.add_argument("--load-concurrency", type=int, default=8, help="rollouts at once in the loaded cells")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-output-tokens", type=int, default=48)
    parser.add_argument("--http-url", help="reuse a running HTTP vLLM (its /v1 URL)")
    parser.add_argument("--http-pid", type=int, help="its API server's PID")
    parser.add_argument("--grpc-url", help="reuse a running gRPC vLLM (grpc://host:port)")
    parser.add_argument("--grpc-pid", type=int, help="its gRPC server's PID")
    parser.add_argument("--engine-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--smoke", action="store_true", help="2 rollouts a cell, 1 repeat; results in a temp dir")
    parser.add_argument("--name", default="engine_transport", help="results file name")
    args = parser.parse_args()
    bench_run.stop_on_termination()
    if args.smoke:
        args.rollouts, args.repeats = 2, 1
    from gym_grpc.engines import local_vllm

    load_start = [round(x, 2) for x in __import__("os").getloadavg()]
    prepared = local_vllm.prepare()
    machine = real_engine.versions(prepared)
    started = []
    if args.http_url and args.grpc_url:
        urls, pids, model = (
            {"http": args.http_url, "grpc": args.grpc_url},
            {"http": args.http_pid, "grpc": args.grpc_pid},
            args.engine_model,
        )
    else:
        print("starting the local vLLM's HTTP and gRPC servers ...", file=sys.stderr)
        started = [local_vllm.start(prepared, tied=True), local_vllm.start(prepared, tied=True, grpc=True)]
        urls = {"http": started[0].base_url, "grpc": started[1].base_url}
        pids, model = {"http": started[0].pid, "grpc": started[1].pid}, started[0].model
    levels = [1, args.load_concurrency]
    runs: dict[str, dict[str, list[dict]]] = {str(c): {mode: [] for mode in MODES} for c in levels}
    try:
        with tempfile.TemporaryDirectory() as directory:
            tmp = Path(directory)
            template = str(local_vllm.CHAT_TEMPLATE)
            config = write_config(tmp, urls, model, str(prepared.model_dir), template, args.turns)
            stack = bench_run.Stack(config)
            try:
                tasks = engine_link.write_tasks(tmp, args.rollouts, args.max_output_tokens)
                warm = engine_link.write_tasks(tmp, 1, 16)
                for mode in MODES:  # what a model server asks once (tokenizer, context) is not a turn's cost
                    bench_run.collect(stack, f"{mode}_agent", warm, tmp / "warm.jsonl", 1)
                for repeat in range(args.repeats):
                    for concurrency in levels:
                        for mode in MODES if repeat % 2 == 0 else reversed(MODES):
                            print(f"repeat {repeat + 1}, {concurrency} at once, {mode} ...", file=sys.stderr)
                            result = cell(stack, mode, pids[mode], tasks, concurrency, tmp)
                            runs[str(concurrency)][mode].append(result)
                            print(json.dumps(result), file=sys.stderr)
            finally:
                stack.stop()
    finally:
        for engine in started:
            local_vllm.stop(engine.pid)
    report = {
        **real_engine.report_head("bench/engine_transport.py", args, machine, load_start),
        "workload": {
            "environment": "weather",
            "turns": args.turns,
            "rollouts": args.rollouts,
            "levels": levels,
            "repeats": args.repeats,
            "max_output_tokens": args.max_output_tokens,
            "temperature": 1.0,
            "tool_choice": "required",
        },
        "notes": NOTES,
        "summary": {c: {mode: summary(cells) for mode, cells in modes.items()} for c, modes in runs.items()},
        "runs": runs,
    }
    real_engine.save(report, markdown(report), args.smoke)


if __name__ == "__main__":
    main()
