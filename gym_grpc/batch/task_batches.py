"""`gym-grpc collect --task-server NAME`: rollouts of the groups a task server serves.

Instead of the tasks of a file, `batches` NextBatch calls of `groups` groups each; every finished
member becomes a rollout row as `collect` writes it, keyed by the group's number in the output (so
that `samples` and `report` take each served group as one group, even when a task was served
twice) and with `served_from` saying where the task came from. A member that failed goes to the
failures sidecar. The output is appended to; there is nothing to resume, since the draws are the
server's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from gym_grpc.client.stubs import TaskClient
from gym_grpc.client.training import task_group
from gym_grpc.data import jsonl, record
from gym_grpc.rpc.registry import Registry
from gym_grpc.tasks.server import add_summary
from gym_grpc.v1 import task_service_pb2 as tasks_pb

#: The field of a row that says which task server, dataset, task, batch and pool it came from.
SERVED_FROM = "served_from"


@dataclass
class TaskBatchOptions:
    task_server: str
    output: Path
    batches: int
    groups: int
    #: Rollouts per group; 0: the server's default.
    group_size: int = 0
    #: Seconds one rollout may take.
    timeout: float = 600.0
    policy_version: int | None = None


@dataclass
class TaskBatchTotals:
    """What every batch cost together (BatchSummary's fields, summed) and what was written."""

    summary: tasks_pb.BatchSummary = field(default_factory=tasks_pb.BatchSummary)
    rows: int = 0
    failed: int = 0
    seconds: float = 0.0
    short: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        s = self.summary
        per_group = s.rollouts / s.groups if s.groups else float("nan")
        return [
            f"{s.groups:,} groups served of {s.groups_tried:,} tried ({s.groups_without_signal:,} had one reward "
            f"for all, {s.groups_failed:,} too few finished rollouts); {s.rollouts:,} rollouts run, "
            f"{per_group:.1f} per group served",
            f"{self.rows:,} rollout rows written, {self.failed:,} failed rollouts in the failures file, "
            f"in {self.seconds:.2f} s",
        ]


async def collect_batches(registry: Registry, options: TaskBatchOptions, log: TextIO) -> TaskBatchTotals:
    """Ask for the batches, write their rows, say a line per batch on `log`. Raises errors.OutputInUse
    when another run is writing the same output (its group numbers would be this run's too)."""
    with jsonl.held(options.output):
        return await _collect_batches(registry, options, log)


async def _collect_batches(registry: Registry, options: TaskBatchOptions, log: TextIO) -> TaskBatchTotals:
    client = TaskClient(registry, options.task_server)
    totals = TaskBatchTotals()
    began = time.monotonic()
    group_number = _groups_in(options.output)
    out = jsonl.Appender(options.output)
    failures = jsonl.Appender(jsonl.failures_path(options.output))
    try:
        for number in range(options.batches):
            s = tasks_pb.BatchSummary()
            async for reply in client.next_batch(
                options.groups,
                options.group_size,
                policy_version=options.policy_version,
                rollout_timeout=options.timeout,
            ):
                if not reply.HasField("group"):
                    s = reply.summary
                    continue
                group = task_group(reply.group)
                served: dict[str, Any] = {
                    "task_server": options.task_server,
                    "dataset": group.dataset,
                    "task_index": group.task_index,
                    "batch": number,
                    "pool": group.pool,
                }
                for repeat, result in enumerate(group.results):
                    if result.ok:
                        row = result.to_row(group.task_row)
                        record.set_key(row, group_number, repeat)
                        row[SERVED_FROM] = served
                        out.append(row)
                        totals.rows += 1
                    else:
                        assert result.failure is not None
                        failures.append(
                            {"task_index": group_number, "repeat_index": repeat, SERVED_FROM: served}
                            | {"error": result.failure.to_json()}
                        )
                        totals.failed += 1
                group_number += 1
            add_summary(totals.summary, s)
            log.write(
                f"batch {number + 1}/{options.batches}: {s.groups} groups of {s.groups_tried} tried "
                f"({s.groups_without_signal} without signal, {s.groups_failed} failed), {s.rollouts} rollouts, "
                f"{s.seconds:.2f} s\n"
            )
            if s.short_reason:
                totals.short.append(f"batch {number + 1}: {s.groups} of {options.groups} groups: {s.short_reason}")
    finally:
        out.close()
        failures.close()
    totals.seconds = time.monotonic() - began
    return totals


def _groups_in(output: Path) -> int:
    """The next group number of an output appended to: one past the highest key in it."""
    highest = -1
    for path in (output, jsonl.failures_path(output)):
        for row in jsonl.iter_rows(path):
            task = record.rollout_key(row)[1]
            if task is not None:
                highest = max(highest, task)
    return highest + 1
