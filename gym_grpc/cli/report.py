"""`gym-grpc report`: what rollouts files hold, as tables, JSON and plots, and sent to W&B or MLflow."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import click

from gym_grpc.cli.options import threshold_option
from gym_grpc.report import export, plots, stats
from gym_grpc.report import text as report_text


def export_options(command: Callable) -> Callable:
    """--wandb PROJECT, --mlflow EXPERIMENT and --export-rows N (see gym_grpc/report/export.py)."""
    options = [
        click.option("--wandb", "wandb_project", metavar="PROJECT", help="Log the report to this W&B project."),
        click.option(
            "--mlflow", "mlflow_experiment", metavar="EXPERIMENT", help="Log the report to this MLflow experiment."
        ),
        click.option(
            "--export-rows",
            type=click.IntRange(min=0),
            default=10_000,
            show_default=True,
            help="Rollouts in the exported rollouts table (the first of the file).",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def export_reports(
    reports: Sequence[stats.FileReport],
    threshold: float,
    wandb_project: str | None,
    mlflow_experiment: str | None,
    rows: int,
) -> None:
    """Send the report of each file to W&B and MLflow, as asked; ExportError when a service refuses."""
    try:
        for report in reports:
            if wandb_project:
                where = export.to_wandb(report, threshold, wandb_project, rows)
                click.echo(f"W&B: {report.path} -> {where}", err=True)
            if mlflow_experiment:
                run_id = export.to_mlflow(report, threshold, mlflow_experiment, rows)
                click.echo(f"MLflow: {report.path} -> experiment {mlflow_experiment!r}, run {run_id}", err=True)
    except export.ExportError as e:
        e.add_note("The rollouts files are unchanged: `gym-grpc report FILE --wandb/--mlflow` exports them again")
        raise


@click.command("report")
@click.argument(
    "paths",
    nargs=-1,
    required=True,
    metavar="ROLLOUTS.jsonl...",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
)
@threshold_option
@click.option("--tasks", "per_task", is_flag=True, help="Also a table of every task: mean reward, rollouts, kind.")
@click.option("--json", "as_json", is_flag=True, help="The report as JSON on stdout, every task included.")
@click.option("--png", type=click.Path(file_okay=False, path_type=Path), help="Write the plots as PNG files here.")
@click.option("--html", type=click.Path(dir_okay=False, path_type=Path), help="Write a page with the plots here.")
@export_options
def report_command(
    paths: tuple[Path, ...],
    pass_threshold: float,
    per_task: bool,
    as_json: bool,
    png: Path | None,
    html: Path | None,
    wandb_project: str | None,
    mlflow_experiment: str | None,
    export_rows: int,
) -> None:
    """Per agent (and with --tasks per task) of rollouts files: reward, pass@k, tasks always / never / sometimes
    solved, tokens, stage times, failures. Two files are shown side by side with the change."""
    reports = [stats.read(path) for path in paths]
    if as_json:
        click.echo(json.dumps(report_text.to_json(reports, pass_threshold), indent=2))
    else:
        click.echo(report_text.render(reports, pass_threshold, tasks=per_task), nl=False)
    if png is not None:
        for written in plots.write_png(reports, pass_threshold, png):
            click.echo(f"wrote {written}", err=True)
    if html is not None:
        plots.write_html(reports, pass_threshold, html)
        click.echo(f"wrote {html}", err=True)
    export_reports(reports, pass_threshold, wandb_project, mlflow_experiment, export_rows)
