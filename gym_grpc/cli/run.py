"""`gym-grpc run` and `gym-grpc dump-config`: the servers of a configuration."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import click

from gym_grpc.cli.options import env_file_option, no_unknown_options, split_args
from gym_grpc.launch.config import GymConfig, dump_config, load_config
from gym_grpc.launch.ray_runner import RayRunner
from gym_grpc.launch.ray_runner import describe as describe_ray
from gym_grpc.launch.runner import Runner, describe
from gym_grpc.rpc import event_loop
from gym_grpc.server import stderr


async def _serve(config: GymConfig, grace: float, ready_json: bool) -> int:
    started = time.monotonic()
    # Ctrl-C (or SIGTERM) from now on stops the servers in order: one that came between the ready line
    # and a handler installed after it was a KeyboardInterrupt, "Aborted!", and servers left behind.
    stop = asyncio.Event()
    received = event_loop.stop_on_signals(stop)
    runner: Runner | RayRunner = (
        RayRunner(config, grace=grace) if config.ray is not None else Runner(config, grace=grace)
    )
    # A signal while the servers start (one may take minutes, or hang) stops the start: cancelled, the
    # runner stops what it started, as it does past its start-up time-out.
    if await event_loop.stopped_first(runner.start(), stop):
        click.echo("stopped before every server was ready", err=True)
        return 128 + received[0]
    table = describe_ray(runner, started) if isinstance(runner, RayRunner) else describe(runner, started)
    if ready_json:
        click.echo(table, err=True)
        click.echo(json.dumps(runner.ready()))
    else:
        click.echo(table)
    click.echo(f"Ctrl-C stops every {'replica' if isinstance(runner, RayRunner) else 'server'}.", err=True)
    code = await runner.watch(stop)
    click.echo("stopping...", err=True)
    await runner.stop()
    return code


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, metavar="CONFIG... [KEY=VALUE]...", callback=no_unknown_options)
@click.option("--grace", type=float, default=10.0, show_default=True, help="Seconds in-flight calls get at stop.")
@click.option(
    "--ray",
    "ray_address",
    metavar="ADDRESS",
    help='Run the servers as replicas on a Ray cluster: "auto" (the cluster this machine joined), '
    '"local" (start one here) or HOST:PORT. Same as the config\'s ray.address.',
)
@click.option(
    "--registry",
    "registry_address",
    metavar="HOST:PORT",
    help="Serve the registry here (what clients give as --registry). Same as registry.host and registry.port.",
)
@click.option(
    "--ready-json",
    is_flag=True,
    help="Once every server is healthy, print one line of JSON on stdout for programs (this process's pid, "
    "the registry's address, each server's registry entry); the table goes to stderr.",
)
@env_file_option
def run(
    args: tuple[str, ...],
    grace: float,
    ray_address: str | None,
    registry_address: str | None,
    ready_json: bool,
    env_file: Path | None,
) -> None:
    """Start the servers of CONFIG files (then KEY=VALUE overrides) and serve the registry."""
    stderr.install()  # what the runner and its servers say must never stop them when nobody reads it
    files, overrides = split_args(args)
    if ray_address is not None:
        overrides = [*overrides, f"ray.address={ray_address}"]
    if registry_address is not None:
        host, _, port = registry_address.rpartition(":")
        if not host or not port.isdigit():
            raise click.BadParameter(f"expected HOST:PORT, got {registry_address!r}", param_hint="--registry")
        overrides = [*overrides, f"registry.host={host}", f"registry.port={port}"]
    config = load_config(files, overrides, env_file=env_file)
    sys.exit(asyncio.run(_serve(config, grace, ready_json)))


@click.command("dump-config", context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, metavar="CONFIG... [KEY=VALUE]...", callback=no_unknown_options)
@env_file_option
def dump_config_command(args: tuple[str, ...], env_file: Path | None) -> None:
    """Print the merged configuration of CONFIG files and KEY=VALUE overrides, secrets masked."""
    files, overrides = split_args(args)
    click.echo(dump_config(files, overrides, env_file=env_file), nl=False)
