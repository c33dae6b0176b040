"""`gym-grpc envs list|show|search`: the catalog of environments (catalog.py) as tables, details and JSON."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from gym_grpc.errors import ConfigError
from gym_grpc.launch import catalog
from gym_grpc.launch.catalog import Catalog, Environment


def _catalog_options(command: Callable) -> Callable:
    command = click.option(
        "--json", "as_json", is_flag=True, help="JSON on stdout, for scripts (notes and problems included)."
    )(command)
    return click.option(
        "--path",
        "paths",
        multiple=True,
        type=click.Path(exists=True, file_okay=False, path_type=Path),
        help=f"A directory of environments, or one environment's; searched before ${catalog.ENV_PATH_VARIABLE} "
        "and the bundled ones. Repeatable.",
    )(command)


def _find(paths: Sequence[Path], only: str | None = None) -> Catalog:
    try:
        return catalog.find(paths, only=only)
    except ConfigError as e:
        raise click.ClickException(str(e)) from None


@click.group()
def envs() -> None:
    """The environments you can run: the bundled ones and yours (--path, $GYM_GRPC_ENV_PATH)."""


@envs.command("list")
@_catalog_options
def list_command(paths: tuple[Path, ...], as_json: bool) -> None:
    """Every environment: name, tools, dataset rows, license, description."""
    found = _find(paths)
    _print_table(found.environments, found, as_json)


@envs.command("search")
@click.argument("text")
@_catalog_options
def search_command(text: str, paths: tuple[Path, ...], as_json: bool) -> None:
    """The environments whose name, description or tools hold every word of TEXT (any case)."""
    found = _find(paths)
    matches = found.search(text)
    if not matches and not as_json:
        click.echo(f"no environment matches {text!r} (of {len(found.environments)}: gym-grpc envs list)", err=True)
        _print_problems(found)
        return
    _print_table(matches, found, as_json)


@envs.command("show")
@click.argument("name")
@_catalog_options
def show_command(name: str, paths: tuple[Path, ...], as_json: bool) -> None:
    """One environment in full: its tools with their arguments, verifier fields, agents, datasets."""
    environment = _find(paths, only=name).get(name)
    if environment is None:
        everything = _find(paths)
        environment = everything.get(name)  # defined in a config that names it only through an include
        if environment is None:
            near = everything.closest(name)
            hint = f"; did you mean {' or '.join(repr(n) for n in near)}?" if near else ""
            raise click.ClickException(f"no environment {name!r}{hint} (gym-grpc envs list shows them all)")
    if as_json:
        click.echo(json.dumps(environment.to_json(), indent=2))
        return
    click.echo(_details(environment))


def _print_table(environments: list[Environment], found: Catalog, as_json: bool) -> None:
    if as_json:
        out = {"environments": [e.to_json() for e in environments], "problems": found.problems}
        click.echo(json.dumps(out, indent=2))
        return
    rows = [
        [
            e.name,
            "?" if e.tools is None else str(len(e.tools)),
            str(sum(d.rows or 0 for d in e.datasets)),
            e.license or "-",
            e.source,
            e.description,
        ]
        for e in environments
    ]
    headers = ["name", "tools", "rows", "license", "source", "description"]
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers) - 1)]
    room = max(30, shutil.get_terminal_size((120, 24)).columns - sum(widths) - 2 * len(widths))
    for row in [headers, *rows]:
        cells = [  # the counts (tools, rows) to the right
            cell.rjust(width) if i in (1, 2) else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row[:-1], widths, strict=True))
        ]
        click.echo("  ".join([*cells, _clip(row[-1], room)]).rstrip())
    for e in environments:
        for note in e.notes:
            click.echo(f"note: {e.name}: {note}", err=True)
    _print_problems(found)


def _print_problems(found: Catalog) -> None:
    for problem in found.problems:
        click.echo(f"left out: {problem}", err=True)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def _signature(parameters: dict[str, Any]) -> str:
    """`city: string, units?: string` from a tool's JSON schema."""
    properties = parameters.get("properties")
    if not isinstance(properties, dict):
        return ""
    required = set(parameters.get("required") or ())
    parts = []
    for name, schema in properties.items():
        kind = schema.get("type", "any") if isinstance(schema, dict) else "any"
        kind = "|".join(kind) if isinstance(kind, list) else str(kind)
        parts.append(f"{name}{'' if name in required else '?'}: {kind}")
    return ", ".join(parts)


def _details(e: Environment) -> str:
    lines = [e.name]
    if e.description:
        lines.append(f"  {e.description}")
    lines += [
        f"  source:   {e.source}",
        f"  license:  {e.license or '-'}",
        f"  config:   {e.config}",
        f"  server:   {e.server_class or e.entrypoint}"
        + ("" if e.stateless is None else (" (stateless)" if e.stateless else " (keeps state per session)")),
        f"  agents:   {', '.join(e.agents) or '-'}",
    ]
    if e.tools is None:
        lines.append("  tools:    unknown (see the notes)")
    elif not e.tools:
        lines.append("  tools:    none (the model answers directly)")
    else:
        lines.append("  tools:")
        lines += [f"    {t.name}({_signature(t.parameters)})  {t.description}".rstrip() for t in e.tools]
    if e.verifier_fields is None:
        lines.append("  verifier fields: unknown (see the notes)")
    elif not e.verifier_fields:
        lines.append("  verifier fields: not declared (verifier_fields of its class)")
    else:
        width = max(len(n) for n in e.verifier_fields)
        lines.append("  verifier fields:")
        lines += [f"    {n.ljust(width)}  {meaning}".rstrip() for n, meaning in e.verifier_fields.items()]
    if not e.datasets:
        lines.append("  datasets: none")
    else:
        counts = ["missing" if d.rows is None else f"{d.rows:,} rows" for d in e.datasets]
        width, count_width = max(len(d.file) for d in e.datasets), max(len(c) for c in counts)
        lines.append("  datasets:")
        for d, count in zip(e.datasets, counts, strict=True):
            listed = ", ".join(x for x in (d.type and f"{d.type} dataset {d.name!r}", d.license) if x)
            lines.append(f"    {d.file.ljust(width)}  {count.rjust(count_width)}  {listed or 'not in the config'}")
    lines += [f"  note: {note}" for note in e.notes]
    return "\n".join(lines)
