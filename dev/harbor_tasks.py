"""Check the terminal environment's bundled tasks with Harbor's own task loader (CI: .ci/harbor_check).

    PY312 dev/harbor_tasks.py dump > harbor.json   # with harbor installed (it needs Python 3.12)
    python dev/harbor_tasks.py compare harbor.json # gym-grpc's reader (servers/resources/terminal/harbor_task.py)

`dump` loads every task folder with harbor.models.task.task.Task (its TaskConfig validation and its check
that tests/test.sh exists) and prints what gym-grpc reads of each; `compare` reads the same folders with
gym-grpc's own reader and exits 1 on any difference, naming the task and the field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TASKS = Path(__file__).resolve().parent.parent / "servers" / "resources" / "terminal" / "tasks"
FIELDS = ("name", "instruction", "workdir", "agent_timeout", "verifier_timeout", "verifier_env", "environment_env")


def dump() -> dict[str, dict]:
    from harbor.models.task.task import Task

    found = {}
    for folder in sorted(p for p in TASKS.iterdir() if (p / "task.toml").is_file()):
        task = Task(folder)
        config = task.config
        found[folder.name] = {
            "name": task.name,
            "instruction": task.instruction,
            "workdir": config.environment.workdir or "/app",
            "agent_timeout": config.agent.timeout_sec,
            "verifier_timeout": config.verifier.timeout_sec,
            "verifier_env": dict(config.verifier.env),
            "environment_env": dict(config.environment.env),
        }
    return found


def compare(path: str) -> int:
    from gym_grpc.bundled.servers.resources.terminal import harbor_task
    from gym_grpc.bundled.servers.resources.terminal.server import TerminalEnv

    harbor = json.loads(Path(path).read_text())
    ours_names = sorted(p.name for p in TASKS.iterdir() if (p / "task.toml").is_file())
    problems = (
        [f"task folders differ: harbor {sorted(harbor)}, gym-grpc {ours_names}"] if sorted(harbor) != ours_names else []
    )
    for name, theirs in harbor.items():
        task = harbor_task.load(TASKS / name, TerminalEnv.sandbox_dirs)
        for field in FIELDS:
            mine = getattr(task, field)
            if mine != theirs[field]:
                problems.append(f"{name}: {field}: harbor {theirs[field]!r}, gym-grpc {mine!r}")
    for problem in problems:
        print(problem, file=sys.stderr)
    print(f"{len(harbor)} tasks loaded by Harbor's Task; {len(problems)} differences from gym-grpc's reader")
    return 1 if problems else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["dump"]:
        json.dump(dump(), sys.stdout, indent=1)
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 3:
        sys.exit(compare(sys.argv[2]))
    else:
        sys.exit(__doc__)
