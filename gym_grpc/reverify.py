"""`gym-grpc reverify`: score rollouts again without paying for inference again.

Every row of a rollout file (from `collect`, verified or `--skip-verify`) is
sent, task and response, to its resources server's Verify (the one its agent
uses, or `--resources`), and the re-scored row is written: the same row with
the new reward and verifier fields. Same window, progress bar, failures
sidecar, exact resume and summary as `collect`; rows keep their keys. When
the input already had rewards, the summary says how many changed.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gym_grpc import errors, jsonl, rows
from gym_grpc.batch import BadInput, Batch, BatchOptions, BatchSummary, Job
from gym_grpc.clients import ResourcesClient
from gym_grpc.registry import Registry
from gym_grpc.summary import task_fields
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2


@dataclass
class ReverifyOptions:
    input: Path
    output: Path
    #: Agent for rows without an agent_ref; its resources server verifies.
    agent: str | None = None
    #: The resources server that verifies every row (instead of the agents' own).
    resources: str | None = None
    max_in_flight: int = 4096
    #: Seconds one verification may take.
    timeout: float = 600.0
    reward_range: tuple[float, float] = (0.0, 1.0)
    pass_threshold: float = 1.0
    progress: bool = True


@dataclass
class RewardChanges:
    """Old rewards against new ones, over the rows that had a verified reward."""

    compared: int = 0
    changed: int = 0
    before: float = 0.0
    after: float = 0.0

    def line(self) -> str:
        if not self.compared:
            return "no row had a verified reward before"
        return (
            f"{self.changed} of {self.compared} rewards changed; mean before {self.before / self.compared:.4f}, "
            f"after {self.after / self.compared:.4f}"
        )


@dataclass(frozen=True)
class _Rollout:
    row: dict[str, Any]
    task: task_pb2.Task
    response: r.Response


def _scan(path: Path) -> tuple[int, int]:
    """(number of task slots, repeats) that the keys of a rollout file need."""
    n_tasks, repeats, lines = 0, 1, 0
    with path.open("rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            lines += 1
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            t, k = (row.get("task_index"), row.get("repeat_index")) if isinstance(row, dict) else (None, None)
            if isinstance(t, int) and isinstance(k, int) and t >= 0 and k >= 0:
                n_tasks, repeats = max(n_tasks, t + 1), max(repeats, k + 1)
    return max(n_tasks, lines), repeats


def _jobs(options: ReverifyOptions) -> Iterator[Job | BadInput]:
    """One job per rollout row, keyed as it was (or by its line when it has no key)."""
    index = -1
    with options.input.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            index += 1
            try:
                row = jsonl.loads(raw.decode("utf-8"))
                if not isinstance(row, dict) or not isinstance(row.get("response"), dict):
                    raise rows.RowError("response", "is required: this is not a rollout row")
                response = rows.response_from_json(row["response"])
                task = rows.task_from_row(task_fields(row))
                agent_ref = row.get("agent_ref")
                group = (agent_ref.get("name") if isinstance(agent_ref, dict) else None) or options.agent
                group = group or options.resources
                if not group:
                    raise rows.RowError("agent_ref.name", "the row names no agent; give --agent or --resources")
            except (UnicodeDecodeError, ValueError) as e:
                yield BadInput(index, line_no, str(e), getattr(e, "field", None))
                continue
            t, k = row.get("task_index"), row.get("repeat_index")
            if not (isinstance(t, int) and isinstance(k, int) and t >= 0 and k >= 0):
                t, k = index, 0
            yield Job(t, k, group, _Rollout(row, task, response))


async def reverify(
    registry: Registry, options: ReverifyOptions, *, log: TextIO = sys.stderr
) -> tuple[BatchSummary, RewardChanges]:
    """Re-score the rollouts of `options.input` into `options.output`."""
    changes = RewardChanges()
    verifiers: dict[str, ResourcesClient] = {}

    async def verifier(group: str) -> ResourcesClient:
        if group not in verifiers:
            name = options.resources
            if name is None:
                info = await registry.info(group)
                name = info.references.get("resources")
                if not name:
                    raise errors.FailedPrecondition(f"agent {group!r} names no resources server; give --resources")
            verifiers[group] = ResourcesClient(registry, name, timeout=options.timeout)
        return verifiers[group]

    async def produce(job: Job) -> dict[str, Any]:
        rollout: _Rollout = job.payload
        began = time.monotonic()
        verdict = await (await verifier(job.group)).verify(uuid.uuid4().hex, rollout.task, rollout.response)
        seconds = time.monotonic() - began
        fields = rows.struct_to_dict(verdict.fields)
        row = {**task_fields(rollout.row), "response": rollout.row["response"], "reward": verdict.reward, **fields}
        row["verifier_fields"] = sorted(fields)
        if verdict.reward_components:
            row["reward_components"] = dict(verdict.reward_components)
        for key in ("stop_reason", "model_calls"):
            if key in rollout.row:
                row[key] = rollout.row[key]
        row["timings"] = {**(rollout.row.get("timings") or {}), "verify": seconds}
        old = rollout.row.get("reward")
        if isinstance(old, int | float) and not rollout.row.get("verification_skipped"):
            changes.compared += 1
            changes.changed += old != verdict.reward
            changes.before += old
            changes.after += verdict.reward
        return row

    n_tasks, repeats = _scan(options.input)
    batch = Batch(
        BatchOptions(
            output=options.output,
            n_tasks=n_tasks,
            repeats=repeats,
            max_in_flight=options.max_in_flight,
            reward_range=options.reward_range,
            pass_threshold=options.pass_threshold,
            progress=options.progress,
            input_name=str(options.input),
        ),
        log,
    )
    return await batch.run(_jobs(options), produce), changes
