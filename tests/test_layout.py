"""The package's layout is its architecture: layers import downwards only."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import gym_grpc

PACKAGE = Path(gym_grpc.__file__).parent

# Which folders each folder may import from (besides the top-level modules and v1).
# docs/architecture.md draws the same picture.
MAY_IMPORT = {
    "data": set(),
    "rpc": set(),
    "server": {"rpc", "data"},
    "client": {"rpc", "server", "data"},
    "engines": {"rpc", "server", "data"},
    "batch": {"rpc", "server", "client", "data"},
    "testing": {"rpc", "server", "data"},
    "report": {"data"},
    "training": {"client", "data"},
    "judge": {"rpc", "client", "data"},
    "adapters": {"rpc", "client", "data", "training", "bundled"},
    "launch": {"rpc", "server", "data"},
    "datasets": {"rpc", "server", "data", "launch"},
    "cli": {
        *("rpc", "server", "client", "data", "batch", "engines", "testing", "report", "training", "launch", "datasets"),
    },
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if "v1" in parts:
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every gym_grpc module `path` imports, at any depth (functions and TYPE_CHECKING blocks included)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gym_grpc"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("gym_grpc"))
    return {name for name in out if name in known}


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {name: _imports(path, modules) - {name} for name, path in modules.items()}
    state: dict[str, str] = {}
    cycles = []

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                cycles.append(" -> ".join(path[path.index(other) :] + [name, other]))
            elif other not in state:
                visit(other, [*path, name])
        state[name] = "done"

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert cycles == []


def test_each_folder_imports_only_the_layers_below_it():
    modules = _modules()
    wrong = []
    for name, path in modules.items():
        parts = name.split(".")
        folder = parts[1] if len(parts) > 2 or (len(parts) == 2 and path.name == "__init__.py") else None
        if folder not in MAY_IMPORT:
            continue
        for other in _imports(path, modules):
            theirs = other.split(".")[1] if len(other.split(".")) > 2 else None
            if theirs in MAY_IMPORT and theirs != folder and theirs not in MAY_IMPORT[folder]:
                wrong.append(f"{name} imports {other}")
    assert wrong == []


def test_importing_the_worker_leaves_the_importers_stdout_alone():
    """Only the worker's main() takes stdout for its reports; importing the module must not."""
    done = subprocess.run(
        [sys.executable, "-c", "import gym_grpc.server.worker; print('still on stdout')"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "still on stdout\n"


def test_a_bundled_server_has_one_name_whether_a_config_names_its_file_or_its_module():
    """A config's `../servers/agents/simple_agent/agent.py:SimpleAgent` and the module name reach one class."""
    from gym_grpc import bundled
    from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
    from gym_grpc.server.entrypoints import load_entrypoint

    by_file = load_entrypoint(f"{bundled.server_dir('agents', 'simple_agent') / 'agent.py'}:SimpleAgent")
    by_module = load_entrypoint("gym_grpc.bundled.servers.agents.simple_agent.agent:SimpleAgent")
    assert by_file is by_module is SimpleAgent


def test_every_folder_of_python_modules_is_a_package_that_a_wheel_takes():
    """setup.py's find_packages takes folders with an __init__.py only: one without works in a
    checkout (a namespace package) and is missing from the wheel."""
    missing = sorted(
        str(folder.relative_to(PACKAGE.parent))
        for folder in {path.parent for path in PACKAGE.rglob("*.py")}
        if not (folder / "__init__.py").exists()
    )
    assert missing == []
