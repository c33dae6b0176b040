"""`gym-grpc collect`: a JSONL of tasks in, a JSONL of scored rollouts out.

Each task row is run `num_repeats` times through an agent; at most
`max_in_flight` rollouts run at once. Every finished rollout is appended to
the output as soon as it finishes, as the task row plus `response`, `reward`,
the verifier's fields, `stop_reason`, `model_calls` and its key
(`task_index`, `repeat_index`). Keys already in the output are skipped, so
running the same command again resumes. A row that cannot be loaded or a
rollout that fails is reported with its line or key and the rest goes on.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tqdm import tqdm

from gym_grpc import errors, rows
from gym_grpc.clients import AgentClient
from gym_grpc.metrics import Means
from gym_grpc.registry import Registry
from gym_grpc.v1 import task_pb2

STOP_REASONS = {
    task_pb2.STOP_REASON_FINAL_MESSAGE: "final_message",
    task_pb2.STOP_REASON_MAX_STEPS: "max_steps",
    task_pb2.STOP_REASON_INCOMPLETE: "incomplete",
}


@dataclass
class CollectOptions:
    """What to collect and how."""

    input: Path
    output: Path
    #: Agent for rows that have no `agent_ref`.
    agent: str | None = None
    #: Use only the first `limit` task rows.
    limit: int | None = None
    num_repeats: int = 1
    max_in_flight: int = 1024
    #: Seconds one rollout may take before it fails.
    timeout: float = 3600.0
    progress: bool = True


@dataclass
class CollectSummary:
    """What a collection did."""

    collected: int = 0
    skipped: int = 0
    failed: int = 0
    bad_rows: int = 0
    seconds: float = 0.0
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Job:
    task_index: int
    row: dict[str, Any]
    task: task_pb2.Task
    agent: str


def _tasks(path: Path, limit: int | None, default_agent: str | None) -> Iterator[_Job | str]:
    """The task rows of a JSONL file; a row that cannot be used yields a message naming its line."""
    task_index = -1
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            task_index += 1
            if limit is not None and task_index >= limit:
                return
            try:
                row = json.loads(line)
                task = rows.task_from_row(row)
            except json.JSONDecodeError as e:
                yield f"{path}:{line_no}: not JSON: {e}"
                continue
            except rows.RowError as e:
                yield f"{path}:{line_no}: {e}"
                continue
            agent_ref = row.get("agent_ref")
            agent = (agent_ref.get("name") if isinstance(agent_ref, dict) else None) or default_agent
            if not agent:
                yield f"{path}:{line_no}: the row has no agent_ref.name and no --agent was given"
                continue
            yield _Job(task_index, row, task, agent)


def _count_rows(path: Path, limit: int | None) -> int:
    with path.open("rb") as f:
        count = sum(1 for line in f if line.strip())
    return count if limit is None else min(count, limit)


def _finished_keys(path: Path) -> set[tuple[int, int]]:
    """Keys of the rollouts already in an output file. A torn last line (a
    collector killed mid-write) is cut off so that appending stays valid JSONL."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        with path.open("r+b") as f:
            f.truncate(cut)
        data = data[:cut]
    keys = set()
    for line in data.splitlines():
        try:
            row = json.loads(line)
            keys.add((int(row["task_index"]), int(row["repeat_index"])))
        except (ValueError, KeyError, TypeError):
            continue
    return keys


async def collect(registry: Registry, options: CollectOptions, *, log: TextIO = sys.stderr) -> CollectSummary:
    """Collect rollouts as `options` says; return what was done."""
    if options.num_repeats < 1:
        raise ValueError("num_repeats must be at least 1")
    if options.max_in_flight < 1:
        raise ValueError("max_in_flight must be at least 1")
    started = time.monotonic()
    summary = CollectSummary()
    done = _finished_keys(options.output)
    total = _count_rows(options.input, options.limit) * options.num_repeats
    means: dict[str, Means] = {}
    clients: dict[str, AgentClient] = {}
    window = asyncio.Semaphore(options.max_in_flight)
    running: set[asyncio.Task] = set()
    options.output.parent.mkdir(parents=True, exist_ok=True)
    bar = tqdm(total=total, unit="rollout", disable=not options.progress, file=log, dynamic_ncols=True)

    def report(message: str) -> None:
        if options.progress:
            bar.write(message, file=log)
        else:
            print(message, file=log)

    async def run_one(job: _Job, repeat: int, out: TextIO) -> None:
        try:
            client = clients.get(job.agent)
            if client is None:
                client = clients[job.agent] = AgentClient(registry, job.agent)
            rollout = await client.run(job.task, timeout=options.timeout)
            row = rows.rollout_row(job.row, rollout)
            row["stop_reason"] = STOP_REASONS.get(rollout.stop_reason, "unspecified")
            row["model_calls"] = rollout.model_calls
            row["task_index"] = job.task_index
            row["repeat_index"] = repeat
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            out.flush()
        except errors.GymError as e:
            summary.failed += 1
            report(f"task {job.task_index} repeat {repeat} failed: {e.message}")
            return
        except Exception as e:  # a surprise costs this rollout, not the collection
            summary.failed += 1
            report(f"task {job.task_index} repeat {repeat} failed: {type(e).__name__}: {e}")
            return
        finally:
            bar.update(1)
            window.release()
        summary.collected += 1
        agent_means = means.setdefault(job.agent, Means())
        # Averaged: what the rollout produced, not the task's own fields.
        produced = {"reward": rollout.reward, **rows.struct_to_dict(rollout.verifier_fields)}
        agent_means.add({**produced, "model_calls": rollout.model_calls})
        bar.set_postfix(reward=f"{agent_means.mean('reward'):.3f}", refresh=False)

    with options.output.open("a", encoding="utf-8") as out:
        for job in _tasks(options.input, options.limit, options.agent):
            if isinstance(job, str):
                summary.bad_rows += 1
                bar.update(options.num_repeats)
                report(job)
                continue
            for repeat in range(options.num_repeats):
                if (job.task_index, repeat) in done:
                    summary.skipped += 1
                    bar.update(1)
                    continue
                await window.acquire()
                task = asyncio.create_task(run_one(job, repeat, out))
                running.add(task)
                task.add_done_callback(running.discard)
        if running:
            await asyncio.gather(*running)
    bar.close()
    summary.seconds = time.monotonic() - started
    summary.metrics = {agent: {"rollouts": m.count, **m.means()} for agent, m in sorted(means.items())}
    if summary.skipped:
        report(f"resumed: {summary.skipped} rollouts were already in {options.output}")
    return summary
