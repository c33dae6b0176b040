"""`gym-grpc status` and `gym-grpc profile`: what the servers of a running configuration say about themselves."""

from __future__ import annotations

import asyncio
import json
import sys

import click

from gym_grpc.cli.options import connect, registry_option, security_options
from gym_grpc.launch import observe
from gym_grpc.rpc.security import Security


@click.command("status")
@registry_option
@click.option("--json", "as_json", is_flag=True, help="One JSON object per server, for scripts.")
@click.option(
    "--interval",
    type=click.FloatRange(min=0.1),
    default=1.0,
    show_default=True,
    help="Seconds between the two samples that give calls/s.",
)
@security_options
def status_command(registry: str, as_json: bool, interval: float, security: Security) -> None:
    """Every server of a running config: address, health, pid, uptime, in flight, calls/s, engine retries,
    open files; and each of its worker processes: pid and Prometheus metrics address."""

    async def ask() -> list[dict]:
        async with connect(registry, security) as reg:
            return await observe.status(reg, interval)

    rows = asyncio.run(ask())
    click.echo(json.dumps(rows, indent=2) if as_json else observe.format_status(rows))
    if any(row["health"] != "serving" for row in rows):
        sys.exit(1)


@click.command("profile")
@click.argument("names", nargs=-1)
@registry_option
@click.option("--limit", type=click.IntRange(min=1), default=30, show_default=True, help="Functions per server.")
@security_options
def profile_command(names: tuple[str, ...], registry: str, limit: int, security: Security) -> None:
    """The current profile (name ncall tsub ttot tavg, by ttot) of NAMES, or of every server."""

    async def ask() -> list[tuple[str, str, str]]:
        async with connect(registry, security) as reg:
            return await observe.profiles(reg, list(names), limit)

    for name, address, text in asyncio.run(ask()):
        click.echo(f"== {name} ({address})\n{text}")
