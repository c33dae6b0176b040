"""What a rollouts file holds, per agent and per task: the numbers of `gym-grpc report`.

A file is read once, a row at a time. Per agent: the rollouts, the reward's
mean, spread and distribution, pass@k for every k the repeats allow, how the
tasks split into always solved / never solved / mixed (the mixed ones are
those an RL step learns from: a group whose rewards all agree has no
advantage), tokens, how many rollouts stopped for each reason, stage times, and the failures of its sidecar
(`<stem>.failures.jsonl`) that no later run made good.

The numbers themselves (which rollouts count, the pass@k estimator, means,
stage times) are gym_grpc/data/rollout_stats.py's, the same code as
`collect`'s end-of-run summary: read it for what pass@k means here and how
failed and unverified rollouts count. This module reads the file into them.

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

from gym_grpc.data import jsonl, record
from gym_grpc.data.rollout_stats import (
    TIMINGS,
    Means,
    Quantiles,
    TaskScores,
    TaskSummary,
    finite,
    spread,
    verified_reward,
)


@dataclass
class AgentStats:
    """Everything `report` says about one agent's rollouts in one file."""

    name: str
    rollouts: int = 0
    #: Rollouts with no verified reward (`--skip-verify` and not re-verified, or no usable reward).
    unverified: int = 0
    #: Rollouts without a task key: counted here, in no task.
    keyless: int = 0
    #: Every verified reward, in the order read (the histogram's), and the task slot of each (-1: no task).
    rewards: array = field(default_factory=lambda: array("d"))
    reward_tasks: array = field(default_factory=lambda: array("l"))
    #: The slot of each task index with a verified rollout, in the order first seen.
    task_slots: dict[int, int] = field(default_factory=dict)
    input_tokens: int = 0
    output_tokens: int = 0
    model_calls: int = 0
    stages: dict[str, Quantiles] = field(default_factory=lambda: {stage: Quantiles() for stage in TIMINGS})
    #: When each rollout ended (the row's `finished_at`, else its response's `created_at`), in Unix seconds.
    finished_at: array = field(default_factory=lambda: array("d"))
    #: When the first rollout began (its end less its `timings.total`).
    first_start: float = math.inf
    #: Failures of the sidecar that no row of the file made good, by "Class (CODE)".
    failures: Counter[str] = field(default_factory=Counter)
    #: Rollouts per stop reason (the row's `stop_reason`: final_message, max_steps, incomplete, token_budget,
    #: episode_over), in the order first seen; rows without one (NeMo Gym's) count in none.
    stop_reasons: Counter[str] = field(default_factory=Counter)
    #: In episodes with several roles: each role's verified rewards, by role name in the order first seen.
    roles: dict[str, array] = field(default_factory=dict)
    _reward: Means = field(default_factory=Means, repr=False, compare=False)
    #: The tasks scored at each pass threshold asked for.
    _scored: dict[float, TaskScores] = field(default_factory=dict, repr=False, compare=False)

    def add(self, row: dict[str, Any], task_index: int | None) -> None:
        self.rollouts += 1
        if task_index is None:
            self.keyless += 1
        reward = verified_reward(row)
        if reward is None:
            self.unverified += 1
        else:
            self.rewards.append(reward)
            slot = -1 if task_index is None else self.task_slots.setdefault(task_index, len(self.task_slots))
            self.reward_tasks.append(slot)
            self._reward.add_number("reward", reward)
            self._scored.clear()
            for role, value in record.role_rewards(row).items():
                self.roles.setdefault(role, array("d")).append(value)
        stop_reason = row.get("stop_reason")
        if isinstance(stop_reason, str) and stop_reason:
            self.stop_reasons[stop_reason] += 1
        tokens_in, tokens_out = record.usage_of(row)
        self.input_tokens += tokens_in
        self.output_tokens += tokens_out
        self.model_calls += int(finite(row.get("model_calls")) or 0)
        timings = row["timings"] if isinstance(row.get("timings"), dict) else {}
        for stage in TIMINGS:
            seconds = finite(timings.get(stage))
            if seconds is not None and seconds >= 0:
                self.stages[stage].add(seconds)
        end = finite(row.get("finished_at"))
        if end is None:  # NeMo Gym's rows: when the last response began
            end = finite((row.get("response") or {}).get("created_at"))
        if end:
            self.finished_at.append(end)
            self.first_start = min(self.first_start, end - (finite(timings.get("total")) or 0.0))

    def _scores(self, threshold: float) -> TaskScores:
        """The verified rewards per task slot, passing at `threshold` (made once per threshold)."""
        scores = self._scored.get(threshold)
        if scores is None:
            scores = self._scored[threshold] = TaskScores(threshold, len(self.task_slots))
            for reward, slot in zip(self.rewards, self.reward_tasks, strict=True):
                if slot >= 0:
                    scores.add(slot, reward)
        return scores

    def tasks(self, threshold: float) -> dict[int, TaskSummary]:
        """Each task with a verified rollout, by task index in order."""
        scores = self._scores(threshold)
        return {index: scores.task(slot) for index, slot in sorted(self.task_slots.items())}

    @property
    def reward_mean(self) -> float:
        mean = self._reward.mean("reward")
        return math.nan if mean is None else mean

    @property
    def reward_std(self) -> float:
        return spread(self.rewards, self.reward_mean)

    def pass_curve(self, threshold: float) -> dict[int, float]:
        """pass@k for k = 1 up to the most verified rollouts any task has, each over the tasks with ≥ k."""
        return self._scores(threshold).pass_curve()

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
            "tasks": len(self.task_slots),
            "tasks_always_solved": kinds["always"],
            "tasks_never_solved": kinds["never"],
            "tasks_mixed": kinds["mixed"],
            "input_tokens_per_rollout": self.input_tokens * per,
            "output_tokens_per_rollout": self.output_tokens * per,
            "model_calls_per_rollout": self.model_calls * per,
            "rollouts_per_second": self.rollouts_per_second(),
        }
        for reason, count in self.stop_reasons.items():
            out[f"stopped.{reason}"] = count
        for stage, times in self.stages.items():
            out[f"{stage}_median_s"] = times.median() if times.count else math.nan
            out[f"{stage}_p95_s"] = times.quantile(0.95)
        for role, rewards in self.roles.items():
            mean = sum(rewards) / len(rewards)
            out[f"role.{role}.reward_mean"] = mean
            out[f"role.{role}.reward_std"] = spread(rewards, mean)
            out[f"role.{role}.passed"] = sum(1 for x in rewards if x >= threshold) / len(rewards)
        return out

    def task_kinds(self, threshold: float) -> Counter[str]:
        """How many tasks (of those with ≥ 2 verified rollouts) are always, never, or sometimes solved."""
        return self._scores(threshold).kinds()


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
