"""The `gym-grpc` command."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import click

from gym_grpc import errors
from gym_grpc.collector import CollectOptions, CollectSummary, collect, failures_path, parse_overrides
from gym_grpc.config import ConfigError, GymConfig, load_config
from gym_grpc.registry import Registry
from gym_grpc.runner import Runner, StartupError, describe

#: Where the quickstart's files are, relative to a checkout of the repository.
REPO_ROOT = Path(__file__).resolve().parent.parent
QUICKSTART_CONFIG = REPO_ROOT / "configs" / "quickstart.yaml"
QUICKSTART_DATA = {
    "weather_agent": REPO_ROOT / "servers" / "resources" / "weather" / "data" / "example.jsonl",
    "math_agent": REPO_ROOT / "servers" / "resources" / "math" / "data" / "example.jsonl",
}


@click.group()
@click.version_option(package_name="gym-grpc")
def main() -> None:
    """gRPC environments for LLM reinforcement learning."""


def _split_args(args: tuple[str, ...]) -> tuple[list[str], list[str]]:
    files = [a for a in args if "=" not in a]
    overrides = [a for a in args if "=" in a]
    if not files:
        raise click.UsageError("give at least one config file")
    return files, overrides


async def _serve_until_stopped(runner: Runner) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    exited = asyncio.ensure_future(runner.wait())
    stopped = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({exited, stopped}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if exited in done:
        click.echo(f"server {exited.result()!r} exited; stopping the others", err=True)
        code = 1
    else:
        exited.cancel()
    click.echo("stopping...", err=True)
    await runner.stop()
    return code


async def _run(config: GymConfig, grace: float) -> int:
    started = time.monotonic()
    runner = Runner(config, grace=grace)
    await runner.start()
    click.echo(describe(runner, started))
    click.echo("Ctrl-C stops every server.", err=True)
    return await _serve_until_stopped(runner)


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1)
@click.option("--grace", type=float, default=10.0, show_default=True, help="Seconds in-flight calls get at stop.")
@click.option(
    "--env-file",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Secrets and variables, merged after the configs.  [default: ./env.yaml if it exists]",
)
def run(args: tuple[str, ...], grace: float, env_file: Path | None) -> None:
    """Start the servers of CONFIG files (then KEY=VALUE overrides) and serve the registry."""
    files, overrides = _split_args(args)
    try:
        config = load_config(files, overrides, env_file=env_file)
        sys.exit(asyncio.run(_run(config, grace)))
    except (ConfigError, StartupError) as e:
        raise click.ClickException(str(e)) from None


def _print_summary(summary: CollectSummary, output: Path) -> None:
    rate = summary.collected / summary.seconds if summary.seconds else 0.0
    click.echo(
        f"{summary.collected} rollouts collected, {summary.failed} failed, {summary.skipped} already done, "
        f"{summary.bad_rows} bad rows, in {summary.seconds:.2f} s ({rate:.1f}/s) -> {output}",
        err=True,
    )
    if summary.failed or summary.bad_rows:
        click.echo(f"failures are in {failures_path(output)}; run the same command again to retry them", err=True)
    for warning in summary.warnings:
        click.echo(f"warning: {warning}", err=True)


async def _collect(registry_address: str, options: CollectOptions) -> CollectSummary:
    registry = Registry(registry_address)
    try:
        if options.agent:
            try:
                await registry.info(options.agent)
            except errors.GymError as e:
                raise click.ClickException(
                    f"{e.message}\n(is `gym-grpc run` up with its registry at {registry_address}?)"
                ) from None
        return await collect(registry, options)
    finally:
        await registry.close()


def _reward_range(ctx: click.Context, param: click.Parameter, value: str) -> tuple[float, float]:
    try:
        low, high = (float(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter("expected MIN,MAX such as 0,1") from None
    return low, high


@main.command("collect", context_settings={"ignore_unknown_options": True})
@click.argument("overrides", nargs=-1)
@click.option(
    "--input",
    "input_path",
    required=True,
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="JSONL of tasks.",
)
@click.option(
    "--output",
    required=True,
    type=click.Path(dir_okay=False, path_type=Path),
    help="JSONL of rollouts; appended to, and keys already in it are skipped.",
)
@click.option("--agent", help="Agent for rows without an agent_ref.")
@click.option("--registry", default="127.0.0.1:50050", show_default=True, help="Registry of a `gym-grpc run`.")
@click.option("--limit", type=click.IntRange(min=0), help="Use only the first N task rows.")
@click.option("--num-repeats", type=click.IntRange(min=1), default=1, show_default=True, help="Rollouts per task.")
@click.option(
    "--max-in-flight",
    type=click.IntRange(min=1),
    default=4096,
    show_default=True,
    help="Most rollouts running at once.",
)
@click.option(
    "--timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=3600.0,
    show_default=True,
    help="Seconds one rollout may take.",
)
@click.option(
    "--events",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Also record every step of every rollout (model outputs, tool calls, verification) here.",
)
@click.option(
    "--reward-range",
    default="0,1",
    show_default=True,
    callback=_reward_range,
    help="Warn about rewards outside MIN,MAX.",
)
@click.option(
    "--pass-threshold",
    type=float,
    default=1.0,
    show_default=True,
    help="A rollout passes (for pass@k) when its reward is at least this.",
)
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def collect_command(
    overrides: tuple[str, ...],
    input_path: Path,
    output: Path,
    agent: str | None,
    registry: str,
    limit: int | None,
    num_repeats: int,
    max_in_flight: int,
    timeout: float,
    events: Path | None,
    reward_range: tuple[float, float],
    pass_threshold: float,
    no_progress: bool,
) -> None:
    """Run the tasks of INPUT through an agent and write scored rollouts to OUTPUT.

    OVERRIDES are KEY=VALUE pairs that replace the rows' responses_create_params
    values, such as temperature=0.6 or reasoning.effort=high (VALUE is read as JSON,
    else as text).
    """
    try:
        parsed = parse_overrides(list(overrides))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    options = CollectOptions(
        input=input_path,
        output=output,
        agent=agent,
        limit=limit,
        num_repeats=num_repeats,
        max_in_flight=max_in_flight,
        timeout=timeout,
        overrides=parsed,
        events=events,
        reward_range=reward_range,
        pass_threshold=pass_threshold,
        progress=not no_progress,
    )
    try:
        summary = asyncio.run(_collect(registry, options))
    except KeyboardInterrupt:
        raise click.ClickException(
            f"interrupted; every finished rollout is in {output}: run the same command again to resume"
        ) from None
    _print_summary(summary, output)
    click.echo(json.dumps(summary.metrics, indent=2))
    if summary.failed or summary.bad_rows:
        sys.exit(1)


async def _quickstart(output_dir: Path, num_repeats: int) -> dict[str, dict[str, float]]:
    started = time.monotonic()
    runner = Runner(load_config([QUICKSTART_CONFIG], ["registry.port=0"]), log_level="WARNING")
    await runner.start()
    click.echo(describe(runner, started), err=True)
    metrics: dict[str, dict[str, float]] = {}
    try:
        for agent, data in QUICKSTART_DATA.items():
            output = output_dir / f"{agent}_rollouts.jsonl"
            output.unlink(missing_ok=True)
            options = CollectOptions(input=data, output=output, agent=agent, num_repeats=num_repeats)
            summary = await _collect(runner.registry_address, options)
            _print_summary(summary, output)
            metrics.update(summary.metrics)
    finally:
        await runner.stop()
    return metrics


@main.command()
@click.option(
    "--output-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("quickstart_output"),
    show_default=True,
    help="Where the rollouts are written.",
)
@click.option("--num-repeats", type=click.IntRange(min=1), default=4, show_default=True, help="Rollouts per task.")
def quickstart(output_dir: Path, num_repeats: int) -> None:
    """Start the quickstart servers, collect the example tasks, print the metrics, stop."""
    if not QUICKSTART_CONFIG.exists():
        raise click.ClickException(
            f"{QUICKSTART_CONFIG} not found: the quickstart runs from a checkout of gym-grpc "
            f"installed with `pip install -e .`"
        )
    try:
        metrics = asyncio.run(_quickstart(output_dir, num_repeats))
    except (ConfigError, StartupError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(metrics, indent=2))
