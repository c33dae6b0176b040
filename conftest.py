"""Fixtures for every test, in tests/ and next to the servers."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

# The testing kit's fixtures (`start`, `fake_engine`), as an environment's own tests enable them.
pytest_plugins = ["gym_grpc.testing.plugin"]


@pytest.fixture(scope="session")
def local_ray() -> Iterator[Any]:
    """A local Ray for the whole session (it takes seconds to start); Ray is in the test extras."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--real-engine",
        action="store_true",
        help="run the tests marked real_engine against a local CPU vLLM (prepared and started by the tests)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without --real-engine, deselect (never skip) the real_engine tests; with it, insist there are some.

    Deselected tests show in pytest's summary line; a --real-engine run that
    finds none fails, so a CI job that asks for the real engine cannot pass by
    testing nothing.
    """
    real = [item for item in items if item.get_closest_marker("real_engine")]
    if config.getoption("--real-engine"):
        if not real:
            raise pytest.UsageError("--real-engine given but no test marked real_engine was collected")
        return
    if real:
        config.hook.pytest_deselected(items=real)
        items[:] = [item for item in items if not item.get_closest_marker("real_engine")]


_skipped_real_engine_tests: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "real_engine" in report.keywords:
        _skipped_real_engine_tests.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With --real-engine a skipped real_engine test fails the run: CI asked for the engine, so it must be tested."""
    if session.config.getoption("--real-engine") and _skipped_real_engine_tests:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"--real-engine: {len(_skipped_real_engine_tests)} real_engine test(s) skipped, which fails the run: "
                + ", ".join(_skipped_real_engine_tests),
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
