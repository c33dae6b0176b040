"""Prefix-cache friendly routing: what two engine processes' own prefix caches hit when a model server
spreads GRPO groups by session, keys them by their prompt, or by the caller's prompt_cache_key.

    python bench/prefix_routing.py          # the measurement: bench/results/<name>.json + .md
    python bench/prefix_routing.py --smoke  # 2 groups, results in a temp dir

One run starts two local CPU vLLMs (or reuses them: --engine-urls), and one `gym-grpc run` with the
weather environment behind the simple agent and a vllm_model server per routing mode, each with both
engines as its base URLs (token path, prompts rendered in the model server):

  session  route_by: session (the default): a rollout's turns on one engine, rollouts spread
  prompt   route_by: prompt: the conversation's start picks the engine
  key      route_by: session, every row with prompt_cache_key = its group

Each mode collects --groups groups of --members rollouts (`--num-repeats`, a GRPO group: the same
prompt), --turns model calls each at most, --concurrency at once. Every mode's prompts are its own (its
name and the group's number lead the question), so no mode finds another's prompts cached. Per mode,
from each engine's /metrics: prefix-cache queries and hits (tokens; vllm:prefix_cache_queries_total and
_hits_total) and prompt tokens, and the share of the requests each engine took.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
import real_engine  # noqa: E402  (the bench directory is not a package)

bench_run = real_engine.bench_run


MODES = ("session", "prompt", "key")
COUNTERS = ("prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total", "request_success_total")


def metrics(engine_url: str) -> dict[str, float]:
    """The engine's own counters (summed over their labels)."""
    with urllib.request.urlopen(f"{engine_url.removesuffix('/v1')}/metrics", timeout=30) as reply:
        text = reply.read().decode()
    found = {}
    for name in COUNTERS:
        values = re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
        found[name] = sum(map(float, values))
    return found


def write_config(
    directory: Path, engines: list[str], model: str, tokenizer_dir: str, chat_template: str, turns: int
) -> Path:
    models = {
        f"{mode}_model": {
            "base_url": engines,
            "model": model,
            "return_token_ids": True,
            "tokenizer_dir": tokenizer_dir,
            "chat_template": chat_template,
            "route_by": "prompt" if mode == "prompt" else "session",
        }
        for mode in MODES
    }
    agents = {f"{mode}_agent": (f"{mode}_model", turns) for mode in MODES}
    return real_engine.write_stack(
        directory, "prefix_routing", ("weather", "weather/server.py:WeatherEnv"), models, agents
    )


def _passage(words: int, seed: str) -> str:
    """`words` words of text of its own for each seed: a group's long task context."""
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCABULARY) for _ in range(words))


VOCABULARY = (
    "river city morning cloud station north harbour market bridge winter road light tower garden "
    "valley storm coast forest summer island field mountain village rain wind snow evening south"
).split()


def write_tasks(
    directory: Path, mode: str, repeat: int, groups: int, max_output_tokens: int, context_words: int
) -> Path:
    """One row per group: a weather question led by the mode, the repeat and the group's number (no two
    runs share a prompt) and, with context_words, a passage of the group's own; in the key mode each
    row's prompt_cache_key names its group."""
    label = f"{mode} {repeat}"
    file = directory / f"tasks_{mode}_{repeat}.jsonl"
    with file.open("w") as f:
        for group in range(groups):
            row = json.loads(json.dumps(bench_run.WEATHER_ROWS[group % len(bench_run.WEATHER_ROWS)]))
            params = row["responses_create_params"]
            question = params["input"][-1]
            context = f"Notes: {_passage(context_words, f'{label} {group}')}\n" if context_words else ""
            question["content"] = f"[{label}, group {group}] {context}{question['content']}"
            params.update(temperature=1.0, tool_choice="required", parallel_tool_calls=False)
            params["max_output_tokens"] = max_output_tokens
            if mode == "key":
                params["prompt_cache_key"] = f"{label}, group {group}"
            f.write(json.dumps(row) + "\n")
    return file


def cell(stack: Any, mode: str, engines: list[str], tasks: Path, tmp: Path, args: argparse.Namespace) -> dict:
    before = [metrics(url) for url in engines]
    out = tmp / f"{mode}.jsonl"
    run = bench_run.collect(
        stack, f"{mode}_agent", tasks, out, args.concurrency, "--num-repeats", str(args.members), "--timeout", "3600"
    )
    after = [metrics(url) for url in engines]
    delta = [{k: a[k] - b[k] for k in COUNTERS} for a, b in zip(after, before, strict=True)]
    queries = sum(d["prefix_cache_queries_total"] for d in delta)
    hits = sum(d["prefix_cache_hits_total"] for d in delta)
    requests = [d["request_success_total"] for d in delta]
    rows = real_engine.read_jsonl(out)
    return {
        "rollouts": len(rows),
        "failed": run.failed,
        "model_calls": sum(row.get("model_calls", 0) for row in rows),
        "prefix_cache_queries": int(queries),
        "prefix_cache_hits": int(hits),
        "hit_rate": round(hits / queries, 3) if queries else None,
        "prompt_tokens": int(sum(d["prompt_tokens_total"] for d in delta)),
        "requests_by_engine": [int(n) for n in requests],
        "seconds": round(run.seconds, 1),
    }


def markdown(report: dict) -> str:
    lines = real_engine.markdown_head("Prefix-cache friendly routing over two engines", report)
    w = report["workload"]
    lines += [
        "",
        f"{w['groups']} groups of {w['members']} rollouts (the same prompt), at most {w['turns']} model calls each, "
        f"{w['concurrency']} rollouts at once; each group's question led by {w['context_words']} words of its own; "
        f"repeated {w['repeats']} times, modes in turn; medians.",
        "",
        "| mode | prefix-cache hit rate (tokens) | hits / queries (K tokens) | prompt tokens computed (K) "
        "| requests by engine | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in report["summary"].items():
        hits, queries = r["prefix_cache_hits"] / 1000, r["prefix_cache_queries"] / 1000
        lines.append(
            f"| {mode} | {r['hit_rate']:.3f} | {hits:.1f} / {queries:.1f} | {queries - hits:.1f} "
            f"| {r['requests_by_engine']} | {r['seconds']} |"
        )
    lines += ["", *(f"- {note}" for note in report["notes"]), ""]
    return "\n".join(lines)


NOTES = [
    "session: route_by session, the default (a rollout's turns on one engine, its group's other rollouts "
    "wherever their session ids hash); prompt: route_by prompt (the conversation's start picks the engine); "
    "key: each row's prompt_cache_key names its group.",
    "What routing can save: a prompt part a group shares and other groups do not (its own context), computed "
    "once per engine that sees the group. The weather rows share a long system prompt and tools (cached on "
    "every engine whatever the routing) and differ in a short question; and a group's rollouts that start "
    "in the same engine step compute their prompt side by side (vLLM caches blocks once computed), so "
    "routing shows where a group's rollouts follow one another on a long context of their own.",
    "Hits and queries are vLLM's own counters (vllm:prefix_cache_hits_total, _queries_total: prompt tokens "
    "looked up in, and found in, its prefix cache), summed over both engines; queries less hits are the prompt "
    "tokens the engines computed (prefill); requests by engine from "
    "vllm:request_success_total.",
]


def _median_cell(cells: list[dict]) -> dict:
    ordered = sorted(cells, key=lambda c: c["hit_rate"] or 0.0)
    return ordered[len(ordered) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=8, help="GRPO groups (rows) per mode")
    parser.add_argument("--members", type=int, default=4, help="rollouts per group (--num-repeats)")
    parser.add_argument("--turns", type=int, default=3, help="most model calls per rollout")
    parser.add_argument("--concurrency", type=int, default=8, help="rollouts in flight")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every mode; the median is reported")
    parser.add_argument("--max-output-tokens", type=int, default=48)
    parser.add_argument(
        "--context-words", type=int, default=0, help="a passage of each group's own before its question"
    )
    parser.add_argument("--engine-urls", help="reuse two running engines: their /v1 URLs, comma-separated")
    parser.add_argument("--engine-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--smoke", action="store_true", help="2 groups, 1 repeat; results in a temp dir")
    parser.add_argument("--name", default="prefix_routing", help="results file name")
    args = parser.parse_args()
    bench_run.stop_on_termination()
    if args.smoke:
        args.groups, args.repeats = 2, 1
    from gym_grpc.engines import local_vllm

    load_start = [round(x, 2) for x in __import__("os").getloadavg()]
    prepared = local_vllm.prepare()
    machine = real_engine.versions(prepared)
    started = []
    if args.engine_urls:
        engines, model = args.engine_urls.split(","), args.engine_model
    else:
        print("starting two local vLLMs ...", file=sys.stderr)
        started = [local_vllm.start(prepared, tied=True) for _ in range(2)]
        engines, model = [e.base_url for e in started], started[0].model
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    try:
        with tempfile.TemporaryDirectory() as directory:
            tmp = Path(directory)
            config = write_config(
                tmp, engines, model, str(prepared.model_dir), str(local_vllm.CHAT_TEMPLATE), args.turns
            )
            stack = bench_run.Stack(config)
            try:
                for repeat in range(args.repeats):
                    for mode in MODES if repeat % 2 == 0 else reversed(MODES):
                        tasks = write_tasks(tmp, mode, repeat, args.groups, args.max_output_tokens, args.context_words)
                        print(f"repeat {repeat + 1}, {mode} ...", file=sys.stderr)
                        result = cell(stack, mode, engines, tasks, tmp, args)
                        runs[mode].append(result)
                        print(json.dumps(result), file=sys.stderr)
            finally:
                stack.stop()
    finally:
        for engine in started:
            local_vllm.stop(engine.pid)
    report = {
        **real_engine.report_head("bench/prefix_routing.py", args, machine, load_start),
        "workload": {
            "environment": "weather",
            "groups": args.groups,
            "members": args.members,
            "turns": args.turns,
            "concurrency": args.concurrency,
            "repeats": args.repeats,
            "max_output_tokens": args.max_output_tokens,
            "context_words": args.context_words,
            "temperature": 1.0,
            "tool_choice": "required",
        },
        "notes": NOTES,
        "summary": {mode: _median_cell(cells) for mode, cells in runs.items()},
        "runs": runs,
    }
    real_engine.save(report, markdown(report), args.smoke)


if __name__ == "__main__":
    main()
