"""The testing kit: what an environment's or an agent's own tests need.

- `ResourcesConformance`, `AgentConformance`: the conformance suites as pytest
  classes to subclass; `example_rows` checks an environment's example data.
- `serving(app)`, `Servers`, `static_registry`: servers in the test's process
  on 127.0.0.1 port 0, stopped when the block ends; the pytest plugin
  `gym_grpc.testing.plugin` gives the same as a `start` fixture.
- `FakeEngine`, `EngineTurn`: an OpenAI-compatible inference engine (a real
  HTTP server) whose model follows a script, for model servers and agents.
- `ScriptedModel`, `call`, `say`, `Calculator`, `calculator_task`: a scripted
  model server and a small environment to run an agent against.
- `run_checks(address)`: the conformance checks against any running server,
  as `gym-grpc conformance HOST:PORT` runs them.
- `GymRun`, `gym_grpc_command`: a real `gym-grpc run` process, started and waited
  for through its `--ready-json` line, for tests of what a user runs.

Only the conformance classes need pytest (and pytest-asyncio); the rest does not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from gym_grpc.testing.checks import CheckFailed, CheckSkipped, Outcome, Report, run_checks
    from gym_grpc.testing.conformance import AgentConformance, ResourcesConformance, example_rows
    from gym_grpc.testing.doubles import Calculator, ScriptedModel, calculator_task, call, say
    from gym_grpc.testing.fake_engine import FakeEngine
    from gym_grpc.testing.fake_engine import Turn as EngineTurn
    from gym_grpc.testing.processes import GymRun, gym_grpc_command
    from gym_grpc.testing.servers import Servers, serving, static_registry

#: Where each name lives; a module loads on first use of one of its names, so that
#: `gym-grpc conformance` needs neither pytest nor the fake engine's aiohttp app.
_HOMES = {
    "AgentConformance": "conformance",
    "ResourcesConformance": "conformance",
    "example_rows": "conformance",
    "CheckFailed": "checks",
    "CheckSkipped": "checks",
    "Outcome": "checks",
    "Report": "checks",
    "run_checks": "checks",
    "Calculator": "doubles",
    "ScriptedModel": "doubles",
    "calculator_task": "doubles",
    "call": "doubles",
    "say": "doubles",
    "FakeEngine": "fake_engine",
    "EngineTurn": "fake_engine",
    "GymRun": "processes",
    "gym_grpc_command": "processes",
    "Servers": "servers",
    "serving": "servers",
    "static_registry": "servers",
}

__all__ = [
    "AgentConformance",
    "Calculator",
    "CheckFailed",
    "CheckSkipped",
    "EngineTurn",
    "FakeEngine",
    "GymRun",
    "Outcome",
    "Report",
    "ResourcesConformance",
    "ScriptedModel",
    "Servers",
    "calculator_task",
    "call",
    "example_rows",
    "gym_grpc_command",
    "run_checks",
    "say",
    "serving",
    "static_registry",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(f"{__name__}.{home}")
    return getattr(module, "Turn" if name == "EngineTurn" else name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
