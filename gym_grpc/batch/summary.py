"""What a rollout file says, and how fast this run produced it.

`summarise_file` reads a whole output file (every run that wrote to it):
per group (agent), the mean of every numeric field the rollouts produced
(the reward, the fields its verifier listed in `verifier_fields`,
`model_calls`, `timings`), pass@1, pass@k and mean@k over complete groups of
repeats, and warnings for the usual signs of a broken verifier or data set.

`RunStats` follows the rows this run wrote: rollouts/s, tokens/s from the
responses' usage, and the median and p95 of each stage's time. It keeps the
same few kilobytes whatever the number of rollouts: the stage times go to
histograms with 1% wide buckets (`Quantiles`), not a list of every time.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_grpc.data import jsonl, record
from gym_grpc.data.metrics import Means

STAGES = ("model", "tools", "verify")


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
    """Metrics and warnings per group over every rollout of `path` whose task is in `groups`.

    `visit(group name, row)` sees each row counted, in the same pass (a million-row output
    is read once for everything the end of a run needs from it)."""
    n_tasks = len(groups.group_of)
    rewards = array("d", [math.nan]) * (n_tasks * repeats)
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
        if row.get("verification_skipped"):
            unverified[group] = unverified.get(group, 0) + 1
        elif isinstance(row.get("reward"), int | float):
            reward = float(row["reward"])
            rewards[slot] = reward
            produced["reward"] = reward
            if not low <= reward <= high:
                outside.setdefault(group, []).append(reward)
        means.setdefault(group, Means()).add(produced)
        if not record.has_answer(row.get("response")):
            empty[group] = empty.get(group, 0) + 1

    summary = FileSummary()
    for group, m in sorted(means.items(), key=lambda item: groups.names[item[0]]):
        name = groups.names[group]
        metrics: dict[str, float] = {"rollouts": m.count, **m.means()}
        if unverified.get(group):
            metrics["unverified"] = unverified[group]
            summary.warnings.append(f"{name}: {unverified[group]} rollouts are not verified yet (gym-grpc reverify)")
        if repeats > 1:
            metrics.update(_group_metrics(rewards, groups.group_of, group, repeats, pass_threshold))
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


def _group_metrics(rewards: array, group_of: array, group: int, repeats: int, threshold: float) -> dict[str, float]:
    """pass@1, pass@k and mean@k over the tasks of one group whose k repeats are all verified."""
    complete = passed_any = 0
    pass_one = mean_k = 0.0
    for t, owner in enumerate(group_of):
        if owner != group:
            continue
        rollouts = rewards[t * repeats : (t + 1) * repeats]
        if any(math.isnan(x) for x in rollouts):
            continue
        complete += 1
        passes = sum(x >= threshold for x in rollouts)
        passed_any += passes > 0
        pass_one += passes / repeats
        mean_k += sum(rollouts) / repeats
    if not complete:
        return {}
    return {
        "complete_tasks": complete,
        "pass@1": pass_one / complete,
        f"pass@{repeats}": passed_any / complete,
        f"mean@{repeats}": mean_k / complete,
    }


class Quantiles:
    """Quantiles of non-negative numbers (seconds), exact up to `EXACT` values, then to within
    half a bucket (0.5%) in constant memory.

    The first `EXACT` values are kept as they are. Past that, every value goes to a bucket
    [LOW * RATIO**(i - 1), LOW * RATIO**i), and a quantile is the middle of its bucket, clamped
    to the smallest and largest value seen. Values up to LOW (zero among them) share bucket 0,
    values above the top the last one: 4,000 buckets from 1 ns reach ~2e8 s. At most ~64 KB
    however many values are added."""

    EXACT = 4096
    LOW = 1e-9
    RATIO = 1.01
    BUCKETS = 4000

    def __init__(self) -> None:
        self.count = 0
        self.low = math.inf
        self.high = -math.inf
        self._exact: array | None = array("d")
        self._buckets = array("Q", bytes(8 * self.BUCKETS))

    def add(self, value: float) -> None:
        self.count += 1
        if value < self.low:
            self.low = value
        if value > self.high:
            self.high = value
        if self._exact is None:
            self._bucket(value)
        elif len(self._exact) < self.EXACT:
            self._exact.append(value)
        else:
            for kept in self._exact:
                self._bucket(kept)
            self._bucket(value)
            self._exact = None

    def _bucket(self, value: float) -> None:
        i = math.ceil((math.log(value) - _LOG_LOW) * _PER_LOG_RATIO) if value > self.LOW else 0
        self._buckets[i if i < self.BUCKETS else self.BUCKETS - 1] += 1

    def __len__(self) -> int:
        return self.count

    def median(self) -> float:
        """The median (the mean of the two middle values of an even count while exact)."""
        if self._exact is not None and self._exact:
            return statistics.median(self._exact)
        return self.quantile(0.5)

    def quantile(self, q: float) -> float:
        """The value of rank ceil(q * count) (1-based, at least 1); nan when empty."""
        if not self.count:
            return math.nan
        rank = max(1, math.ceil(q * self.count))
        if self._exact is not None:
            return sorted(self._exact)[min(rank, self.count) - 1]
        if rank == 1 or rank >= self.count:
            return self.low if rank == 1 else self.high
        i = seen = 0
        while seen + self._buckets[i] < rank:
            seen += self._buckets[i]
            i += 1
        middle = self.LOW * self.RATIO ** (i - 0.5) if i else 0.0
        return min(max(middle, self.low), self.high)


_LOG_LOW = math.log(Quantiles.LOW)
_PER_LOG_RATIO = 1 / math.log(Quantiles.RATIO)


class RunStats:
    """Throughput and stage times of the rows one run wrote."""

    def __init__(self) -> None:
        self.rollouts = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.reward = Means()
        self.stages = {stage: Quantiles() for stage in STAGES}

    def add(self, row: dict[str, Any]) -> None:
        self.rollouts += 1
        tokens_in, tokens_out = record.usage_of(row)
        self.input_tokens += tokens_in
        self.output_tokens += tokens_out
        if not row.get("verification_skipped") and isinstance(row.get("reward"), int | float):
            self.reward.add({"reward": row["reward"]})
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
