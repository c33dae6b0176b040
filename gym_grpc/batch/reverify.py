"""`gym-grpc reverify`: score rollouts again without paying for inference again.

Every row of a rollout file (from `collect`, verified or `--skip-verify`) is
sent, task and response, to its resources server's Verify (the one its agent
uses, or `--resources`), and the re-scored row is written: the same row with
the new reward and verifier fields. Same window, progress bar, failures
sidecar, exact resume and summary as `collect`; rows keep their keys. When
the input already had rewards, the summary says how many changed.
"""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from gym_grpc import errors
from gym_grpc.batch.jobs import BadInput, Batch, BatchSummary, Job, RunOptions
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import jsonl, record, rows
from gym_grpc.data.rollout_stats import verified_reward
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2


@dataclass
class ReverifyOptions(RunOptions):
    """What to re-score and how; a row without an agent_ref is verified by `agent`'s resources server."""

    #: The resources server that verifies every row (instead of the agents' own).
    resources: str | None = None


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


#: How far keys may reach past a file's row count: a slice of a larger run (NeMo Gym
#: keeps the whole run's task indices) holds high indices, a hand-edited key must
#: not size the slot tables.
TASK_SLACK, REPEAT_SLACK = 1 << 16, 1 << 6


def _key(row: Any, lines: int) -> tuple[int, int] | None:
    """A row's key (ours or NeMo Gym's, see jsonl) when it has one a file of `lines` rows can hold."""
    t, k = record.row_key(row) if isinstance(row, dict) else (None, None)
    if isinstance(t, int) and isinstance(k, int) and 0 <= t < lines + TASK_SLACK and 0 <= k < lines + REPEAT_SLACK:
        return t, k
    return None


@dataclass(frozen=True)
class _Layout:
    """How the rows of a rollout file map onto key slots."""

    lines: int
    #: Task slots taken by the rows' own keys; a row without one gets the next slot after them.
    keyed_tasks: int
    repeats: int
    keyless: int

    @property
    def n_tasks(self) -> int:
        return self.keyed_tasks + self.keyless


def _scan(path: Path) -> _Layout:
    lines, keyed_tasks, repeats = 0, 0, 1
    keys = []
    with path.open("rb") as f:
        for raw in f:
            if raw.strip():
                lines += 1
                try:
                    keys.append(jsonl.parse_line(raw))  # what _jobs will accept, so the slots agree
                except ValueError:
                    keys.append(None)
    keyless = 0
    for row in keys:
        key = _key(row, lines)
        if key is None:
            keyless += 1
        else:
            keyed_tasks, repeats = max(keyed_tasks, key[0] + 1), max(repeats, key[1] + 1)
    return _Layout(lines, keyed_tasks, repeats, keyless)


def _jobs(options: ReverifyOptions, layout: _Layout) -> Iterator[Job[_Rollout] | BadInput]:
    """One job per rollout row, keyed as it was; a row without a key gets a slot after the keyed ones."""
    index, keyless = -1, 0
    fallback = options.agent or options.resources
    with options.input.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            index += 1
            key = None
            try:
                row = jsonl.parse_line(raw)
                _, task, response = record.parse(row)
                key = _key(row, layout.lines)
                names = record.key_names(row)
                if key is None and names:
                    raise rows.RowError(names[0], "the key is not two non-negative integers within the file's rows")
                group = rows.agent_name(row, fallback, "; give --agent or --resources")
            except ValueError as e:
                t = key[0] if key else layout.keyed_tasks + keyless
                keyless += key is None
                yield BadInput(t, line_no, str(e), getattr(e, "field", None))
                continue
            if key is None:
                key = (layout.keyed_tasks + keyless, 0)
                keyless += 1
            yield Job(key[0], key[1], group, _Rollout(row, task, response))


async def reverify(
    registry: Registry, options: ReverifyOptions, *, log: TextIO = sys.stderr
) -> tuple[BatchSummary, RewardChanges]:
    """Re-score the rollouts of `options.input` into `options.output`."""
    changes = RewardChanges()
    verifiers: dict[str, ResourcesClient] = {}

    async def verifier(group: str) -> ResourcesClient:
        if group not in verifiers:
            name = options.resources or (await registry.info(group)).references.get("resources")
            if not name:
                raise errors.FailedPrecondition(f"agent {group!r} names no resources server; give --resources")
            verifiers.setdefault(group, ResourcesClient(registry, name, timeout=options.timeout))
        return verifiers[group]

    async def produce(job: Job[_Rollout]) -> dict[str, Any]:
        rollout = job.payload
        began = time.monotonic()
        verdict = await (await verifier(job.group)).verify(uuid.uuid4().hex, rollout.task, rollout.response)
        seconds = time.monotonic() - began
        old = rollout.row
        replaced = {*(old.get("verifier_fields") or ()), "reward_components", "verification_skipped"}
        kept = {k: v for k, v in old.items() if k not in replaced}
        row = record.with_verdict(kept, verdict.reward, rows.json_field(verdict, "fields"), verdict.reward_components)
        row["timings"] = {**(old.get("timings") or {}), "verify": seconds}
        before = verified_reward(old)
        if before is not None:
            changes.compared += 1
            changes.changed += before != verdict.reward
            changes.before += before
            changes.after += verdict.reward
        return row

    layout = _scan(options.input)
    batch_options = options.batch(layout.n_tasks, layout.repeats, total=layout.lines)
    batch_options.span = "gym_grpc.reverify"  # a verification, not a rollout
    batch: Batch[_Rollout] = Batch(batch_options, log)
    with jsonl.held(options.output):
        return await batch.run(_jobs(options, layout), produce), changes
