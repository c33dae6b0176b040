"""`gym-grpc init-env`, `gym-grpc test` and `gym-grpc conformance`: writing an environment and checking it."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import grpc

from gym_grpc import bundled, errors
from gym_grpc.cli.options import security_options
from gym_grpc.data.rows import task_from_row
from gym_grpc.rpc.security import Security
from gym_grpc.testing import checks as conformance_checks


@click.command("init-env")
@click.argument("name")
@click.option(
    "--dir",
    "parent",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("servers/resources"),
    show_default=True,
    help="Where the environment's directory is created.",
)
def init_env_command(name: str, parent: Path) -> None:
    """Create a new environment NAME: a server with a tool and a verify, config, data, tests."""
    from gym_grpc.cli.scaffold import init_env

    try:
        target = init_env(name, parent)
    except (ValueError, FileExistsError) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"created {target}")
    click.echo(
        f"next:\n"
        f"  gym-grpc test {target}\n"
        f"  gym-grpc run {bundled.shown(bundled.config('local_policy.yaml'))} {target}/config.yaml\n"
        f"  gym-grpc collect --agent {name}_agent --input {target}/data/example.jsonl --output {name}.jsonl\n"
        f"  gym-grpc prepare-data {target}/config.yaml --mode example-validation"
    )


def _conformance_row(value: str | None) -> dict[str, Any] | None:
    """--row: a task row as JSON text, or the first row of a JSONL file."""
    if value is None:
        return None
    text: str | bytes = value
    if not value.lstrip().startswith("{"):
        path = Path(value)
        if not path.is_file():
            raise click.BadParameter(f"{value}: neither a JSON object nor a file", param_hint="--row")
        text = next((line for line in path.read_bytes().split(b"\n") if line.strip()), b"")  # "\n" alone ends a row
    try:
        row = json.loads(text)
        task_from_row(row)
    except (ValueError, errors.GymError) as e:
        raise click.BadParameter(str(e), param_hint="--row") from None
    return row


@click.command("conformance")
@click.argument("address", metavar="HOST:PORT")
@click.option(
    "--row",
    help="Task row to check with: JSON text, or a JSONL file whose first row is used. "
    "Default: one user message and the server's tools.",
)
@click.option(
    "--answer",
    default=conformance_checks.DEFAULT_ANSWER,
    show_default=True,
    help="Text of the final assistant message the resources checks verify.",
)
@click.option(
    "--role",
    type=click.Choice(["resources", "agent"]),
    help="Check as this role instead of the one the server reports.",
)
@security_options
def conformance_command(address: str, row: str | None, answer: str, role: str | None, security: Security) -> None:
    """Run the conformance checks against the server at HOST:PORT, in any language.

    The checks are those of gym_grpc.testing's ResourcesConformance or
    AgentConformance, chosen by the role the server reports (AdminService
    GetServerInfo, or the services reflection lists). Each check prints PASS,
    FAIL with the reason, or SKIP; any failure exits 1."""
    task_row = _conformance_row(row)

    def report(outcome: conformance_checks.Outcome) -> None:
        label = {"passed": "PASS", "failed": "FAIL", "skipped": "SKIP"}[outcome.status]
        click.echo(f"{label}  {outcome.check}" + (f": {outcome.message}" if outcome.message else ""))

    try:
        done = asyncio.run(
            conformance_checks.run_checks(
                address, task_row, answer=answer, role=role, security=security, on_outcome=report
            )
        )
    except grpc.aio.AioRpcError as e:
        raise errors.from_rpc_error(e, address) from None
    except errors.GymError as e:
        raise errors.GymError(f"{address}: {e.message}", code=e.code, reason=e.reason) from None
    counts = {status: sum(o.status == status for o in done.outcomes) for status in ("passed", "failed", "skipped")}
    who = f"{done.role} server {done.server!r}" if done.server else f"{done.role} server"
    click.echo(f"{who} at {address}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped")
    if row is None and any(o.status == "failed" and "task.data." in o.message for o in done.outcomes):
        click.echo(
            "the default task carries no data of this environment's: give one of its task rows with "
            "--row (JSON text, or a JSONL file such as its data/example.jsonl)"
        )
    if done.failed:
        sys.exit(1)


def _server_test_dirs(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*/tests") if p.is_dir())


@click.command("test", context_settings={"ignore_unknown_options": True})
@click.option("--all", "run_all", is_flag=True, help="Run the tests of every server under ./servers.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def test_command(run_all: bool, args: tuple[str, ...]) -> None:
    """Run the tests of the server in PATH (its tests/ directory), or of every server with --all.

    \b
    gym-grpc test servers/resources/math -x -k boxed   # what follows PATH goes to pytest
    gym-grpc test --all"""
    if run_all:
        targets = _server_test_dirs(Path("servers"))
        if not targets:
            raise click.ClickException("no servers/*/*/tests directories here; run it from the repository's root")
        pytest_args = args
    else:
        if not args or args[0].startswith("-"):
            raise click.UsageError("give a server's directory, or --all")
        path = Path(args[0])
        if not path.is_dir():
            raise click.UsageError(f"{path}: no such directory")
        targets = [path / "tests" if (path / "tests").is_dir() else path]
        pytest_args = args[1:]
    missing = [m for m in ("pytest", "pytest_asyncio") if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(f"{', '.join(missing)} not installed: pip install 'gym-grpc[test]'")
    click.echo(f"testing {len(targets)} server(s): {', '.join(str(t.parent) for t in targets)}", err=True)
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", *map(str, targets), *pytest_args]))
