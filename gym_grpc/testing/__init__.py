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

Only the conformance classes need pytest (and pytest-asyncio); the rest does not.
"""

from __future__ import annotations

from typing import Any

from gym_grpc.testing.checks import CheckFailed, CheckSkipped, Outcome, Report, run_checks
from gym_grpc.testing.doubles import Calculator, ScriptedModel, calculator_task, call, say
from gym_grpc.testing.fake_engine import FakeEngine
from gym_grpc.testing.fake_engine import Turn as EngineTurn
from gym_grpc.testing.servers import Servers, serving, static_registry

_NEED_PYTEST = {"ResourcesConformance", "AgentConformance", "example_rows"}

__all__ = [
    "AgentConformance",
    "Calculator",
    "CheckFailed",
    "CheckSkipped",
    "EngineTurn",
    "FakeEngine",
    "Outcome",
    "Report",
    "ResourcesConformance",
    "ScriptedModel",
    "Servers",
    "calculator_task",
    "call",
    "example_rows",
    "run_checks",
    "say",
    "serving",
    "static_registry",
]


def __getattr__(name: str) -> Any:
    """The pytest classes load on first use, so that `gym-grpc conformance` runs without pytest."""
    if name in _NEED_PYTEST:
        from gym_grpc.testing import conformance

        return getattr(conformance, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
