"""The environments a user can run, for `gym-grpc envs`: found on disk, read from their
configs and asked of their servers, never from a list kept by hand.

Where: the directories given with `--path`, then those of `GYM_GRPC_ENV_PATH`
(separated by `os.pathsep`, as PATH is), then the bundled ones
(`servers/resources` of a checkout, `gym_grpc.bundled.servers.resources` of a
wheel). A directory is an environment's own (it holds `config.yaml`) or holds
environments' directories (each with its `config.yaml`). When two define the
same name, the first found is the one shown, as on PATH, with a note naming
what it hides.

What: each resources server of each `config.yaml`, with

- its `description` and `license` from its entry in the config (the class's
  or module's docstring when the config has no description);
- its tools, as DescribeTools would list them, and the `verifier_fields` its
  class declares, from the server itself (see catalog_probe: a child process
  per config file loads and instantiates the servers, never serves them);
- its agents (the servers whose `resources_server` it is) and datasets: the
  `data/*.jsonl` files of its directory and the files its entries list, with
  their row counts and, where configured, their name, type and license.

An environment that cannot be loaded (a dependency not installed, a config
that does not fit its class) is still listed, as far as its config tells,
with a note that says why.
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gym_grpc import bundled
from gym_grpc.data.jsonl import count_rows
from gym_grpc.errors import ConfigError
from gym_grpc.launch.config import GymConfig, load_config

ENV_PATH_VARIABLE = "GYM_GRPC_ENV_PATH"
CONFIG_NAME = "config.yaml"
BUNDLED = "bundled"
#: How long one config file's servers get to describe themselves (import, instantiate, maybe start).
PROBE_TIMEOUT_SECONDS = 120.0


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass
class DataFile:
    """A JSONL file of tasks; `rows` is None when the file is missing."""

    file: str
    rows: int | None
    name: str | None = None
    type: str | None = None
    license: str | None = None


@dataclass
class Environment:
    name: str
    source: str
    directory: str
    config: str
    description: str
    license: str | None
    entrypoint: str
    server_class: str | None = None
    stateless: bool | None = None
    #: None: not known (a note says why).
    tools: list[Tool] | None = None
    verifier_fields: dict[str, str] | None = None
    agents: list[str] = field(default_factory=list)
    datasets: list[DataFile] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def text(self) -> str:
        """What a search looks in: the name, the description, the tools' names and descriptions."""
        tools = " ".join(f"{t.name} {t.description}" for t in self.tools or ())
        return f"{self.name} {self.description} {tools}".lower()


@dataclass
class Catalog:
    environments: list[Environment]
    #: Servers that were left out, and why (a server that did not load and that no agent names).
    problems: list[str] = field(default_factory=list)

    def names(self) -> list[str]:
        return [e.name for e in self.environments]

    def get(self, name: str) -> Environment | None:
        return next((e for e in self.environments if e.name == name), None)

    def closest(self, name: str) -> list[str]:
        """Names like `name`: near misses first, then names that contain it."""
        near = difflib.get_close_matches(name, self.names(), n=3, cutoff=0.6)
        return near + [n for n in self.names() if name and name in n and n not in near]

    def search(self, text: str) -> list[Environment]:
        """The environments whose name, description or tools hold every word of `text` (any case)."""
        words = text.lower().split()
        matches = []
        for environment in self.environments:
            searched = environment.text()  # built once, not once per word
            if all(word in searched for word in words):
                matches.append(environment)
        return matches


def search_directories(paths: Sequence[Path], environ: Mapping[str, str] = os.environ) -> list[tuple[str, Path]]:
    """(source, directory) in the order they are searched: the paths given, GYM_GRPC_ENV_PATH, the bundled one."""
    found: list[tuple[str, Path]] = [(str(p), p) for p in paths]
    for part in environ.get(ENV_PATH_VARIABLE, "").split(os.pathsep):
        if part.strip():
            path = Path(part).expanduser()
            if not path.is_dir():
                raise ConfigError(f"{ENV_PATH_VARIABLE}: {part!r} is not a directory")
            found.append((part, path))
    found.append((BUNDLED, bundled.server_dir("resources")))
    return found


def config_files(source: str, directory: Path) -> list[Path]:
    """The config.yaml of `directory` when it has one, else those of its subdirectories."""
    own = directory / CONFIG_NAME
    if own.is_file():
        return [own]
    files = sorted(p for p in directory.glob(f"*/{CONFIG_NAME}") if p.is_file())
    if not files and source != BUNDLED:
        raise ConfigError(f"{source}: no environment there: no {CONFIG_NAME} in it or in its subdirectories")
    return files


def find(
    paths: Sequence[Path] = (),
    *,
    only: str | None = None,
    environ: Mapping[str, str] = os.environ,
    timeout: float = PROBE_TIMEOUT_SECONDS,
) -> Catalog:
    """Every environment on the search path. With `only`, just the config files with a server of
    that name are read and their servers described (what `show NAME` needs)."""
    files = [(source, path) for source, d in search_directories(paths, environ) for path in config_files(source, d)]
    if only is not None:
        files = [(source, path) for source, path in files if only in _raw_servers(path)]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        read = list(pool.map(lambda item: _read(item[0], item[1], timeout), files))
    catalog = Catalog([])
    seen: dict[str, Environment] = {}
    for environments, problems in read:
        catalog.problems += problems
        for environment in environments:
            first = seen.get(environment.name)
            if first is not None:
                first.notes.append(f"it hides another {environment.name!r}, in {environment.config}")
                continue
            seen[environment.name] = environment
            catalog.environments.append(environment)
    return catalog


def _raw_servers(path: Path) -> dict[str, Any]:
    """The `servers:` mapping of a config file as written (no includes, no checks); empty when
    the file does not read as one."""
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return {}
    servers = data.get("servers") if isinstance(data, dict) else None
    return servers if isinstance(servers, dict) else {}


def _read(source: str, path: Path, timeout: float) -> tuple[list[Environment], list[str]]:
    """The environments of one config file, and the servers of it that had to be left out."""
    shown = bundled.shown(path)
    try:
        config = load_config([path], import_servers=False)  # the probes import the servers, in children
    except ConfigError as e:
        unloadable = _unloadable(source, path, str(e))
        return unloadable, [] if unloadable else [" ".join(str(e).split())]  # YAML's errors span lines
    referenced = {
        spec.config["resources_server"]
        for spec in config.servers.values()
        if isinstance(spec.config.get("resources_server"), str)
    }
    models = {spec.config.get("model_server") for spec in config.servers.values() if "resources_server" in spec.config}
    asked = [
        {"name": name, "entrypoint": spec.entrypoint, "config": spec.config}
        for name, spec in config.servers.items()
        if "resources_server" not in spec.config and name not in models
    ]
    described = _probe(asked, timeout)
    environments, problems = [], []
    for name, spec in config.servers.items():
        about = described.get(name)
        if about is None:
            continue
        role, error = about.get("role"), about.get("error")
        if role != "resources" and not (name in referenced and role is None):
            if role is None and error:
                problems.append(f"{shown}: server {name!r}: {error}")
            continue
        environment = Environment(
            name=name,
            source=source,
            directory=bundled.shown(path.parent),
            config=shown,
            description=spec.description or about.get("doc") or "",
            license=spec.license,
            entrypoint=spec.entrypoint,
            server_class=about.get("class"),
            stateless=about.get("stateless"),
            verifier_fields=about.get("verifier_fields"),
            agents=sorted(n for n, s in config.servers.items() if s.config.get("resources_server") == name),
            datasets=_datasets(config, name, path.parent),
        )
        if "tools" in about:
            environment.tools = [Tool(t["name"], t["description"], t["parameters"]) for t in about["tools"]]
        if error:
            environment.notes.append(error)
        environments.append(environment)
    return environments, problems


def _unloadable(source: str, path: Path, error: str) -> list[Environment]:
    """What a config that does not load tells by itself: the servers its agents name."""
    servers = _raw_servers(path)
    out = []
    for name, spec in servers.items():
        spec = spec if isinstance(spec, dict) else {}
        agents = [
            a
            for a, s in servers.items()
            if isinstance(s, dict) and (s.get("config") or {}).get("resources_server") == name
        ]
        if not agents:
            continue
        out.append(
            Environment(
                name=name,
                source=source,
                directory=bundled.shown(path.parent),
                config=bundled.shown(path),
                description=str(spec.get("description") or ""),
                license=spec.get("license"),
                entrypoint=str(spec.get("entrypoint", "")),
                agents=sorted(agents),
                datasets=_data_files(path.parent, {}),
                notes=[f"its config does not load: {error}"],
            )
        )
    return out


def _datasets(config: GymConfig, name: str, directory: Path) -> list[DataFile]:
    """The data files of environment `name`: its directory's data/*.jsonl and every file that
    it or its agents list, with what their entries say of them."""
    listed = {}
    for server_name, spec in config.servers.items():
        if server_name == name or spec.config.get("resources_server") == name:
            for dataset in spec.datasets:
                listed[Path(dataset.jsonl_fpath).resolve()] = dataset
    return _data_files(directory, listed)


def _data_files(directory: Path, listed: Mapping[Path, Any]) -> list[DataFile]:
    paths = sorted({*(p.resolve() for p in (directory / "data").glob("*.jsonl")), *listed})
    out = []
    for path in paths:
        spec = listed.get(path)
        try:
            file = str(path.relative_to(directory.resolve()))
        except ValueError:
            file = bundled.shown(path)
        out.append(
            DataFile(
                file=file,
                rows=count_rows(path) if path.is_file() else None,
                name=getattr(spec, "name", None),
                type=getattr(spec, "type", None),
                license=getattr(spec, "license", None),
            )
        )
    return out


def _probe(servers: list[dict[str, Any]], timeout: float) -> dict[str, dict[str, Any]]:
    """Ask catalog_probe, in a child process, what these servers say of themselves."""
    if not servers:
        return {}
    child = subprocess.Popen(
        [sys.executable, "-m", "gym_grpc.launch.catalog_probe"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends what it started too
    )
    try:
        out, err = child.communicate(json.dumps(servers), timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        return {s["name"]: {"error": f"it did not describe itself within {timeout:g} s"} for s in servers}
    try:
        described = json.loads(out) if child.returncode == 0 else None
    except json.JSONDecodeError:
        described = None
    if not isinstance(described, dict):
        last = _last_lines(err)
        return {s["name"]: {"error": f"describing it failed (exit code {child.returncode}){last}"} for s in servers}
    return described


def _last_lines(text: str, count: int = 3) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()][-count:]
    return ": " + " | ".join(lines) if lines else ""
