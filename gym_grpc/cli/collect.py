"""`gym-grpc collect` and `gym-grpc reverify`: rollouts of a file of tasks, and scoring them again."""

from __future__ import annotations

import json
import signal
import sys
from collections.abc import Awaitable
from pathlib import Path
from typing import TypeVar

import click

from gym_grpc import errors, tracing
from gym_grpc.batch import states
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.batch.jobs import TIMEOUT_SECONDS, BatchSummary
from gym_grpc.batch.overrides import NEMO_OPTIONS, OverrideError
from gym_grpc.batch.overrides import parse as parse_overrides
from gym_grpc.batch.reverify import ReverifyOptions, reverify
from gym_grpc.batch.task_batches import TaskBatchOptions, collect_batches
from gym_grpc.cli.options import (
    given,
    no_unknown_options,
    progress_option,
    range_option,
    registry_option,
    security_options,
    threshold_option,
    window_option,
    with_registry,
)
from gym_grpc.cli.report import export_options, export_reports
from gym_grpc.client.admission import DEFAULT_CEILING, Limits
from gym_grpc.client.run_many import RESUME_ATTEMPTS
from gym_grpc.data.jsonl import count_rows, failures_path
from gym_grpc.report import stats
from gym_grpc.rpc import event_loop
from gym_grpc.rpc.security import Security

T = TypeVar("T")


def print_summary(
    summary: BatchSummary, output: Path, what: str, estimate_for: int = 0, *, collected: bool = False
) -> None:
    """The end-of-run lines. `collected` for a collect: it generated tokens (reverify does
    not), and its re-run with changed rows or options needs --force."""
    click.echo(
        f"{summary.done} rollouts {what}, {summary.failed} failed, {summary.skipped} already done, "
        f"{summary.bad_rows} bad rows, in {summary.seconds:.2f} s -> {output}",
        err=True,
    )
    for kind, count in summary.failure_counts.items():
        click.echo(f"{kind}: {count:,}", err=True)
    if summary.admission:
        click.echo(summary.admission, err=True)
    lines = summary.run.lines(summary.seconds, estimate_for, failed=summary.failed, tokens=collected)
    for line in lines:
        click.echo(line, err=True)
    if summary.failed:
        click.echo(f"failures are in {failures_path(output)}; run the same command again to retry them", err=True)
    if summary.bad_rows:
        click.echo(
            f"{summary.bad_rows:,} input rows could not be used (each is in {failures_path(output)} with its line "
            "and field); running again will not change that: fix the rows, or give what they lack (--agent)"
            + (", and add --force since the run is then another" if collected else ""),
            err=True,
        )
    for warning in summary.warnings:
        click.echo(f"warning: {warning}", err=True)


def _interruptible(coroutine: Awaitable[T], output: Path, verb: str) -> T:
    """Run a batch. Ctrl-C (SIGINT) says how many rows the output holds and exits 130;
    an output that cannot be written (a full disk) is one line and exit 1. Traced (when the
    OTEL_* variables say so) as service "gym-grpc-VERB", its spans sent before it returns."""
    # A shell starts a background job with SIGINT ignored, and Python keeps it so:
    # `kill -INT` must stop a collection wherever it runs.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    tracing.configure(f"gym-grpc-{verb}")
    try:
        return event_loop.run(coroutine)  # type: ignore[arg-type]
    except KeyboardInterrupt:
        held = count_rows(output) if output.exists() else 0
        in_flight = states.path_for(output)
        click.echo(
            f"interrupted; {held:,} rows are in {output}, every finished rollout among them"
            + (f", and the rollouts in flight in {in_flight}" if in_flight.exists() else "")
            + ": run the same command again to resume",
            err=True,
        )
        sys.exit(130)
    except errors.OutputError as e:
        raise errors.OutputError(
            f"{e}. Stopped; every rollout written before is kept in {output}: "
            "make room, then run the same command again to resume"
        ) from None
    finally:
        tracing.shutdown()


@click.command("collect", context_settings={"ignore_unknown_options": True})
@click.argument("overrides", nargs=-1, metavar="[KEY=VALUE]...", callback=no_unknown_options)
@click.option(
    "--input",
    "input_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL of tasks (or --task-server).",
)
@click.option(
    "--task-server",
    help="Collect the groups this task server chooses (docs/task-service.md) instead of the tasks of --input.",
)
@click.option(
    "--batches",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --task-server: batches to ask for.",
)
@click.option("--groups", type=click.IntRange(min=1), help="With --task-server: groups per batch.")
@click.option(
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSONL of rollouts; appended to, and keys already in it are skipped.",
)
@click.option("--agent", help="Agent for rows without an agent_ref.")
@registry_option
@click.option("--limit", type=click.IntRange(min=0), help="Use only the first N task rows.")
@click.option("--num-repeats", type=click.IntRange(min=1), default=1, show_default=True, help="Rollouts per task.")
@window_option
@click.option(
    "--admission",
    type=click.Choice(["engine"]),
    help="Set the window from the engines' load (KV cache, waiting requests, preemptions), read from the "
    "agents' model servers every --admission-interval, between --min-in-flight and --max-in-flight "
    "(docs/collecting.md#engine-aware-admission).  [default: off: a fixed or deadline-based window]",
)
@click.option(
    "--min-in-flight",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --admission engine: the window's floor (and where it starts).",
)
@click.option(
    "--admission-interval",
    type=click.FloatRange(min=0, min_open=True),
    default=1.0,
    show_default=True,
    help="With --admission engine: seconds between two reads of the engines' load.",
)
@click.option(
    "--kv-cache-target",
    type=click.FloatRange(min=0, max=1, min_open=True, max_open=True),
    default=0.75,
    show_default=True,
    help="With --admission engine: grow the window while the KV cache is less full than this.",
)
@click.option(
    "--kv-cache-high",
    type=click.FloatRange(min=0, max=1, min_open=True),
    default=0.92,
    show_default=True,
    help="With --admission engine: cut it when the KV cache is fuller than this.",
)
@click.option(
    "--admission-metrics-port",
    type=click.IntRange(min=0, max=65535),
    help="With --admission engine: serve its decisions as Prometheus metrics on 127.0.0.1:PORT (0: a free port, "
    "printed) while the run lasts (gym_admission_*: docs/collecting.md#engine-aware-admission).",
)
@click.option(
    "--admission-log",
    type=click.Path(dir_okay=False, path_type=Path),
    help="With --admission engine: append each decision here (JSONL: time, window, load, action, reason).",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=TIMEOUT_SECONDS,
    show_default=True,
    help="Seconds one rollout may take.",
)
@click.option(
    "--resume-attempts",
    type=click.IntRange(min=0),
    default=RESUME_ATTEMPTS,
    show_default=True,
    help="Times a rollout lost with its agent, model server or engine goes on from its last turn boundary "
    "(docs/durable-rollouts.md); 0: it fails instead.",
)
@click.option(
    "--no-states",
    is_flag=True,
    help="Do not keep the rollouts in flight in OUTPUT's .states file, from which the next run goes on with "
    "them when this one is stopped (docs/durable-rollouts.md#a-collector-that-stops).",
)
@click.option(
    "--events",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also record every step of every rollout (model outputs, tool calls, verification) here.",
)
@click.option("--skip-verify", is_flag=True, help="Do not verify now; score later with `gym-grpc reverify`.")
@click.option(
    "--placeholder-reward", type=float, default=0.0, show_default=True, help="The reward written with --skip-verify."
)
@click.option(
    "--force",
    is_flag=True,
    help="Resume into an OUTPUT that holds rollouts of another run (other input, agent, overrides, repeats).",
)
@range_option
@threshold_option
@click.option(
    "--estimate",
    "estimate_for",
    type=click.IntRange(min=0),
    default=10_000,
    show_default=True,
    help="Say how long this many more rollouts would take at the measured rate.",
)
@progress_option
@export_options
@security_options
def collect_command(
    overrides: tuple[str, ...],
    input_path: Path | None,
    task_server: str | None,
    batches: int,
    groups: int | None,
    output: Path,
    agent: str | None,
    registry: str,
    limit: int | None,
    num_repeats: int,
    max_in_flight: int | None,
    admission: str | None,
    min_in_flight: int,
    admission_interval: float,
    kv_cache_target: float,
    kv_cache_high: float,
    admission_metrics_port: int | None,
    admission_log: Path | None,
    timeout: float,
    resume_attempts: int,
    no_states: bool,
    events: Path | None,
    skip_verify: bool,
    placeholder_reward: float,
    force: bool,
    reward_range: tuple[float, float],
    pass_threshold: float,
    estimate_for: int,
    no_progress: bool,
    wandb_project: str | None,
    mlflow_experiment: str | None,
    export_rows: int,
    security: Security,
) -> None:
    """Run the tasks of INPUT through an agent and write scored rollouts to OUTPUT.

    OVERRIDES are KEY=VALUE pairs that replace the rows' responses_create_params
    values, such as temperature=0.6 or reasoning.effort=high (VALUE is read as JSON,
    else as text), checked before the first rollout. NeMo Gym's spellings work too:
    +responses_create_params.temperature=0.6, +num_repeats=4, +limit=10.

    Running the same command again resumes: keys already in OUTPUT are skipped, and
    the rollouts a stopped run left in flight go on from OUTPUT.states, from their
    last turn. OUTPUT.run.json records what defines the run (input rows, agent, overrides,
    repeats, verification); another run into the same OUTPUT is refused unless --force.

    With --task-server, the tasks are the server's choice: --batches batches of
    --groups groups of --num-repeats rollouts (the server's group size unless given).
    """
    ctx = click.get_current_context()
    if task_server is not None:
        _collect_task_batches(ctx, task_server, batches, groups, output, registry, timeout, security)
        return
    if input_path is None:
        raise click.UsageError("give --input (a JSONL of tasks) or --task-server")
    wrong = given(ctx, ("batches", "groups"))
    if wrong:
        raise click.UsageError(f"{' and '.join(wrong)} go with --task-server")
    try:
        parsed = parse_overrides(list(overrides))
    except OverrideError as e:
        raise click.UsageError(str(e)) from None
    for key, value in parsed.options.items():
        if ctx.get_parameter_source(key) is not click.core.ParameterSource.DEFAULT:
            raise click.UsageError(f"+{key}={value} and {NEMO_OPTIONS[key]} are both given: keep one")
    num_repeats = parsed.options.get("num_repeats", num_repeats)
    limit = parsed.options.get("limit", limit)
    for warning in parsed.warnings:
        click.echo(f"warning: {warning}", err=True)
    limits = None
    if admission == "engine":
        try:
            limits = Limits(
                floor=min_in_flight,
                ceiling=max_in_flight or DEFAULT_CEILING,
                kv_target=kv_cache_target,
                kv_high=kv_cache_high,
                interval=admission_interval,
            )
        except ValueError as e:
            raise click.UsageError(
                f"--admission engine: {e} (--min-in-flight, --max-in-flight, --kv-cache-*)"
            ) from None
    else:
        admission_only = ("min_in_flight", "admission_interval", "kv_cache_target", "kv_cache_high", "admission_log")
        for name in (*admission_only, "admission_metrics_port"):
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
                raise click.UsageError(f"--{name.replace('_', '-')} is for --admission engine, which is not given")
    options = CollectOptions(
        input=input_path,
        output=output,
        agent=agent,
        limit=limit,
        num_repeats=num_repeats,
        max_in_flight=max_in_flight,
        admission=limits,
        admission_log=admission_log,
        admission_metrics_port=admission_metrics_port,
        timeout=timeout,
        resume_attempts=resume_attempts,
        keep_states=not no_states,
        overrides=parsed.params,
        events=events,
        skip_verify=skip_verify,
        placeholder_reward=placeholder_reward,
        force=force,
        reward_range=reward_range,
        pass_threshold=pass_threshold,
        progress=not no_progress,
    )
    summary = _interruptible(
        with_registry(registry, agent, lambda reg: collect(reg, options), security, rows=input_path),
        output,
        "collect",
    )
    print_summary(summary, output, "collected", estimate_for, collected=True)
    click.echo(json.dumps(summary.metrics, indent=2))
    if wandb_project or mlflow_experiment:
        export_reports([stats.read(output)], pass_threshold, wandb_project, mlflow_experiment, export_rows)
    if summary.failed or summary.bad_rows:
        sys.exit(1)


#: The collect options for the tasks of a file and their window: the task server runs its own rollouts.
_FILE_ONLY = (
    "input_path",
    "overrides",
    "agent",
    "limit",
    "max_in_flight",
    "resume_attempts",
    "events",
    "skip_verify",
    "placeholder_reward",
    "force",
    "admission",
    "min_in_flight",
    "admission_interval",
    "kv_cache_target",
    "kv_cache_high",
    "admission_log",
    "admission_metrics_port",
)


def _collect_task_batches(
    ctx: click.Context,
    task_server: str,
    batches: int,
    groups: int | None,
    output: Path,
    registry: str,
    timeout: float,
    security: Security,
) -> None:
    wrong = given(ctx, _FILE_ONLY) + (["KEY=VALUE overrides"] if ctx.params["overrides"] else [])
    if wrong:
        raise click.UsageError(f"{', '.join(wrong)}: not with --task-server (the task server chooses the tasks)")
    if groups is None:
        raise click.UsageError("--task-server needs --groups (groups per batch)")
    size = ctx.params["num_repeats"] if given(ctx, ("num_repeats",)) else 0
    if size == 1:
        raise click.UsageError("--num-repeats: a group needs at least 2 rollouts")
    options = TaskBatchOptions(task_server, output, batches, groups, size, timeout)
    totals = _interruptible(
        with_registry(registry, task_server, lambda reg: collect_batches(reg, options, sys.stderr), security),
        output,
        "collect",
    )
    for line in totals.lines() + totals.short:
        click.echo(line, err=True)
    if totals.failed:
        sys.exit(1)


@click.command("reverify")
@click.argument("input_path", metavar="IN.jsonl", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option(
    "--output",
    "--out",
    "output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSONL of re-scored rollouts; appended to, and keys already in it are skipped.",
)
@click.option("--agent", help="Agent for rows without an agent_ref (its resources server verifies).")
@click.option("--resources", help="Resources server that verifies every row, instead of the agents' own.")
@registry_option
@window_option
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=TIMEOUT_SECONDS,
    show_default=True,
    help="Seconds one verification may take (as long as a whole rollout may in collect).",
)
@range_option
@threshold_option
@progress_option
@security_options
def reverify_command(
    input_path: Path,
    output: Path,
    agent: str | None,
    resources: str | None,
    registry: str,
    max_in_flight: int | None,
    timeout: float,
    reward_range: tuple[float, float],
    pass_threshold: float,
    no_progress: bool,
    security: Security,
) -> None:
    """Score the rollouts of IN.jsonl again (verify only, no inference) into --out."""
    options = ReverifyOptions(
        input=input_path,
        output=output,
        agent=agent,
        resources=resources,
        max_in_flight=max_in_flight,
        timeout=timeout,
        reward_range=reward_range,
        pass_threshold=pass_threshold,
        progress=not no_progress,
    )
    summary, changes = _interruptible(
        with_registry(registry, resources or agent, lambda reg: reverify(reg, options), security, rows=input_path),
        output,
        "reverify",
    )
    print_summary(summary, output, "re-verified")
    click.echo(changes.line(), err=True)
    click.echo(json.dumps(summary.metrics, indent=2))
    if summary.failed or summary.bad_rows:
        sys.exit(1)
