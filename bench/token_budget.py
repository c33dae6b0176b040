"""What a trajectory token budget (the tool loop's max_rollout_tokens) saves on rollouts that run long.

    python bench/token_budget.py                                  # the fake engine: seconds
    python bench/token_budget.py --engine-url http://HOST:PORT/v1 # a running vLLM (the local CPU one)

A trainer cuts a multi-turn sample at a total response length (verl/SkyRL's max_response_length:
every token after the prompt, generated and tool outputs) and throws away what comes after; a
rollout service that goes on generating past it spends engine time on tokens nobody trains on
(miles#2587: 22.7% of one run's wall-clock). This bench collects the same tasks with the same
agent twice on one stack, without a budget and with `max_rollout_tokens` set to that length, in
alternating rounds, and gives per arm: model calls, generated tokens (the engine's usage), the
rollouts per stop reason, the collector's wall time. For the arm without a budget it also counts
the generated tokens a trainer cutting at the budget would throw away: of each rollout, those
generated after its trajectory (prompt ids + generation ids of a turn, less the first prompt)
passed the budget.

The workload is servers/resources/multi_step (the refund tasks) behind vllm_model's token path
(return_token_ids) with tool_choice "required": every turn calls a tool, so a rollout runs to
max_steps unless a turn is cut. On the fake engine each turn writes 40-160 tokens of text and a
tool call; on a real engine the model samples at temperature 1.0 with max_output_tokens per turn.
The servers run in this process (gym_grpc.testing.Servers) and the collector is gym_grpc's own
`collect`: this measures tokens and calls, which do not depend on the process layout; its wall
times on the fake engine are not an engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gym_grpc.agent import ToolLoopAgent  # noqa: E402
from gym_grpc.batch.collector import CollectOptions, collect  # noqa: E402
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel  # noqa: E402
from gym_grpc.bundled.servers.resources.multi_step.server import CustomerSupportEnv  # noqa: E402
from gym_grpc.testing import static_registry  # noqa: E402
from gym_grpc.testing.fake_engine import FakeEngine, Turn  # noqa: E402
from gym_grpc.testing.servers import Servers  # noqa: E402

TASK_ROWS = [json.loads(line) for line in (REPO / "servers/resources/multi_step/data/example.jsonl").open()]


def fake_turn(body: dict) -> Turn:
    """The fake engine's model: a text of 40-160 tokens (it varies with the conversation's length) and a
    find_user call, every turn."""
    length = len(body["prompt"]) if "prompt" in body else len(json.dumps(body.get("messages")))
    return Turn(
        content="Let me look that up for you. " * (1 + length % 4), tool_calls=[("find_user", '{"email": "a"}')]
    )


def write_tasks(path: Path, count: int, max_output_tokens: int | None, temperature: float) -> Path:
    with path.open("w") as f:
        for i in range(count):
            row = json.loads(json.dumps(TASK_ROWS[i % len(TASK_ROWS)]))
            params = row["responses_create_params"]
            params.update(temperature=temperature, tool_choice="required", parallel_tool_calls=False)
            if max_output_tokens is not None:
                params["max_output_tokens"] = max_output_tokens
            f.write(json.dumps(row) + "\n")
    return path


def turns(row: dict) -> list[tuple[int, int]]:
    """(prompt ids, generation ids) counts of each turn of a row, from the items that carry them."""
    out = []
    for item in row["response"]["output"]:
        if item.get("generation_token_ids"):
            out.append((len(item.get("prompt_token_ids", [])), len(item["generation_token_ids"])))
    return out


def past_budget(row: dict, budget: int) -> int:
    """Generated tokens of a row that a trainer cutting its trajectory at `budget` tokens throws away."""
    spent = turns(row)
    if not spent:
        return 0
    first_prompt, wasted = spent[0][0], 0
    for prompt, generated in spent:
        start = prompt - first_prompt  # where this turn's generation begins in the trajectory
        wasted += max(0, min(generated, start + generated - budget))
    return wasted


def arm_figures(rows: list[dict], seconds: float, budget: int) -> dict[str, Any]:
    generated = sum(row["response"]["usage"]["output_tokens"] for row in rows)
    return {
        "rollouts": len(rows),
        "model_calls": sum(row["model_calls"] for row in rows),
        "generated_tokens": generated,
        "generated_tokens_past_the_budget": sum(past_budget(row, budget) for row in rows),
        "stop_reasons": dict(Counter(row["stop_reason"] for row in rows)),
        "reward_mean": sum(row["reward"] for row in rows) / len(rows),
        "collect_seconds": round(seconds, 3),
    }


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    async with Servers() as servers:
        fake = None
        if args.engine_url:
            url, model_name = args.engine_url, args.engine_model
        else:
            fake = FakeEngine(fake_turn)
            url, model_name = await fake.start(), "fake"
        try:
            model = await servers.start(
                VLLMModel(
                    {"base_url": url, "model": model_name, "return_token_ids": True, "read_timeout": 600}, name="model"
                )
            )
            env = await servers.start(CustomerSupportEnv(name="env"))
            agents = {}
            for arm, budget in (("no_budget", None), ("budget", args.budget)):
                config = {"model_server": "model", "resources_server": "env", "max_steps": args.max_steps}
                if budget is not None:
                    config["max_rollout_tokens"] = budget
                agent = ToolLoopAgent(config, name="agent", registry=static_registry(model=model, env=env))
                agents[arm] = await servers.start(agent)
            tasks = write_tasks(tmp / "tasks.jsonl", args.rollouts, args.max_output_tokens, args.temperature)
            rows: dict[str, list[dict]] = {arm: [] for arm in agents}
            seconds = dict.fromkeys(agents, 0.0)
            for round_ in range(args.rounds):
                for arm in list(agents) if round_ % 2 == 0 else list(agents)[::-1]:
                    out = tmp / f"{arm}-{round_}.jsonl"
                    options = CollectOptions(
                        input=tasks, output=out, agent="agent", max_in_flight=args.concurrency, progress=False
                    )
                    registry = static_registry(agent=agents[arm])
                    began = time.monotonic()
                    summary = await collect(registry, options, log=io.StringIO())
                    seconds[arm] += time.monotonic() - began
                    await registry.close()
                    if summary.failed:
                        raise SystemExit(f"{arm}: {summary.failed} rollouts failed")
                    rows[arm] += [json.loads(line) for line in out.read_text().splitlines()]
        finally:
            if fake is not None:
                await fake.stop()
    return {arm: arm_figures(rows[arm], seconds[arm], args.budget) for arm in rows}


def markdown(report: dict[str, Any]) -> str:
    a, b = report["arms"]["no_budget"], report["arms"]["budget"]
    lines = [
        f"# Trajectory token budget: {report['name']}",
        "",
        f"`{report['command']}`",
        "",
        f"{report['when']}; {report['machine']}; gym-grpc {report['commit']}; engine: {report['engine']}.",
        "",
        f"Workload: {report['workload']}",
        "",
        "| | no budget | max_rollout_tokens | saved |",
        "|---|---|---|---|",
    ]
    for key, label in (
        ("model_calls", "model calls"),
        ("generated_tokens", "generated tokens"),
        ("generated_tokens_past_the_budget", "generated tokens past the budget (thrown away by a trainer)"),
        ("collect_seconds", "collect wall seconds"),
    ):
        saved = 1 - b[key] / a[key] if a[key] else 0.0
        lines.append(f"| {label} | {a[key]:,} | {b[key]:,} | {saved:.1%} |")
    lines.append(f"| reward mean | {a['reward_mean']:.3f} | {b['reward_mean']:.3f} | |")
    lines.append(f"| stop reasons | {a['stop_reasons']} | {b['stop_reasons']} | |")
    share = a["generated_tokens_past_the_budget"] / a["generated_tokens"] if a["generated_tokens"] else 0.0
    lines += ["", f"Without a budget, {share:.1%} of the generated tokens came after the trajectory passed the budget."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=100, help="rollouts per arm and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, the arms alternating first")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--budget", type=int, default=512, help="max_rollout_tokens (a trainer's response length)")
    parser.add_argument("--max-output-tokens", type=int, default=None, help="each row's own limit per turn")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--engine-url", help="a running OpenAI-compatible vLLM (/v1 URL); default: the fake engine")
    parser.add_argument("--engine-model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--name", default="token_budget", help="results file name under bench/results")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        arms = asyncio.run(run(args, Path(tmp)))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    report = {
        "name": args.name,
        "command": "python bench/token_budget.py " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}, "
        f"load average {[round(x, 2) for x in os.getloadavg()]} at the end",
        "commit": commit.stdout.strip(),
        "engine": args.engine_url and f"vLLM at {args.engine_url} ({args.engine_model})" or "the fake engine",
        "workload": f"multi_step refund tasks, {args.rollouts} rollouts x {args.rounds} rounds per arm, "
        f"{args.concurrency} in flight, tool_choice required, temperature {args.temperature}, "
        f"max_steps {args.max_steps}, max_output_tokens per turn {args.max_output_tokens}, budget {args.budget}",
        "arms": arms,
    }
    out = REPO / "bench" / "results" / args.name
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
