"""What a rollouts file holds, per agent and per task: the numbers of `gym-grpc report`.

A file is read once, a row at a time. Per agent: the rollouts, the reward's
mean, spread and distribution, pass@k for every k the repeats allow, how the
tasks split into always solved / never solved / mixed (the mixed ones are
those an RL step learns from: a group whose rewards all agree has no
advantage), tokens, stage times, and the failures of its sidecar
(`<stem>.failures.jsonl`) that no later run made good.

pass@k is the unbiased estimate over each task's n verified rollouts of which
c passed (1 - C(n-c, k) / C(n, k), Chen et al. 2021), averaged over the tasks
with at least k: what NeMo Gym reports as pass@k for binary rewards. A rollout
passes when its reward is at least the threshold.

Rows as NeMo Gym writes them are read too (`_ng_task_index`, no `agent_ref`).
A row without a task key counts for its agent but for no task; a key seen twice
counts once, as in the end-of-run summary.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gym_grpc.batch.summary import Quantiles
from gym_grpc.data import jsonl, record

#: The stage times a row carries in `timings`, in this order.
STAGES = ("model", "tools", "verify", "total")


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k rollouts drawn from n, c of which passed, passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


@dataclass
class TaskStats:
    """The verified rewards of one task's rollouts, in the order they were read."""

    rewards: list[float] = field(default_factory=list)

    @property
    def mean(self) -> float:
        return sum(self.rewards) / len(self.rewards)

    @property
    def std(self) -> float:
        """Population standard deviation: the spread a GRPO group's advantages are scaled by."""
        mean = self.mean
        return math.sqrt(sum((x - mean) ** 2 for x in self.rewards) / len(self.rewards))

    def passes(self, threshold: float) -> int:
        return sum(x >= threshold for x in self.rewards)

    def kind(self, threshold: float) -> str | None:
        """ "always", "never" or "mixed" for a task with at least two verified rollouts."""
        if len(self.rewards) < 2:
            return None
        passed = self.passes(threshold)
        return "always" if passed == len(self.rewards) else "never" if not passed else "mixed"


@dataclass
class AgentStats:
    """Everything `report` says about one agent's rollouts in one file."""

    name: str
    rollouts: int = 0
    #: Rollouts written with `--skip-verify` and not re-verified: no reward.
    unverified: int = 0
    #: Rollouts without a task key: counted here, in no task.
    keyless: int = 0
    rewards: array = field(default_factory=lambda: array("d"))
    tasks: dict[int, TaskStats] = field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    model_calls: int = 0
    stages: dict[str, Quantiles] = field(default_factory=lambda: {stage: Quantiles() for stage in STAGES})
    #: When each rollout ended (the row's `finished_at`, else its response's `created_at`), in Unix seconds.
    finished_at: array = field(default_factory=lambda: array("d"))
    #: When the first rollout began (its end less its `timings.total`).
    first_start: float = math.inf
    #: Failures of the sidecar that no row of the file made good, by "Class (CODE)".
    failures: Counter[str] = field(default_factory=Counter)

    def add(self, row: dict[str, Any], task_index: int | None) -> None:
        self.rollouts += 1
        if task_index is None:
            self.keyless += 1
        reward = None if row.get("verification_skipped") else _number(row.get("reward"))
        if reward is None:
            self.unverified += 1
        else:
            self.rewards.append(reward)
            if task_index is not None:
                self.tasks.setdefault(task_index, TaskStats()).rewards.append(reward)
        tokens_in, tokens_out = record.usage_of(row)
        self.input_tokens += tokens_in
        self.output_tokens += tokens_out
        self.model_calls += int(_number(row.get("model_calls")) or 0)
        timings = row["timings"] if isinstance(row.get("timings"), dict) else {}
        for stage in STAGES:
            seconds = _number(timings.get(stage))
            if seconds is not None and seconds >= 0:
                self.stages[stage].add(seconds)
        end = _number(row.get("finished_at"))
        if end is None:  # NeMo Gym's rows: when the last response began
            end = _number((row.get("response") or {}).get("created_at"))
        if end:
            self.finished_at.append(end)
            self.first_start = min(self.first_start, end - (_number(timings.get("total")) or 0.0))

    @property
    def reward_mean(self) -> float:
        return sum(self.rewards) / len(self.rewards) if self.rewards else math.nan

    @property
    def reward_std(self) -> float:
        if not self.rewards:
            return math.nan
        mean = self.reward_mean
        return math.sqrt(sum((x - mean) ** 2 for x in self.rewards) / len(self.rewards))

    def pass_curve(self, threshold: float) -> dict[int, float]:
        """pass@k for k = 1 up to the most verified rollouts any task has, each over the tasks with ≥ k."""
        counts = [(len(t.rewards), t.passes(threshold)) for t in self.tasks.values() if t.rewards]
        top = max((n for n, _ in counts), default=0)
        curve = {}
        for k in range(1, top + 1):
            values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
            curve[k] = sum(values) / len(values)
        return curve

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def rollouts_per_second(self) -> float:
        """Rollouts over the time from the first one's start to the last one's end (nan when unknown). A file
        written by several runs counts the time between them too: the throughput plot shows each."""
        if not self.finished_at:
            return math.nan
        span = max(self.finished_at) - self.first_start
        return len(self.finished_at) / span if span > 0 else math.nan

    def metrics(self, threshold: float) -> dict[str, float]:
        """The headline numbers, flat (what `report --json`, wandb and mlflow get); nan when unknown."""
        per = 1 / self.rollouts if self.rollouts else math.nan
        kinds = self.task_kinds(threshold)
        out: dict[str, float] = {
            "rollouts": self.rollouts,
            "failed": self.failed,
            "unverified": self.unverified,
            "reward_mean": self.reward_mean,
            "reward_std": self.reward_std,
            **{f"pass@{k}": v for k, v in self.pass_curve(threshold).items()},
            "tasks": len(self.tasks),
            "tasks_always_solved": kinds["always"],
            "tasks_never_solved": kinds["never"],
            "tasks_mixed": kinds["mixed"],
            "input_tokens_per_rollout": self.input_tokens * per,
            "output_tokens_per_rollout": self.output_tokens * per,
            "model_calls_per_rollout": self.model_calls * per,
            "rollouts_per_second": self.rollouts_per_second(),
        }
        for stage, times in self.stages.items():
            out[f"{stage}_median_s"] = times.median() if times.count else math.nan
            out[f"{stage}_p95_s"] = times.quantile(0.95)
        return out

    def task_kinds(self, threshold: float) -> Counter[str]:
        """How many tasks (of those with ≥ 2 verified rollouts) are always, never, or sometimes solved."""
        return Counter(kind for t in self.tasks.values() if (kind := t.kind(threshold)) is not None)


@dataclass
class FileReport:
    """One rollouts file, per agent, with what could not be counted."""

    path: Path
    agents: dict[str, AgentStats] = field(default_factory=dict)
    #: Non-blank lines that are not a JSON object (a torn last line, a placeholder).
    unreadable: int = 0
    #: Rows whose key (agent, task, repeat) was already counted.
    duplicates: int = 0
    #: Input rows the collector could not use (the sidecar's bad-row records).
    bad_rows: int = 0
    #: Rollouts that failed in one run and were written by a later one.
    recovered: int = 0

    @property
    def rollouts(self) -> int:
        return sum(agent.rollouts for agent in self.agents.values())


def _number(value: Any) -> float | None:
    """A finite JSON number (not a boolean) as a float, else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def read(path: Path) -> FileReport:
    """The report of a rollouts file and its failures sidecar; FileNotFoundError when there is no file."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    report = FileReport(path)
    seen: set[record.RolloutKey] = set()
    read = 0
    for row in jsonl.iter_rows(path):
        read += 1
        key = record.rollout_key(row)
        name, task, repeat = key
        if task is not None and repeat is not None:
            if key in seen:
                report.duplicates += 1
                continue
            seen.add(key)
        else:
            task = None
        agent = report.agents.get(name)
        if agent is None:
            agent = report.agents[name] = AgentStats(name)
        agent.add(row, task)
    report.unreadable = jsonl.count_rows(path) - read
    failures = jsonl.sidecar_failures(path, seen)
    report.recovered, report.bad_rows = failures.recovered, failures.bad_rows
    for (group, _, _), error in failures.missing.items():
        agent = report.agents.get(group)
        if agent is None:
            agent = report.agents[group] = AgentStats(group)
        agent.failures[f"{error.get('class', '?')} ({error.get('code', '?')})"] += 1
    return report
