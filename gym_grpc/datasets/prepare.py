"""`gym-grpc prepare-data`: check an agent's datasets, keep their statistics, collate them.

The datasets are listed on the servers of a configuration (usually agents):

    servers:
      math_agent:
        entrypoint: ../../agents/simple_agent/agent.py:SimpleAgent
        datasets:
          - {name: example, type: example, jsonl_fpath: data/example.jsonl}
          - name: train
            type: train
            jsonl_fpath: data/train.jsonl
            license: Apache-2.0
            num_repeats: 4
            huggingface_identifier: {repo_id: my-org/gym-math-train, artifact_fpath: train.jsonl}

`example-validation` works on the `example` datasets, `train-preparation` on
`train` and `validation`. Either way, in this order, so that nothing is
written from data that is wrong:

1. every row of every file is checked; every malformed row is reported
   (file, line, field) and nothing else happens;
2. statistics are computed and compared with the committed
   `<name>.stats.json` next to each file (written when there is none);
   a difference is an error that lists what changed;
3. the rows are collated into one `<type>.jsonl` per type in the output
   directory, each with an `agent_ref` naming its agent and repeated
   `num_repeats` times, ready for a training framework or `gym-grpc collect`.

A dataset `generated_by: {server: NAME, limit: N}` is written, with
`--generate`, by that resources server's `task_rows()` from its own
configuration (reasoning-gym's generators, seeded games) before the checks;
its committed statistics then say whether the generator still makes the
same tasks.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gym_grpc import errors
from gym_grpc.data import jsonl, rows
from gym_grpc.data.dataset_stats import differences, statistics, write_statistics
from gym_grpc.launch.config import DatasetSpec, GymConfig
from gym_grpc.rpc.registry import closest
from gym_grpc.v1 import task_pb2

Mode = Literal["example-validation", "train-preparation"]
MODES: dict[str, tuple[str, ...]] = {"example-validation": ("example",), "train-preparation": ("train", "validation")}
#: NeMo Gym's spellings of the modes (`ng_prepare_data +mode=example_validation`).
MODE_SPELLINGS = {"example_validation": "example-validation", "train_preparation": "train-preparation"}


@dataclass(frozen=True)
class Problem:
    """What is wrong with one row (or a whole file, with no line)."""

    path: Path
    line: int | None
    field: str
    message: str

    def __str__(self) -> str:
        where = f"{self.path}:{self.line}" if self.line is not None else str(self.path)
        return f"{where}: {self.field}: {self.message}" if self.field else f"{where}: {self.message}"


class DataError(errors.FrameworkError):
    """The data cannot be prepared; `problems` says every reason."""

    reason = errors.Reason.DATASET_INVALID

    def __init__(self, headline: str, problems: list[str]) -> None:
        super().__init__("\n".join([headline, *(f"  {p}" for p in problems)]))
        self.problems = problems


@dataclass
class TaskFile:
    """The rows of a task file that loaded, and the problems of the rest."""

    path: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    tasks: list[task_pb2.Task] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)


def _input_is_empty(task: task_pb2.Task) -> bool:
    params = task.responses_create_params
    return not (params.input_text if params.WhichOneof("input") == "input_text" else params.input_items.items)


def read_tasks(path: Path, agents: list[str] | None = None) -> TaskFile:
    """Load every row of a task file and say what is wrong with each bad one.

    With `agents`, a row's `agent_ref.name` must be one of them."""
    result = TaskFile(path)
    try:
        handle = path.open("rb")
    except OSError as e:
        result.problems.append(Problem(path, None, "", f"cannot read: {e.strerror}"))
        return result
    with handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                row = jsonl.parse_line(raw)
                task = rows.task_from_row(row)
                if _input_is_empty(task):
                    raise rows.RowError(f"{rows.PARAMS_KEY}.input", "is empty")
                if "agent_ref" in row:
                    name = rows.agent_name(row, None)
                    if agents is not None and name not in agents:
                        raise rows.RowError(
                            "agent_ref.name", f"no server {name!r} in the configuration; {closest(name, agents)}"
                        )
            except ValueError as e:
                if isinstance(e, rows.RowError):
                    result.problems.append(Problem(path, number, e.field or "", e.detail or ""))
                else:
                    result.problems.append(Problem(path, number, "", str(e)))
                continue
            result.rows.append(row)
            result.tasks.append(task)
    if not result.rows and not result.problems:
        result.problems.append(Problem(path, None, "", "has no rows"))
    return result


@dataclass(frozen=True)
class Dataset:
    """A dataset of the configuration, with the server it belongs to."""

    server: str
    spec: DatasetSpec

    @property
    def path(self) -> Path:
        return Path(self.spec.jsonl_fpath)

    @property
    def sources(self) -> list[str]:
        """Where the dataset can be downloaded from: "huggingface", "mlflow", both or neither."""
        return [
            source
            for source, identifier in (
                ("huggingface", self.spec.huggingface_identifier),
                ("mlflow", self.spec.mlflow_identifier),
            )
            if identifier is not None
        ]

    @property
    def stats_path(self) -> Path:
        return self.path.with_name(f"{self.path.stem}.stats.json")


def datasets_of(config: GymConfig, mode: Mode) -> list[Dataset]:
    """The datasets of a configuration that a mode works on, in configuration order."""
    types = MODES[mode]
    found = [Dataset(name, d) for name, spec in config.servers.items() for d in spec.datasets if d.type in types]
    if not found:
        raise DataError(
            f"{mode}: the configuration lists no {' or '.join(types)} datasets",
            ["add `datasets:` to an agent in its YAML (see `gym-grpc prepare-data --help`)"],
        )
    return found


@dataclass
class Prepared:
    """What prepare-data did."""

    #: Collated file of each type, and its number of rows.
    outputs: dict[str, tuple[Path, int]] = field(default_factory=dict)
    #: Statistics files written (new, or updated on request).
    stats_written: list[Path] = field(default_factory=list)
    #: Task files a server wrote (--generate).
    generated: list[Path] = field(default_factory=list)


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text, encoding="utf-8")
    os.replace(temporary, path)


def generated_rows(config: GymConfig, dataset: Dataset) -> list[dict[str, Any]]:
    """The rows of a dataset `generated_by` a server: that server, built from its
    configuration (not served), writes them with its task_rows()."""
    from gym_grpc.resources import ResourcesServer
    from gym_grpc.server.entrypoints import load_entrypoint

    generator = dataset.spec.generated_by
    assert generator is not None
    where = f"dataset {dataset.spec.name!r} of {dataset.server}: generated_by.server"
    spec = config.servers.get(generator.server)
    if spec is None:
        near = closest(generator.server, list(config.servers))
        raise errors.ConfigError(f"{where}: no server {generator.server!r} in the configuration; {near}")
    cls = load_entrypoint(spec.entrypoint)
    if not issubclass(cls, ResourcesServer) or cls.task_rows is ResourcesServer.task_rows:
        raise errors.ConfigError(f"{where}: {generator.server!r} ({spec.entrypoint}) does not write task rows")
    return cls(spec.config, name=generator.server).task_rows(generator.limit)


def prepare(
    config: GymConfig,
    mode: Mode,
    output_dir: Path,
    *,
    update_stats: bool = False,
    fetch: Callable[[Dataset], object] | None = None,
    generate: bool = False,
    echo: Callable[[str], None] = print,
) -> Prepared:
    """Check, measure and collate the datasets of a mode (see the module docstring).

    `fetch` downloads a dataset whose file is missing (from its
    huggingface_identifier or mlflow_identifier); without it a missing file
    is a problem. `generate` (re)writes every dataset that is `generated_by` a server."""
    done = Prepared()
    datasets = datasets_of(config, mode)
    for dataset in datasets:
        if generate and dataset.spec.generated_by is not None:
            written = generated_rows(config, dataset)
            _write_atomically(dataset.path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in written))
            echo(f"generated {len(written)} rows of {dataset.spec.name} with {dataset.spec.generated_by.server}")
            done.generated.append(dataset.path)
        if not dataset.path.exists() and fetch is not None and dataset.sources:
            echo(f"downloading {dataset.spec.name} of {dataset.server} to {dataset.path}")
            fetch(dataset)

    agents = list(config.servers)
    loaded: list[tuple[Dataset, TaskFile]] = []
    problems: list[str] = []
    for dataset in datasets:
        if not dataset.path.exists():
            where = {"huggingface": "the Hub", "mlflow": "the MLflow registry"}
            if dataset.spec.generated_by is not None:
                hint = f"pass --generate to write it with server {dataset.spec.generated_by.server!r}"
            elif dataset.sources:
                hint = f"pass --download to fetch it from {' or '.join(where[s] for s in dataset.sources)}"
            else:
                hint = "create it, give it a huggingface_identifier or mlflow_identifier, or a generated_by server"
            problems.append(f"{dataset.path}: dataset {dataset.spec.name!r} of {dataset.server} does not exist; {hint}")
            continue
        tasks = read_tasks(dataset.path, agents)
        loaded.append((dataset, tasks))
        problems += [str(p) for p in tasks.problems]
    if problems:
        raise DataError(f"{len(problems)} problem(s) in the data; nothing was written", problems)

    changed: list[str] = []
    to_write: dict[Path, dict[str, Any]] = {}
    for dataset, tasks in loaded:
        current = statistics(tasks.tasks)
        echo(f"{dataset.server}/{dataset.spec.name}: {current['rows']} rows, {dataset.path}")
        if dataset.stats_path.exists() and not update_stats:
            committed = json.loads(dataset.stats_path.read_text(encoding="utf-8"))
            changed += [f"{dataset.stats_path}: {d}" for d in differences(committed, current)]
        else:
            to_write[dataset.stats_path] = current
    if changed:
        raise DataError(
            "the data no longer matches its committed statistics (pass --update-stats to accept the change)", changed
        )
    for path, stats in to_write.items():
        write_statistics(path, stats)
        done.stats_written.append(path)

    for kind in MODES[mode]:
        lines = []
        for dataset, tasks in loaded:
            if dataset.spec.type != kind:
                continue
            for row in tasks.rows:
                if "agent_ref" not in row:
                    row = {**row, "agent_ref": {"name": dataset.server}}
                lines += [json.dumps(row, ensure_ascii=False)] * dataset.spec.num_repeats
        if lines:
            output = output_dir / f"{kind}.jsonl"
            _write_atomically(output, "\n".join(lines) + "\n")
            done.outputs[kind] = (output, len(lines))
    return done
