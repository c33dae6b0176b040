"""`gym-grpc report` in the terminal and as JSON: one block per agent, a column per file.

With two files the last column is the change from the first to the second, so
two runs of the same tasks (another checkpoint, another temperature) read side
by side.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from gym_grpc.data.rollout_stats import TIMINGS
from gym_grpc.report.stats import AgentStats, FileReport


def _number(value: float, digits: int = 3) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}g}" if value else "0"


def _ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{1000 * seconds:.1f}"


def _lines(agent: AgentStats, threshold: float, ks: Sequence[int]) -> dict[str, tuple[str, float]]:
    """label: (cell, the value the change column compares) of one agent in one file."""
    m = agent.metrics(threshold)
    lines: list[tuple[str, str, float]] = [
        ("rollouts", f"{agent.rollouts:,}", agent.rollouts),
        ("failed, not made good", f"{agent.failed:,}", agent.failed),
    ]
    if agent.unverified:
        lines.append(("not verified", f"{agent.unverified:,}", agent.unverified))
    lines.append(("reward mean ± std", f"{_number(m['reward_mean'])} ± {_number(m['reward_std'])}", m["reward_mean"]))
    for k in ks:
        value = m.get(f"pass@{k}", math.nan)
        lines.append((f"pass@{k}", _number(value), value))
    for role in agent.roles:
        mean, std, passed = (m[f"role.{role}.{what}"] for what in ("reward_mean", "reward_std", "passed"))
        lines.append((f"  {role}: reward mean ± std", f"{_number(mean)} ± {_number(std)}", mean))
        lines.append((f"  {role}: reward ≥ threshold", _number(passed), passed))
    lines.append(
        (
            "tasks always / never / mixed",
            f"{m['tasks_always_solved']} / {m['tasks_never_solved']} / {m['tasks_mixed']}",
            m["tasks_mixed"],
        )
    )
    tokens = f"{_number(m['input_tokens_per_rollout'], 4)} / {_number(m['output_tokens_per_rollout'], 4)}"
    lines.append(("tokens in / out per rollout", tokens, m["output_tokens_per_rollout"]))
    lines.append(("model calls per rollout", _number(m["model_calls_per_rollout"]), m["model_calls_per_rollout"]))
    for reason, count in agent.stop_reasons.items():
        lines.append((f"stopped: {reason}", f"{count:,} ({count / agent.rollouts:.0%})", count))
    for stage in TIMINGS:
        median = m[f"{stage}_median_s"]
        lines.append((f"{stage} median / p95 ms", f"{_ms(median)} / {_ms(m[f'{stage}_p95_s'])}", 1000 * median))
    lines.append(("rollouts/s", _number(m["rollouts_per_second"]), m["rollouts_per_second"]))
    for label, count in sorted(agent.failures.items(), key=lambda item: -item[1]):
        lines.append((f"  {label}", f"{count:,}", count))
    return {label: (cell, value) for label, cell, value in lines}


def _table(rows: list[list[str]]) -> list[str]:
    """Rows as aligned text: the first column to the left, the others to the right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(row[1:], widths[1:], strict=True))]
        lines.append("  ".join(cells).rstrip())
    return lines


def _change(before: float, after: float) -> str:
    """after - before, to the three significant digits of the larger of the two."""
    if math.isnan(before) or math.isnan(after):
        return ""
    scale = max(abs(before), abs(after))
    delta = round(after - before, 3 - math.ceil(math.log10(scale))) if scale else 0.0
    return "0" if delta == 0 else f"{delta:+.3g}"


def file_names(reports: Sequence[FileReport]) -> list[str]:
    """A short column name per file: its name, or its path when two files share a name."""
    names = [report.path.name for report in reports]
    return names if len(set(names)) == len(names) else [str(report.path) for report in reports]


def _agents(reports: Sequence[FileReport]) -> list[str]:
    return list(dict.fromkeys(name for report in reports for name in report.agents))


def render(reports: Sequence[FileReport], threshold: float, *, tasks: bool = False) -> str:
    """The report of one file, or of several side by side, as text."""
    out: list[str] = []
    names = file_names(reports)
    for name in _agents(reports):
        present = [report.agents.get(name) for report in reports]  # None: the agent is not in that file
        ks = sorted({k for agent in present if agent for k in agent.pass_curve(threshold)})
        ks = [k for k in ks if k in (1, ks[-1]) or k & (k - 1) == 0]  # 1, the largest, the powers of 2 between
        columns = [_lines(agent, threshold, ks) if agent else {} for agent in present]
        rows = [[name, *names] + (["change"] if len(reports) == 2 else [])]
        for label in dict.fromkeys(label for column in columns for label in column):
            cells = [column.get(label, ("", math.nan)) for column in columns]
            rows.append([label, *(cell for cell, _ in cells)])
            if len(reports) == 2:
                rows[-1].append(_change(cells[0][1], cells[1][1]))
        out += _table(rows)
        if tasks:
            out += ["", *_task_table(name, present, names, threshold)]
        out.append("")
    for report in reports:
        notes = []
        if report.unreadable:
            notes.append(f"{report.unreadable:,} lines are not JSON rows (passed over)")
        if report.duplicates:
            notes.append(f"{report.duplicates:,} rows repeat a key already counted (counted once)")
        keyless = sum(agent.keyless for agent in report.agents.values())
        if keyless:
            notes.append(f"{keyless:,} rows carry no task key: they count for their agent, in no task")
        if report.bad_rows:
            notes.append(f"{report.bad_rows:,} input rows could not be used (see the failures sidecar)")
        if report.recovered:
            notes.append(f"{report.recovered:,} rollouts failed once and were written by a later run")
        out += [f"{report.path}: {note}" for note in notes]
    if not reports or not any(report.agents for report in reports):
        out.append("no rollouts")
    return "\n".join(out).rstrip() + "\n"


def _task_table(name: str, agents: Sequence[AgentStats | None], names: Sequence[str], threshold: float) -> list[str]:
    tasks = [agent.tasks(threshold) if agent else {} for agent in agents]
    indices = sorted({i for each in tasks for i in each})
    rows = [[f"{name} task", *(f"{n}: mean (n) kind" for n in names)]]
    for index in indices:
        cells = []
        for each in tasks:
            task = each.get(index)
            cells.append("" if task is None else f"{_number(task.mean)} ({task.rollouts}) {task.kind or ''}")
        rows.append([str(index), *cells])
    return _table(rows)


def _finite(value: float) -> float | None:
    return None if math.isnan(value) else value


def to_json(reports: Sequence[FileReport], threshold: float) -> dict[str, Any]:
    """The report as JSON: per file, per agent, the metrics and every task (nan as null)."""

    def task_json(agent: AgentStats) -> dict[str, Any]:
        return {
            str(index): {
                "rollouts": task.rollouts,
                "reward_mean": task.mean,
                "reward_std": task.std,
                "passed": task.passed,
                "kind": task.kind,
            }
            for index, task in agent.tasks(threshold).items()
        }

    return {
        "pass_threshold": threshold,
        "files": [
            {
                "path": str(report.path),
                "rollouts": report.rollouts,
                "unreadable": report.unreadable,
                "duplicates": report.duplicates,
                "bad_rows": report.bad_rows,
                "recovered": report.recovered,
                "agents": {
                    name: {
                        "metrics": {k: _finite(v) for k, v in agent.metrics(threshold).items()},
                        "failures": dict(agent.failures),
                        "keyless": agent.keyless,
                        "tasks": task_json(agent),
                    }
                    for name, agent in report.agents.items()
                },
            }
            for report in reports
        ],
    }
