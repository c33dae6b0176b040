"""`gym-grpc quickstart`: the bundled servers on the embedded policy, the example tasks collected, metrics."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from pathlib import Path

import click

from gym_grpc import bundled
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.cli.collect import print_summary
from gym_grpc.cli.options import with_registry
from gym_grpc.launch.config import load_config
from gym_grpc.launch.runner import Runner, describe

#: The quickstart's files: in a checkout or in the installed wheel (gym_grpc.bundled).
QUICKSTART_CONFIG = bundled.config("quickstart.yaml")
QUICKSTART_DATA = {
    "weather_agent": bundled.server_dir("resources", "weather") / "data" / "example.jsonl",
    "math_agent": bundled.server_dir("resources", "math") / "data" / "example.jsonl",
}


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
            summary = await with_registry(
                runner.registry_address, agent, functools.partial(collect, options=options), runner.config.security
            )
            print_summary(summary, output, "collected", collected=True)
            metrics.update(summary.metrics)
    finally:
        await runner.stop()
    return metrics


@click.command()
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
        raise click.ClickException(f"{QUICKSTART_CONFIG} not found: this gym-grpc was installed without its servers")
    metrics = asyncio.run(_quickstart(output_dir, num_repeats))
    click.echo(json.dumps(metrics, indent=2))
