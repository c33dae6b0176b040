"""The report sent to Weights & Biases or MLflow: `--wandb PROJECT` and `--mlflow EXPERIMENT` on
`collect` (the whole output, once the run ends) and `report`.

One tracked run per rollouts file, named after the file. It gets:

- as its config (W&B) or parameters (MLflow): what defines the collect run,
  from `<stem>.run.json` when there is one (input, agent, overrides, repeats),
  and the pass threshold;
- as metrics: every number of the report per agent, as `<agent>/<name>`
  (`pass@4` is written `pass_at_4`: MLflow takes no `@` in a name). MLflow
  also gets the pass@k curve as `<agent>/pass_at_k` with k as the step;
- two tables: `tasks` (agent, task, rollouts, mean reward, std, kind) and
  `rollouts`, one line per rollout (agent, key, reward, model calls, tokens,
  total seconds, stop reason, the last answer's first 1,000 characters),
  the first `table_rows` rollouts of the file.

Each service is configured as its package reads it: W&B by `WANDB_API_KEY`,
`WANDB_ENTITY`, `WANDB_MODE=offline`, `WANDB_DIR`; MLflow by
`MLFLOW_TRACKING_URI` (a server, or `sqlite:///mlflow.db` locally). The
packages are extras: `pip install 'gym-grpc[wandb]'` or `'gym-grpc[mlflow]'`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gym_grpc import errors
from gym_grpc.data import jsonl, record
from gym_grpc.data.rollout_stats import verified_reward
from gym_grpc.errors import ConfigError
from gym_grpc.report.stats import FileReport

#: The columns of the `rollouts` table.
ROLLOUT_COLUMNS = (
    "agent",
    "task_index",
    "repeat_index",
    "reward",
    "model_calls",
    "input_tokens",
    "output_tokens",
    "total_seconds",
    "stop_reason",
    "answer",
)
#: The columns of the `tasks` table.
TASK_COLUMNS = ("agent", "task_index", "rollouts", "reward_mean", "reward_std", "kind")
#: Characters of a rollout's last answer kept in its table line.
ANSWER_CHARS = 1000


class ExportError(ConfigError):
    """The service refused the report (no credentials, unreachable), or its package is missing."""

    reason = errors.Reason.EXPORT_FAILED


def metric_name(agent: str, name: str) -> str:
    return f"{agent}/{name.replace('@', '_at_')}"


def metrics(report: FileReport, threshold: float) -> dict[str, float]:
    """Every known number of the report, by `<agent>/<name>` (unknown ones, nan, left out)."""
    return {
        metric_name(agent.name, name): value
        for agent in report.agents.values()
        for name, value in agent.metrics(threshold).items()
        if not math.isnan(value)
    }


def run_config(report: FileReport, threshold: float) -> dict[str, Any]:
    """What defines the run that wrote the file (its `.run.json`), the file and the pass threshold."""
    config: dict[str, Any] = {"rollouts_file": str(report.path), "pass_threshold": threshold}
    fingerprint = report.path.with_name(f"{report.path.stem}.run.json")
    if fingerprint.is_file():
        try:
            config.update(json.loads(fingerprint.read_text(encoding="utf-8")))
        except ValueError:
            pass  # a damaged fingerprint costs the parameters, not the export
    return config


def _answer(row: dict[str, Any]) -> str:
    """The text of the rollout's last assistant message, cut to ANSWER_CHARS."""
    output = (row.get("response") or {}).get("output") or []
    for item in reversed(output if isinstance(output, list) else []):
        if isinstance(item, dict) and item.get("type") == "message" and item.get("role") == "assistant":
            content = item.get("content")
            parts = [content] if isinstance(content, str) else [p.get("text", "") for p in content or []]
            return "".join(p for p in parts if isinstance(p, str))[:ANSWER_CHARS]
    return ""


def rollout_lines(path: Path, limit: int) -> Iterator[list[Any]]:
    """The first `limit` rows of a rollouts file as lines of the `rollouts` table."""
    for number, row in enumerate(jsonl.iter_rows(path)):
        if number >= limit:
            return
        agent, task, repeat = record.rollout_key(row)
        tokens_in, tokens_out = record.usage_of(row)
        timings = row.get("timings") if isinstance(row.get("timings"), dict) else {}
        yield [
            agent,
            task,
            repeat,
            verified_reward(row),
            row.get("model_calls"),
            tokens_in,
            tokens_out,
            (timings or {}).get("total"),
            row.get("stop_reason"),
            _answer(row),
        ]


def task_lines(report: FileReport, threshold: float) -> list[list[Any]]:
    return [
        [agent.name, index, task.rollouts, task.mean, task.std, task.kind]
        for agent in report.agents.values()
        for index, task in agent.tasks(threshold).items()
    ]


def to_wandb(report: FileReport, threshold: float, project: str, table_rows: int) -> str:
    """Log one file's report as a W&B run of `project`; where the run is (its URL, or its directory offline)."""
    try:
        import wandb
    except ImportError:
        raise ExportError("--wandb needs the wandb package: pip install 'gym-grpc[wandb]'") from None
    try:
        run = wandb.init(
            project=project,
            name=report.path.stem,
            job_type="rollouts",
            config=run_config(report, threshold),
            reinit="create_new",
        )
    except Exception as e:  # wandb raises its own errors and plain ones (no API key without a terminal)
        raise ExportError(f"W&B: {e} (or set WANDB_API_KEY; WANDB_MODE=offline keeps the run on disk)") from None
    try:
        run.summary.update(metrics(report, threshold))
        run.log(
            {
                "tasks": wandb.Table(columns=list(TASK_COLUMNS), data=task_lines(report, threshold)),
                "rollouts": wandb.Table(
                    columns=list(ROLLOUT_COLUMNS), data=list(rollout_lines(report.path, table_rows))
                ),
            }
        )
    finally:
        run.finish()
    return run.url or run.dir


def to_mlflow(report: FileReport, threshold: float, experiment: str, table_rows: int) -> str:
    """Log one file's report as an MLflow run of `experiment`; the run's id."""
    try:
        import mlflow
    except ImportError:
        raise ExportError("--mlflow needs the mlflow package: pip install 'gym-grpc[mlflow]'") from None
    try:
        mlflow.set_experiment(experiment)
        run = mlflow.start_run(run_name=report.path.stem)
    except Exception as e:  # an unreachable or refusing tracking server
        raise ExportError(f"MLflow ({mlflow.get_tracking_uri()}): {e}") from None
    with run:
        config = run_config(report, threshold)
        mlflow.log_params(
            {key: json.dumps(value) if not isinstance(value, str) else value for key, value in config.items()}
        )
        mlflow.log_metrics(metrics(report, threshold))
        for agent in report.agents.values():
            for k, value in agent.pass_curve(threshold).items():
                mlflow.log_metric(metric_name(agent.name, "pass@k"), value, step=k)
        tasks = task_lines(report, threshold)
        mlflow.log_table({column: [line[i] for line in tasks] for i, column in enumerate(TASK_COLUMNS)}, "tasks.json")
        lines = list(rollout_lines(report.path, table_rows))
        mlflow.log_table(
            {column: [line[i] for line in lines] for i, column in enumerate(ROLLOUT_COLUMNS)}, "rollouts.json"
        )
    return run.info.run_id
