"""The servers and configs that come with gym-grpc: models, the simple agent,
the example environments, and ready-to-run configs (the quickstart among them).

In a checkout they are the repository's top-level `servers/` and `configs/`.
A wheel carries the same two directories here, as `gym_grpc.bundled.servers`
and `gym_grpc.bundled.configs` (setup.py maps them; the servers' tests stay
behind), so an installed gym-grpc runs the quickstart without a checkout and
claims no top-level name but `gym_grpc`. The layout inside is the same either
way, so the configs' relative entrypoints (`../servers/...`) hold in both.

A config outside this tree names a bundled server by module, which works from a
wheel and from an editable install alike:
`gym_grpc.bundled.servers.agents.simple_agent.agent:SimpleAgent`.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent


def root() -> Path:
    """The directory that holds `servers/` and `configs/`: this package's own in an
    installed wheel, the repository's root in a checkout (an editable install)."""
    return _HERE if (_HERE / "configs").is_dir() else _HERE.parents[1]


def config(name: str) -> Path:
    """A bundled config file, such as `quickstart.yaml`."""
    return root() / "configs" / name


def server_dir(*parts: str) -> Path:
    """A bundled server's directory, such as `server_dir("resources", "weather")`."""
    return root() / "servers" / Path(*parts)


def shown(path: Path) -> str:
    """`path` as a user would type it here: relative to the working directory when under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
