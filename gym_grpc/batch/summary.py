"""What a rollout file says, and how fast this run produced it.

`summarise_file` reads a whole output file (every run that wrote to it):
per group (agent), the mean of every numeric field the rollouts produced
(the reward, the fields its verifier listed in `verifier_fields`,
`model_calls`, `timings`), pass@1, pass@k and mean@k with repeats, the
unverified and failed rollouts beside them, and warnings for the usual signs
of a broken verifier or data set. What each number means, and how failed and
unverified rollouts count, is gym_grpc/data/rollout_stats.py's (the same
numbers as `gym-grpc report`).

`RunStats` follows the rows this run wrote: rollouts/s, tokens/s from the
responses' usage, and the median and p95 of each stage's time. It keeps the
same few kilobytes whatever the number of rollouts: the stage times go to
histograms with 1% wide buckets (`Quantiles`), not a list of every time.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_grpc.data import jsonl, record
from gym_grpc.data.rollout_stats import STAGES, Means, Quantiles, TaskScores, verified_reward


def _numbers(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, bool | int | float) and not (isinstance(value, float) and math.isnan(value)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            _numbers(f"{prefix}.{k}", v, out)


class GroupIndex:
    """The group (agent) of each task index, as small ids."""

    def __init__(self, n_tasks: int) -> None:
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self.group_of = array("i", [-1]) * n_tasks

    def set(self, task_index: int, name: str) -> None:
        if name not in self._ids:
            self._ids[name] = len(self.names)
            self.names.append(name)
        self.group_of[task_index] = self._ids[name]


@dataclass
class FileSummary:
    """Metrics per group and warnings, over a whole output file."""

    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def summarise_file(
    path: Path,
    groups: GroupIndex,
    repeats: int,
    *,
    reward_range: tuple[float, float] = (0.0, 1.0),
    pass_threshold: float = 1.0,
    visit: Callable[[str, dict[str, Any]], None] | None = None,
) -> FileSummary:
    """Metrics and warnings per group over every rollout of `path` whose task is in `groups`, and the
    failures of its sidecar that no row made good.

    `visit(group name, row)` sees each row counted, in the same pass (a million-row output
    is read once for everything the end of a run needs from it)."""
    n_tasks = len(groups.group_of)
    # Per task, not per rollout: n, passes, sum (rollout_stats.TaskScores); none without repeats.
    scores = TaskScores(pass_threshold, n_tasks) if repeats > 1 else None
    seen = jsonl.KeyBits(n_tasks * repeats)
    means: dict[int, Means] = {}
    empty: dict[int, int] = {}
    unverified: dict[int, int] = {}
    outside: dict[int, list[float]] = {}
    duplicates = 0
    low, high = reward_range
    for row in jsonl.iter_rows(path):
        slot = record.key_slot(row, n_tasks, repeats)
        if slot is None:
            continue
        group = groups.group_of[slot // repeats]
        if group < 0:  # the task row is not usable now; its old rollouts are not counted
            continue
        if slot in seen:
            duplicates += 1
            continue
        seen.add(slot)
        if visit is not None:
            visit(groups.names[group], row)
        produced: dict[str, float] = {}
        for name in row.get("verifier_fields") or ():
            _numbers(name, row.get(name), produced)
        _numbers("reward_components", row.get("reward_components"), produced)
        _numbers("model_calls", row.get("model_calls"), produced)
        _numbers("timings", row.get("timings"), produced)
        reward = verified_reward(row)
        if reward is None:
            unverified[group] = unverified.get(group, 0) + 1
        else:
            produced["reward"] = reward
            if scores is not None:
                scores.add(slot // repeats, reward)
            if not low <= reward <= high:
                outside.setdefault(group, []).append(reward)
        means.setdefault(group, Means()).add(produced)
        if not record.has_answer(row.get("response")):
            empty[group] = empty.get(group, 0) + 1
    failed = _failed(path, groups, repeats, seen)

    summary = FileSummary()
    for group in sorted(means.keys() | failed.keys(), key=lambda group: groups.names[group]):
        name = groups.names[group]
        m = means.get(group) or Means()
        metrics: dict[str, float] = {"rollouts": m.count, **m.means()}
        if unverified.get(group):
            metrics["unverified"] = unverified[group]
            summary.warnings.append(f"{name}: {unverified[group]} rollouts are not verified yet (gym-grpc reverify)")
        if failed.get(group):
            metrics["failed"] = failed[group]
        if scores is not None:
            tasks = (t for t, owner in enumerate(groups.group_of) if owner == group)
            metrics.update(_at_k(scores, tasks, repeats))
        summary.metrics[name] = metrics
        lowest, highest = m.min("reward"), m.max("reward")
        verified = m.count - unverified.get(group, 0)
        if verified > 1 and lowest == highest:
            summary.warnings.append(
                f"{name}: all {verified} rewards are {lowest:g}: is the verifier or the data broken?"
            )
        if empty.get(group):
            summary.warnings.append(f"{name}: {empty[group]} of {m.count} rollouts have no assistant text or tool call")
        if outside.get(group):
            bad = outside[group]
            summary.warnings.append(
                f"{name}: {len(bad)} rewards outside [{low:g}, {high:g}] (from {min(bad):g} to {max(bad):g})"
            )
    if duplicates:
        summary.warnings.append(f"{duplicates} rows repeat a key already in {path}; each key was counted once")
    return summary


def _at_k(scores: TaskScores, tasks: Iterable[int], repeats: int) -> dict[str, float]:
    """pass@1 over the group's tasks with a verified rollout; pass@k and mean@k (k = the repeats) over
    those with all k verified (`complete_tasks`); a number without such tasks is left out."""
    at = scores.at_k((1, repeats), tasks)
    out: dict[str, float] = {}
    if at[repeats].tasks:
        out["complete_tasks"] = at[repeats].tasks
    if at[1].tasks:
        out["pass@1"] = at[1].pass_at
    if at[repeats].tasks:
        out[f"pass@{repeats}"] = at[repeats].pass_at
        out[f"mean@{repeats}"] = at[repeats].mean_at
    return out


def _failed(path: Path, groups: GroupIndex, repeats: int, written: jsonl.KeyBits) -> dict[int, int]:
    """Failures of the sidecar, per group, whose key no row of the file holds (a key that failed in
    several runs counts once), for the tasks of `groups` alone, as the rows are."""
    n_tasks = len(groups.group_of)
    counted = jsonl.KeyBits(n_tasks * repeats)
    failed: dict[int, int] = {}
    for key, _ in jsonl.failure_records(path):
        _, task, repeat = key
        if task is None or repeat is None or task >= n_tasks or repeat >= repeats:
            continue
        group, slot = groups.group_of[task], task * repeats + repeat
        if group < 0 or slot in written or slot in counted:
            continue
        counted.add(slot)
        failed[group] = failed.get(group, 0) + 1
    return failed


class RunStats:
    """Throughput and stage times of the rows one run wrote."""

    def __init__(self) -> None:
        self.rollouts = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.reward = Means()
        self.stages = {stage: Quantiles() for stage in STAGES}
        #: Rollouts that went on from a turn boundary after an attempt was lost or parked, and the
        #: turns generated again for them (docs/durable-rollouts.md).
        self.resumed = 0
        self.turns_regenerated = 0

    def add(self, row: dict[str, Any]) -> None:
        self.rollouts += 1
        if row.get("attempts"):
            self.resumed += 1
            self.turns_regenerated += record.turns_regenerated(row)
        tokens_in, tokens_out = record.usage_of(row)
        self.input_tokens += tokens_in
        self.output_tokens += tokens_out
        reward = verified_reward(row)
        if reward is not None:
            self.reward.add_number("reward", reward)
        timings = row.get("timings") or {}
        for stage in STAGES:
            if isinstance(timings.get(stage), int | float):
                self.stages[stage].add(float(timings[stage]))

    def slowest_stage(self) -> tuple[str, float, float] | None:
        """(stage, median s, p95 s) of the stage with the largest median time."""
        found = []
        for stage, values in self.stages.items():
            if values.count:
                found.append((values.median(), stage, values.quantile(0.95)))
        if not found:
            return None
        median, stage, p95 = max(found)
        return stage, median, p95

    def lines(self, seconds: float, estimate_for: int, *, failed: int = 0, tokens: bool = True) -> list[str]:
        """Human lines: rollouts/s (succeeded, and attempted when some `failed`), tokens/s
        (unless not `tokens`: a re-verification generates none), the slowest stage, and how
        long more would take."""
        attempted = self.rollouts + failed
        if not attempted or seconds <= 0:
            return []
        rate = self.rollouts / seconds
        line = f"{_rate(rate)} rollouts/s"
        if failed:
            line += f" succeeded, {_rate(attempted / seconds)} attempted ({failed:,} of {attempted:,} failed)"
        if tokens and self.rollouts:
            total = self.input_tokens + self.output_tokens
            line += (
                f"; tokens/s: {_rate(self.input_tokens / seconds)} input, {_rate(self.output_tokens / seconds)} "
                f"output, {_rate(total / seconds)} total ({self.input_tokens:,} + {self.output_tokens:,} tokens)"
            )
        lines = [line]
        slowest = self.slowest_stage()
        if slowest is not None:
            stage, median, p95 = slowest
            lines.append(f"slowest stage: {stage} (median {1000 * median:.1f} ms, p95 {1000 * p95:.1f} ms per rollout)")
        if self.resumed:
            lines.append(
                f"{self.resumed:,} rollouts resumed from a turn boundary after a lost attempt "
                f"({self.turns_regenerated:,} turns generated again)"
            )
        if estimate_for and rate > 0:
            lines.append(f"at this rate {estimate_for:,} more rollouts take {_duration(estimate_for / rate)}")
        return lines


def _rate(per_second: float) -> str:
    """A rate with enough digits to be read when small: 2,150, 35.5, 0.524, 0.00731."""
    if per_second >= 100:
        return f"{per_second:,.0f}"
    if per_second >= 10:
        return f"{per_second:.1f}"
    return f"{per_second:.3g}"


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes:02d} min"
    if minutes:
        return f"{minutes} min {secs:02d} s"
    return f"{secs} s"
