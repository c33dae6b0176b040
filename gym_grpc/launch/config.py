"""Configuration: YAML files merged in order, then `key=value` overrides.

    registry:            # where `gym-grpc run` serves the registry
      port: 50050
    servers:
      policy_model:
        entrypoint: ../servers/models/local_policy/server.py:LocalPolicyModel
        config: {error_rate: 0.1}          # the server class's own Config
      weather:
        entrypoint: server.py:WeatherEnv   # a path is relative to its YAML file
        port: 0                            # 0: any free port
        description: Look the weather up with a tool, then report it.   # for `gym-grpc envs`
        license: Apache-2.0                # of the server's code (each dataset has its own)

A file may `include:` other files (relative to itself); they are merged
before the file's own content. Later files and overrides win; mappings merge
key by key, anything else is replaced. Then `env.yaml` (in the current
directory, or the file given) is merged: it is where secrets live. An
override is `dotted.key=value` with the value read as YAML
(`servers.weather_agent.config.max_steps=3`).

Top-level keys other than `registry`, `servers`, `layout` (see GymConfig.layout), `security` (see
security.py), `ray` (see docs/scale-out.md), `profiling_enabled` and `profiling_results_dirpath` are
variables, usually
from env.yaml (`policy_base_url: http://gpu-node:8000/v1`). `${name}` in any
string of the servers or the registry is replaced by the variable, or else by
the environment variable of that name; a string that is only `${name}` takes
the variable's type. `${name:-default}` is `default` (text) where neither has a value.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gym_grpc.errors import ConfigError
from gym_grpc.launch import masking
from gym_grpc.rpc.security import Security


class HubIdentifier(BaseModel):
    """Where a dataset lives on the Hugging Face Hub."""

    model_config = ConfigDict(extra="forbid")

    repo_id: str = Field(description='"organization/name" of a dataset repository')
    artifact_fpath: str = Field(description="the file in the repository, such as train.jsonl")
    revision: str | None = Field(None, description="branch, tag or commit; default: main")


class RegistryIdentifier(BaseModel):
    """Where a dataset lives in an MLflow model registry (an `mlflow server`, or GitLab's)."""

    model_config = ConfigDict(extra="forbid")

    dataset_name: str = Field(description="the registered model that holds the dataset")
    version: str | None = Field(None, description="a version number or uploaded label (0.0.1); default: the latest")
    artifact_fpath: str = Field(description="the file in the version, such as train.jsonl")

    @field_validator("version", mode="before")
    @classmethod
    def _version_as_text(cls, value: Any) -> Any:
        # `version: 3` in YAML is an int; a version is a name
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


DatasetType = Literal["train", "validation", "example"]

#: How `gym-grpc run` lays servers out in processes (GymConfig.layout).
Layout = Literal["grouped", "per_server"]

#: Most worker processes `group_workers: auto` gives a group: each holds a copy of every server of its
#: group, and the engine, the collector and the trainer on the same machine want cores too.
AUTO_GROUP_WORKERS_MAX = 8


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class GeneratedBy(BaseModel):
    """The server of the configuration that writes a dataset's rows (`prepare-data --generate`)."""

    model_config = ConfigDict(extra="forbid")

    server: str = Field(min_length=1, description="a resources server whose task_rows() makes its tasks")
    limit: int | None = Field(None, ge=1, description="the first N of its tasks only; default: all")


class DatasetSpec(BaseModel):
    """One data file of an agent, for `gym-grpc prepare-data`."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1)
    type: DatasetType
    jsonl_fpath: str = Field(description="the JSONL of tasks; a relative path is relative to its YAML file")
    license: str | None = Field(None, description="required for train and validation data")
    num_repeats: int = Field(1, ge=1, description="times each row appears in the prepared file")
    huggingface_identifier: HubIdentifier | None = Field(None, description="where to download it when it is missing")
    mlflow_identifier: RegistryIdentifier | None = Field(
        None, description="where to download it when it is missing (NeMo Gym's gitlab_identifier is taken too)"
    )
    generated_by: GeneratedBy | None = Field(
        None, description="a server that writes the rows from its own configuration (prepare-data --generate)"
    )

    @model_validator(mode="before")
    @classmethod
    def _nemo_gym_spellings(cls, data: Any) -> Any:
        """NeMo Gym's `gitlab_identifier`, and its `source: {type: gitlab|huggingface, ...}`, as ours."""
        if not isinstance(data, dict):
            return data
        if "gitlab_identifier" in data:
            if "mlflow_identifier" in data:
                raise ValueError("give mlflow_identifier or gitlab_identifier (NeMo Gym's name for it), not both")
            data = {("mlflow_identifier" if k == "gitlab_identifier" else k): v for k, v in data.items()}
        if "source" in data:
            source = data["source"]
            kinds = {"gitlab": "mlflow_identifier", "mlflow": "mlflow_identifier"}
            kinds["huggingface"] = "huggingface_identifier"
            kind = source.get("type") if isinstance(source, dict) else None
            if kind not in kinds:
                raise ValueError(f"source: give a mapping whose type is one of {', '.join(kinds)}")
            given = [k for k in ("mlflow_identifier", "huggingface_identifier") if k in data]
            if given:
                raise ValueError(f"give source or {' and '.join(given)}, not both")
            data = {k: v for k, v in data.items() if k != "source"}
            data[kinds[kind]] = {k: v for k, v in source.items() if k != "type"}
        return data

    @model_validator(mode="after")
    def _training_data_has_a_license(self) -> DatasetSpec:
        if self.type != "example" and not self.license:
            raise ValueError(f"dataset {self.name!r}: {self.type} data needs a license")
        return self


class ServerSpec(BaseModel):
    """One server of a configuration."""

    model_config = ConfigDict(extra="forbid")

    entrypoint: str = Field(description='"path/to/file.py:Class" or "package.module:Class"')
    host: str = "127.0.0.1"
    port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    num_workers: int = Field(1, ge=1, description="processes serving the port together (SO_REUSEPORT)")
    restart: bool = Field(False, description="start a process of this server again, on its port, when it dies")
    process: str | None = Field(
        None,
        min_length=1,
        description="servers with the same process name run in one process (num_workers of them) and call each "
        "other in it without gRPC; each still serves its own port. Under layout: grouped (the default) the servers "
        "linked by references get one unless one of them has its own",
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="serve Prometheus metrics over HTTP on this port of `host` (0: a free port); worker i of "
        "num_workers serves its own on metrics_port + i; off when unset",
    )
    replicas: int = Field(1, ge=1, description="instances of this server across a Ray cluster (needs --ray)")
    num_cpus: float = Field(1.0, gt=0, description="CPUs Ray reserves for each replica (with --ray)")
    config: dict[str, Any] = Field(default_factory=dict, description="the server class's own settings")
    datasets: list[DatasetSpec] = Field(default_factory=list, description="its data, for prepare-data")
    # What `gym-grpc envs` shows of an environment; running ignores both.
    description: str | None = Field(
        None, description="one or two sentences on what the server is for (default: its class's docstring)"
    )
    license: str | None = Field(None, description="the license of the server's code, an SPDX identifier")

    @model_validator(mode="after")
    def _dataset_names_are_unique(self) -> ServerSpec:
        names = [d.name for d in self.datasets]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"dataset names repeat: {', '.join(repeated)}")
        return self


class RegistrySpec(BaseModel):
    """Where `gym-grpc run` serves the registry."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(50050, ge=0, le=65535)


PlacementStrategy = Literal["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"]


class RaySpec(BaseModel):
    """Where and how `gym-grpc run` places the servers on a Ray cluster (see docs/scale-out.md)."""

    model_config = ConfigDict(extra="forbid")

    address: str = Field(
        "auto", description='the cluster: "auto" (the one this machine joined), "local" (start one here) or HOST:PORT'
    )
    placement_strategy: PlacementStrategy = Field(
        "SPREAD", description="how the replicas of one server are spread over the nodes (a Ray placement group's)"
    )
    max_restarts: int = Field(3, ge=0, description="times Ray starts a replica again after its process or node died")
    poll_seconds: float = Field(
        1.0, gt=0, description="how often the runner asks every replica where it serves (about 1 ms of CPU each)"
    )


class GymConfig(BaseModel):
    """A whole configuration: the registry and the servers, by name."""

    model_config = ConfigDict(extra="forbid")

    registry: RegistrySpec = RegistrySpec()
    servers: dict[str, ServerSpec] = Field(default_factory=dict)
    layout: Layout = Field(
        "grouped",
        description='"grouped": each set of servers linked by references (a string of one\'s config naming '
        'another) runs as one process group, unless one of them has a process: of its own; "per_server": a '
        "process per server unless process: says otherwise",
    )
    group_workers: int | Literal["auto"] = Field(
        "auto",
        description="worker processes of each group the grouped layout makes, when none of its servers sets "
        f"num_workers: a number, or auto (one per core, at most {AUTO_GROUP_WORKERS_MAX})",
    )
    ray: RaySpec | None = Field(None, description="run the servers on a Ray cluster instead of this machine")
    security: Security = Security()
    profiling_enabled: bool = Field(False, description="run yappi in every server and write a log at stop")
    profiling_results_dirpath: str | None = Field(None, description="where the profile logs go")
    #: Why linked servers were left ungrouped, one line each (`gym-grpc run` logs them).
    _layout_notes: list[str] = PrivateAttr(default_factory=list)

    @property
    def layout_notes(self) -> list[str]:
        """Why servers linked by references run in processes of their own under the grouped layout."""
        return self._layout_notes

    @field_validator("group_workers")
    @classmethod
    def _group_workers_are_some(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"{value} worker processes: give 1 or more, or auto")
        return value

    @property
    def workers_per_group(self) -> int:
        """The worker processes of a group the grouped layout makes (group_workers, auto resolved)."""
        if self.group_workers == "auto":
            return min(cores(), AUTO_GROUP_WORKERS_MAX)
        return self.group_workers

    @model_validator(mode="after")
    def _replicas_need_ray(self) -> GymConfig:
        for name, spec in self.servers.items():
            if self.ray is None and spec.replicas > 1:
                raise ValueError(
                    f"servers.{name}.replicas: {spec.replicas} replicas need a Ray cluster (gym-grpc run --ray "
                    "auto|local|HOST:PORT); on one machine, num_workers: N serves one port from N processes"
                )
            if self.ray is not None and spec.num_workers > 1:
                raise ValueError(f"servers.{name}.num_workers: under Ray each replica is one process; use replicas")
            if self.ray is not None and spec.port:
                raise ValueError(f"servers.{name}.port: under Ray each replica binds a free port on its node")
            if self.ray is not None and spec.process is not None:
                raise ValueError(f"servers.{name}.process: under Ray each replica is one process of one server")
            if self.ray is not None and spec.metrics_port:
                raise ValueError(
                    f"servers.{name}.metrics_port: under Ray each replica serves its metrics on a free port of its "
                    "node (metrics_port: 0); gym-grpc status lists them"
                )
        return self

    @model_validator(mode="after")
    def _process_groups_agree(self) -> GymConfig:
        """The servers of one process group start, stop and restart together: one num_workers, one restart."""
        first: dict[str, str] = {}
        for name, spec in self.servers.items():
            if spec.process is None:
                continue
            leader = first.setdefault(spec.process, name)
            other = self.servers[leader]
            for key in ("num_workers", "restart"):
                if getattr(spec, key) != getattr(other, key):
                    raise ValueError(
                        f"servers.{name}.{key}: {getattr(spec, key)}, but servers.{leader}.{key} is "
                        f"{getattr(other, key)}; the servers of process {spec.process!r} run in the same "
                        f"processes, so they take one {key}"
                    )
        return self

    @model_validator(mode="after")
    def _group_linked_servers(self, info: ValidationInfo) -> GymConfig:
        """The grouped layout: each component of servers linked by references runs as one process
        group, named after its first caller (see linked_components), in `workers_per_group` worker
        processes unless its servers set num_workers. A component with a server of an explicit
        `process:` is left as it is, and so is one whose servers disagree on num_workers or restart
        (noted in layout_notes); nothing is grouped under Ray. A server whose class runs in one
        process (GymServer.one_process: a task server) is left out, in a process of its own: to
        tell, this imports the modules of the servers it could group, unless the validation's
        context says `import_servers: False` (a reader of configs that runs nothing, as `gym-grpc
        envs`, whose own process imports no environment)."""
        self._layout_notes = []
        if self.layout != "grouped" or self.ray is not None:
            return self
        taken = {spec.process for spec in self.servers.values() if spec.process is not None}
        alone: set[str] = set()
        if (info.context or {}).get("import_servers", True):
            linked = [n for c in linked_components(self.servers) if len(c) > 1 for n in c]
            alone = {n for n in linked if self.servers[n].process is None and _one_process(self.servers[n])}
        for component in linked_components({n: s for n, s in self.servers.items() if n not in alone}):
            specs = [self.servers[name] for name in component]
            if len(component) < 2 or any(spec.process is not None for spec in specs):
                continue
            disagree = [key for key in ("num_workers", "restart") if len({getattr(s, key) for s in specs}) > 1]
            if disagree:
                values = "; ".join(
                    f"{key}: " + ", ".join(f"{n} {getattr(s, key)}" for n, s in zip(component, specs, strict=True))
                    for key in disagree
                )
                self._layout_notes.append(
                    f"servers {', '.join(component)} call each other but run in processes of their own: they "
                    f"disagree on {' and '.join(disagree)} ({values}), which a process group shares"
                )
                continue
            name = _group_name(component, self.servers)
            unique, n = name, 2
            while unique in taken:
                unique, n = f"{name}.{n}", n + 1
            taken.add(unique)
            workers = None if any("num_workers" in spec.model_fields_set for spec in specs) else self.workers_per_group
            for spec in specs:
                spec.process = unique
                if workers is not None:
                    spec.num_workers = workers
        return self

    @model_validator(mode="after")
    def _metrics_ports_are_free(self) -> GymConfig:
        """Each worker's metrics port (metrics_port + i) exists and is no other port of the configuration."""
        taken = {self.registry.port: "registry.port"} if self.registry.port else {}
        taken |= {spec.port: f"servers.{name}.port" for name, spec in self.servers.items() if spec.port}
        for name, spec in self.servers.items():
            if not spec.metrics_port:
                continue
            last = spec.metrics_port + spec.num_workers - 1
            if last > 65535:
                raise ValueError(
                    f"servers.{name}.metrics_port: {spec.num_workers} workers serve metrics on ports "
                    f"{spec.metrics_port} to {last}, past 65535; pick a lower metrics_port (0: free ports)"
                )
            for port in range(spec.metrics_port, last + 1):
                other = taken.get(port)
                if other is not None:
                    worker = f" (worker {port - spec.metrics_port})" if spec.num_workers > 1 else ""
                    raise ValueError(
                        f"servers.{name}.metrics_port: port {port}{worker} is also {other}; "
                        "pick another metrics_port (0: a free port)"
                    )
                taken[port] = f"servers.{name}.metrics_port" + (
                    f" + {port - spec.metrics_port}" if port > spec.metrics_port else ""
                )
        return self

    @model_validator(mode="after")
    def _profiling_needs_a_directory(self) -> GymConfig:
        if self.profiling_enabled and not self.profiling_results_dirpath:
            raise ValueError("profiling_enabled needs profiling_results_dirpath")
        return self


def _named(value: Any, names: set[str]) -> set[str]:
    """The strings of `value` (nested mappings and lists included) that are in `names`."""
    if isinstance(value, str):
        return {value} & names
    if isinstance(value, dict | list):
        return set().union(*(_named(child, names) for child in (value.values() if isinstance(value, dict) else value)))
    return set()


def named_servers(servers: dict[str, ServerSpec]) -> dict[str, set[str]]:
    """The other servers each server's config names (a string anywhere in it equal to a server's name)."""
    names = set(servers)
    return {name: _named(spec.config, names) - {name} for name, spec in servers.items()}


def linked_components(servers: dict[str, ServerSpec]) -> list[list[str]]:
    """The sets of servers linked by references, either way (directly or through others): each
    a list in configuration order, the lists in the order of their first servers."""
    neighbours: dict[str, set[str]] = {name: set() for name in servers}
    for name, named in named_servers(servers).items():
        for other in named:
            neighbours[name].add(other)
            neighbours[other].add(name)
    order = {name: i for i, name in enumerate(servers)}
    seen: set[str] = set()
    components = []
    for name in servers:
        if name in seen:
            continue
        component, todo = set(), [name]
        while todo:
            current = todo.pop()
            if current not in component:
                component.add(current)
                todo.extend(neighbours[current] - component)
        seen |= component
        components.append(sorted(component, key=order.__getitem__))
    return components


def _one_process(spec: ServerSpec) -> bool:
    """Whether the server's class must run in one process (GymServer.one_process). This imports
    the server's module; a class that does not load counts as not, as its worker says why."""
    from gym_grpc.server.entrypoints import load_entrypoint

    try:
        return load_entrypoint(spec.entrypoint).one_process is not None
    except Exception:  # any failure of the user's module: the worker that loads it reports it
        return False


def _group_name(component: list[str], servers: dict[str, ServerSpec]) -> str:
    """A grouped component's process name: its first server that calls others and that none of
    them calls (the agent, usually), else its first server."""
    named = named_servers({name: servers[name] for name in component})
    called = set().union(*named.values())
    return next((n for n in component if named[n] and n not in called), component[0])


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Merge `update` into `base` in place: mappings key by key, the rest replaced."""
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


def _resolve_paths(data: dict[str, Any], directory: Path) -> None:
    """Make "file.py:Class" entrypoints and dataset paths absolute, relative to their YAML file."""
    servers = data.get("servers")
    if not isinstance(servers, dict):
        return
    for spec in servers.values():
        if not isinstance(spec, dict):
            continue
        entry = spec.get("entrypoint")
        if isinstance(entry, str) and ".py:" in entry:
            path, _, cls = entry.rpartition(":")
            spec["entrypoint"] = f"{(directory / path).resolve()}:{cls}"
        datasets = spec.get("datasets")
        config = spec.get("config")
        if isinstance(config, dict) and isinstance(config.get("datasets"), list):  # a task server's
            datasets = [*(datasets if isinstance(datasets, list) else ()), *config["datasets"]]
        for dataset in datasets if isinstance(datasets, list) else ():
            fpath = dataset.get("jsonl_fpath") if isinstance(dataset, dict) else None
            if isinstance(fpath, str) and "${" not in fpath:
                dataset["jsonl_fpath"] = str((directory / fpath).resolve())


def _load_file(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"{path}: includes itself (through {' -> '.join(str(p) for p in chain)})")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    merged: dict[str, Any] = {}
    includes = data.pop("include", [])
    for include in [includes] if isinstance(includes, str) else includes:
        merge(merged, _load_file(path.parent / include, (*chain, path)))
    _resolve_paths(data, path.parent)
    return merge(merged, data)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `dotted.key=value` override (value parsed as YAML)."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r}: expected key=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: value is not valid YAML: {e}") from None
    parts = key.split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a mapping")
        node = child
    node[parts[-1]] = value


def _near(name: str, names: Sequence[str]) -> str:
    """ " did you mean X?" for the closest of `names`, or nothing."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.75)
    return f"; did you mean {close[0]!r}?" if close else ""


def _check_override_target(data: dict[str, Any], override: str) -> None:
    """An override of `servers.NAME.<anything but entrypoint>` names a server of the files: a
    mistyped NAME would otherwise start a new server, refused for its missing entrypoint."""
    parts = override.partition("=")[0].split(".")
    if len(parts) < 3 or parts[0] != "servers" or parts[2] == "entrypoint":
        return
    servers = data.get("servers")
    names = list(servers) if isinstance(servers, dict) else []
    if parts[1] not in names:
        raise ConfigError(f"override {override!r}: no server {parts[1]!r} in the configuration{_near(parts[1], names)}")


def _check_command_line_variables(overrides: Sequence[str], used: set[str]) -> None:
    """A top-level KEY=VALUE on the command line that is no setting must be a variable that
    something uses: otherwise it is a typo (`profiling_enable=true`) that would do nothing."""
    for override in overrides:
        key = override.partition("=")[0]
        if "." not in key and key not in _SECTIONS and key not in used:
            raise ConfigError(
                f"override {override!r}: {key!r} is no setting, and no ${{{key}}} uses it{_near(key, _SECTIONS)}"
            )


def _references(value: Any, where: str = "", *, required: bool = False) -> dict[str, list[str]]:
    """Every `${name}` in the strings of `value`, with the dotted paths where it appears (`required`:
    only those without a default, `${name:-default}`)."""
    found: dict[str, list[str]] = {}
    if isinstance(value, dict | list):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            path = f"{where}[{key}]" if isinstance(value, list) else (f"{where}.{key}" if where else str(key))
            for name, places in _references(child, path, required=required).items():
                found.setdefault(name, []).extend(places)
    elif isinstance(value, str):
        for match in _VARIABLE.finditer(value):
            if not required or match.group(2) is None:
                found.setdefault(match.group(1), []).append(where)
    return found


#: `${name}`, or `${name:-default}`: the default (text, maybe empty) where the variable has no value.
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_SECTIONS = tuple(GymConfig.model_fields)  # the configuration's own keys; any other top-level key is a variable


def _interpolate(value: Any, variables: dict[str, Any], where: str, secrets: set[str]) -> Any:
    """Replace `${name}` in the strings of `value`; add the secrets it takes from the environment to `secrets`."""
    if isinstance(value, dict):
        return {k: _interpolate(v, variables, f"{where}.{k}", secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, variables, f"{where}[{i}]", secrets) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def lookup(match: re.Match[str]) -> Any:  # every name without a default is known: _load checked them
        name, default = match.group(1), match.group(2)
        if name in variables:
            return variables[name]
        if name not in os.environ and default is not None:
            return default
        if text := masking.secret_text(name, os.environ[name]):
            secrets.add(text)
        return os.environ[name]

    whole = _VARIABLE.fullmatch(value)
    if whole:
        return lookup(whole)
    return _VARIABLE.sub(lambda m: str(lookup(m)), value)


def load_env(env_file: str | Path | None = None) -> dict[str, Any]:
    """The contents of env.yaml: the file given, else ./env.yaml when it exists, else nothing."""
    env_path = Path(env_file) if env_file is not None else Path("env.yaml")
    if env_file is None and not env_path.exists():
        return {}
    return _load_file(env_path)


def _load(
    paths: Sequence[str | Path], overrides: Sequence[str], env_file: str | Path | None, import_servers: bool = True
) -> tuple[GymConfig, set[str]]:
    """The validated configuration, and the secrets of the variables it was built from."""
    data: dict[str, Any] = {}
    for path in paths:
        merge(data, _load_file(Path(path)))
    merge(data, load_env(env_file))
    for override in overrides:
        _check_override_target(data, override)
        apply_override(data, override)
    variables = {k: v for k, v in data.items() if k not in _SECTIONS}
    for name, value in variables.items():
        if isinstance(value, dict | list):
            raise ConfigError(f"{name}: a top-level key that is not a setting is a variable, so a scalar")
    secrets = {text for name, value in variables.items() if (text := masking.secret_text(name, value))}
    sections = {k: data[k] for k in _SECTIONS if k in data}
    references = _references(sections)
    _check_command_line_variables(overrides, set(references))
    required = _references(sections, required=True)
    missing = sorted((n, w) for n, w in required.items() if n not in variables and n not in os.environ)
    if missing:
        listed = "; ".join(f"${{{name}}} in {', '.join(where)}" for name, where in missing)
        raise ConfigError(f"unknown variables (set them in env.yaml or in the environment): {listed}")
    sections = {k: _interpolate(v, variables, k, secrets) for k, v in sections.items()}
    try:
        return GymConfig.model_validate(sections, context={"import_servers": import_servers}), secrets
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid configuration: {problems}") from None


def load_config(
    paths: Sequence[str | Path],
    overrides: Sequence[str] = (),
    *,
    env_file: str | Path | None = None,
    import_servers: bool = True,
) -> GymConfig:
    """Load, merge, interpolate and validate a configuration.

    `env_file` defaults to `env.yaml` in the current directory when it exists. Laying the servers
    out imports the modules of those it could group (to find the ones that run in one process);
    `import_servers=False` imports none, for a caller that runs nothing and reads the servers only."""
    return _load(paths, overrides, env_file, import_servers)[0]


def check_servers(config: GymConfig) -> None:
    """Each server's entrypoint loads and its `config:` block fits the class's Config, with the
    check each server process of `gym-grpc run` makes as it starts (so the same messages).
    Every problem is reported at once. It imports the servers' modules."""
    from gym_grpc.server.entrypoints import load_entrypoint

    problems = []
    for name, spec in config.servers.items():
        try:
            load_entrypoint(spec.entrypoint).checked_config(spec.config, name)
        except ConfigError as e:
            problems.append(str(e) if str(e).startswith("server ") else f"server {name!r}: {e}")
    if problems:
        raise ConfigError("; ".join(problems))


def dump_config(
    paths: Sequence[str | Path], overrides: Sequence[str] = (), *, env_file: str | Path | None = None
) -> str:
    """The merged configuration as YAML, with secrets masked, once every server's config
    block has been checked against its class (check_servers).

    One rule decides what a secret is: a name like a key, token, secret or password.
    Every value of a setting so named is masked. So is the value of every variable so
    named (a top-level key of a config, env.yaml or an override, or an environment
    variable used as `${NAME}`), wherever it appears: inside a URL or a header too."""
    config, secrets = _load(paths, overrides, env_file)
    check_servers(config)
    longest_first = sorted(secrets, key=len, reverse=True)  # a secret that holds another is masked whole
    return yaml.safe_dump(masking.mask(config.model_dump(mode="json"), longest_first), sort_keys=False)


def set_env_values(path: Path, values: dict[str, str]) -> bool:
    """Set top-level keys of an env.yaml (created if missing), keeping its other keys.

    The file is edited as text: the line of each key given (with the indented
    lines of its value) is replaced, or a line is appended, so the user's
    comments and layout stay. When the edited text does not read back as
    exactly the old mapping with the new values (a layout this edit does not
    understand, such as a flow mapping or a duplicate key), the mapping is
    written anew without comments. Returns whether the comments were kept.
    """
    try:
        text = path.read_text() if path.exists() else ""
        before = yaml.safe_load(text) or {}
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(before, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    wanted = {**before, **values}
    lines = text.splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    for key, value in values.items():
        line = yaml.safe_dump({key: value}, default_flow_style=False, width=1_000_000)
        at = next((i for i, old in enumerate(lines) if re.match(rf"{re.escape(key)}\s*:(\s|$)", old)), None)
        if at is None:
            lines.append(line)
            continue
        end = at + 1
        while end < len(lines) and re.match(r"[ \t]+\S|- |-$", lines[end]):  # the value's own lines
            end += 1
        lines[at:end] = [line]
    edited = "".join(lines)
    try:
        kept = yaml.safe_load(edited) == wanted
    except yaml.YAMLError:
        kept = False
    if not kept:
        edited = yaml.safe_dump(wanted, sort_keys=False)
    temporary = path.with_name(path.name + ".tmp")
    try:
        temporary.write_text(edited)
        temporary.replace(path)
    except OSError as e:
        raise ConfigError(f"{path}: cannot write: {e.strerror}") from None
    return kept
