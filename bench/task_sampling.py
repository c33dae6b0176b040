"""What a batch with signal costs, by sampler: `python bench/run.py --only task_sampling`.

The task set mixes tasks the policy always solves, never solves and sometimes solves, as a training
set does once a model has learned part of it: the real math environment (math-verify) and the
embedded policy (error_rate 0.3), with a third of the tasks at temperature 0 (never a slip: always
solved), a third whose expected answer is wrong (never solved), and a third at temperature 1 (solved
30-70% of the time). A GRPO group carries signal when its rewards differ.

Three samplers, each through a real task server (gym_grpc/tasks) in front of real agent, model and
environment servers on loopback, asked for the same `batches` batches of `groups` groups of
`group_size`, with each of `seeds` seeds:

- plain: tasks drawn uniformly, every group served (no pools, no dynamic sampling);
- dynamic: a group whose rewards are all equal is dropped and another task drawn (DAPO's dynamic
  sampling), no pools;
- dynamic + pools: the same, and tasks move to the easy or hard pool by their recent pass rate,
  which get 5% of the draws each (the task server's defaults).

For each: rollouts run per group with signal (the cost of a useful group; `group_size` at best),
over all the batches and over their last half (once the pools have learned which tasks carry no
signal), the share of served groups with signal, groups served per group asked, and the cost per
batch in order. Medians over the seeds.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.resources.math.server import MathEnv
from gym_grpc.client.stubs import TaskClient
from gym_grpc.tasks import TaskServer
from gym_grpc.testing.servers import Servers, static_registry

SAMPLERS: dict[str, dict[str, Any]] = {
    "plain": {"pools": None, "dynamic_sampling": False},
    "dynamic": {"pools": None, "dynamic_sampling": True},
    "dynamic_pools": {"dynamic_sampling": True},
}


def task_rows(per_kind: int) -> list[dict]:
    """`per_kind` tasks of each kind: always solved, never solved, sometimes solved."""
    rows = []
    for i in range(per_kind):
        a, b = 11 + 7 * i, 5 + 3 * i
        question = f"What is {a} + {b}? Put the final answer in \\boxed{{}}."
        rows.append({"responses_create_params": {"input": question, "temperature": 0}, "expected_answer": str(a + b)})
        rows.append({"responses_create_params": {"input": question, "temperature": 0}, "expected_answer": str(-a - b)})
        question = f"Compute {a} * 3 + {b} - 7. Put the final answer in \\boxed{{}}."
        rows.append(
            {"responses_create_params": {"input": question, "temperature": 1.0}, "expected_answer": str(a * 3 + b - 7)}
        )
    return rows


async def _run(tasks: Path, sampler: dict, seed: int, batches: int, groups: int, group_size: int) -> dict:
    async with Servers() as servers:
        model = await servers.start(LocalPolicyModel({"error_rate": 0.3, "seed": seed}))
        env = await servers.start(MathEnv())
        agent = await servers.start(
            SimpleAgent(
                {"model_server": "model", "resources_server": "math", "max_steps": 2},
                name="math_agent",
                registry=static_registry(model=model, math=env),
            )
        )
        config = {
            "agent": "math_agent",
            "datasets": [{"name": "mixed", "jsonl_fpath": str(tasks)}],
            "group_size": group_size,
            "seed": seed,
            **sampler,
        }
        server = await servers.start(TaskServer(config, name="tasks", registry=static_registry(math_agent=agent)))
        registry = static_registry(tasks=server)
        client = TaskClient(registry, "tasks")
        per_batch = []
        began = time.monotonic()
        for _ in range(batches):
            signal = served = 0
            async for reply in client.next_batch(groups):
                if reply.HasField("group"):
                    served += 1
                    signal += reply.group.has_signal
                else:
                    s = reply.summary
                    per_batch.append(
                        {"served": served, "with_signal": signal, "rollouts": s.rollouts, "tried": s.groups_tried}
                    )
        seconds = time.monotonic() - began
        await registry.close()
    rollouts = sum(b["rollouts"] for b in per_batch)
    useful = sum(b["with_signal"] for b in per_batch)
    late = per_batch[len(per_batch) // 2 :]
    late_useful = sum(b["with_signal"] for b in late)
    served_total = sum(b["served"] for b in per_batch)
    return {
        "seed": seed,
        "rollouts": rollouts,
        "groups_served": served_total,
        "groups_with_signal": useful,
        "rollouts_per_useful_group": round(rollouts / useful, 2) if useful else None,
        "late_rollouts_per_useful_group": (
            round(sum(b["rollouts"] for b in late) / late_useful, 2) if late_useful else None
        ),
        "share_with_signal": round(useful / served_total, 3) if served_total else None,
        "batch_fill": round(served_total / (batches * groups), 3),
        "seconds": round(seconds, 2),
        "per_batch_rollouts_per_useful_group": [
            round(b["rollouts"] / b["with_signal"], 1) if b["with_signal"] else None for b in per_batch
        ],
    }


def _median(runs: list[dict], key: str) -> float | None:
    values = [run[key] for run in runs if run[key] is not None]
    return round(statistics.median(values), 3) if values else None


def bench_task_sampling(smoke: bool) -> dict:
    per_kind, batches, groups, group_size, seeds = (4, 2, 4, 4, [1]) if smoke else (20, 10, 8, 8, [1, 2, 3])
    with tempfile.TemporaryDirectory() as directory:
        tasks = Path(directory) / "tasks.jsonl"
        tasks.write_text("".join(json.dumps(row) + "\n" for row in task_rows(per_kind)))
        samplers = {}
        for name, sampler in SAMPLERS.items():
            runs = []
            for seed in seeds:
                print(f"task_sampling: {name}, seed {seed} ...", file=sys.stderr)
                runs.append(asyncio.run(_run(tasks, sampler, seed, batches, groups, group_size)))
            samplers[name] = {
                "config": sampler,
                "rollouts_per_useful_group_median": _median(runs, "rollouts_per_useful_group"),
                "late_rollouts_per_useful_group_median": _median(runs, "late_rollouts_per_useful_group"),
                "share_with_signal_median": _median(runs, "share_with_signal"),
                "batch_fill_median": _median(runs, "batch_fill"),
                "runs": runs,
            }
    plain = samplers["plain"]["rollouts_per_useful_group_median"]
    for result in samplers.values():
        cost = result["rollouts_per_useful_group_median"]
        result["cost_vs_plain"] = round(cost / plain, 3) if cost and plain else None
    return {
        "tasks": {"always": per_kind, "never": per_kind, "sometimes": per_kind},
        "batches": batches,
        "groups_per_batch": groups,
        "group_size": group_size,
        "seeds": seeds,
        "samplers": samplers,
    }


def table(result: dict) -> str:
    lines = [
        "| sampler | rollouts per group with signal | vs plain | in the last half of the batches "
        "| served groups with signal | groups served / asked |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in result["samplers"].items():
        lines.append(
            f"| {name} | {s['rollouts_per_useful_group_median']} | {s['cost_vs_plain']} | "
            f"{s['late_rollouts_per_useful_group_median']} | {s['share_with_signal_median']} | "
            f"{s['batch_fill_median']} |"
        )
    return "\n".join(lines)
