"""A task in Harbor's task-folder format, read for a sandbox without a container image.

    my-task/
      task.toml          Harbor's TaskConfig: [task] name, [agent] / [verifier] timeout_sec,
                         [environment] workdir, env ...
      instruction.md     what the agent is told
      environment/       files laid into the working directory before the agent starts;
        setup.sh         optional: run there once, then removed (in place of a Dockerfile's RUN lines)
      solution/solve.sh  the reference solution (copied to /solution)
      tests/test.sh      run after the agent stops (copied to /tests only then); writes the reward
                         to /logs/verifier/reward.txt (or reward.json)

The fields are Harbor's (harbor.models.task.config.TaskConfig, schema 1.4). The
`harbor` package (0.25) needs Python 3.12 and gym-grpc runs on 3.11, so this reads
task.toml with tomllib; CI loads every bundled task with Harbor's own `Task` too and
compares the two (.ci/harbor_check).
What a sandbox of this machine cannot give is refused with the reason, never
run wrongly: a container image (environment/Dockerfile, docker-compose.yaml,
[environment] docker_image), GPUs or TPUs, Windows, multi-step tasks.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_grpc import errors

#: What in environment/ asks for a container image.
IMAGE_FILES = ("Dockerfile", "docker-compose.yaml", "docker-compose.yml", "singularity-compose.yaml")
SETUP_SCRIPT = "setup.sh"
#: The most bytes of a task's files (environment, tests, solution) read.
MAX_TASK_BYTES = 16 << 20


def _files(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple[bytes, int]]:
    """Every file under `root` by its path relative to it, with its permission bits."""
    found: dict[str, tuple[bytes, int]] = {}
    if not root.is_dir():
        return found
    total = 0
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root).as_posix()
        if path.is_file() and relative not in skip:
            data = path.read_bytes()
            total += len(data)
            if total > MAX_TASK_BYTES:
                raise errors.ConfigError(
                    f"task {root.parent.name}: its files hold more than {MAX_TASK_BYTES >> 20} MiB"
                )
            found[relative] = (data, path.stat().st_mode & 0o777)
    return found


@dataclass(frozen=True)
class HarborTask:
    name: str
    instruction: str
    workdir: str
    agent_timeout: float | None
    verifier_timeout: float
    verifier_env: dict[str, str]
    environment_env: dict[str, str]
    #: environment/'s files but setup.sh, by path relative to the working directory.
    files: dict[str, tuple[bytes, int]]
    setup: bytes | None
    tests: dict[str, tuple[bytes, int]]
    solution: dict[str, tuple[bytes, int]]


def _section(config: dict[str, Any], name: str) -> dict[str, Any]:
    value = config.get(name) or {}
    if not isinstance(value, dict):
        raise errors.ConfigError(f"[{name}] must be a table")
    return value


def needs(config: dict[str, Any], folder: Path) -> list[str]:
    """What the task asks for that a sandbox without a container image cannot give."""
    environment = _section(config, "environment")
    missing = []
    if environment.get("docker_image"):
        missing.append(f"the container image {environment['docker_image']!r} ([environment] docker_image)")
    for name in IMAGE_FILES:
        if (folder / "environment" / name).exists():
            missing.append(f"a container image built from environment/{name}")
    if environment.get("gpus"):
        missing.append(f"{environment['gpus']} GPUs ([environment] gpus)")
    if environment.get("tpu"):
        missing.append("a TPU ([environment] tpu)")
    if str(environment.get("os", "linux")).lower() != "linux":
        missing.append(f"a {environment['os']} machine ([environment] os)")
    if config.get("steps"):
        missing.append("several steps ([[steps]]: multi-step tasks are not supported)")
    return missing


def load(folder: Path, workdirs: tuple[str, ...]) -> HarborTask:
    """Read a task folder; ConfigError naming the folder and what is wrong or missing."""
    where = f"task {folder.name!r} ({folder})"
    config_path = folder / "task.toml"
    if not config_path.is_file():
        raise errors.ConfigError(f"{where}: no task.toml")
    try:
        config = tomllib.loads(config_path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise errors.ConfigError(f"{where}: task.toml: {e}") from None
    missing = needs(config, folder)
    if missing:
        raise errors.ConfigError(
            f"{where} needs {'; '.join(missing)}, which this sandbox (bubblewrap on the host's system, "
            "no image) cannot give; run it with Harbor on a container runtime"
        )
    environment, agent, verifier = (_section(config, n) for n in ("environment", "agent", "verifier"))
    workdir = str(environment.get("workdir") or "/app")
    if workdir not in workdirs:
        raise errors.ConfigError(f"{where}: [environment] workdir {workdir!r} is not one of {', '.join(workdirs)}")
    instruction = folder / "instruction.md"
    test = folder / "tests" / "test.sh"
    for required in (instruction, test):
        if not required.is_file():
            raise errors.ConfigError(f"{where}: no {required.relative_to(folder)}")
    setup = folder / "environment" / SETUP_SCRIPT
    task = _section(config, "task")
    return HarborTask(
        name=str(task.get("name") or folder.name),
        instruction=instruction.read_text(),
        workdir=workdir,
        agent_timeout=agent.get("timeout_sec"),
        verifier_timeout=float(verifier.get("timeout_sec", 600.0)),
        verifier_env={str(k): str(v) for k, v in (verifier.get("env") or {}).items()},
        environment_env={str(k): str(v) for k, v in (environment.get("env") or {}).items()},
        files=_files(folder / "environment", skip=(SETUP_SCRIPT,)),
        setup=setup.read_bytes() if setup.is_file() else None,
        tests=_files(folder / "tests"),
        solution=_files(folder / "solution"),
    )
