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

    # address="local": a Ray of the tests' own, not another one running on this machine.
    ray.init(address="local", num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def openenv() -> Any:
    """The real OpenEnv (tests/openenv_support.py): its own virtualenv and the echo env its template makes,
    built once per machine (~30 s) and cached."""
    from tests import openenv_support

    return openenv_support.prepare()


@pytest.fixture(scope="session")
def openenv_echo(openenv: Any) -> Iterator[Any]:
    """OpenEnv's echo env served by OpenEnv's own server, a child process for the whole session."""
    from tests import openenv_support

    server = openenv_support.OpenEnvServer(openenv.echo_command(), openenv.envs)
    yield server
    server.stop()


#: Suites that need something the default run does not start, each behind its option: without
#: it their tests are deselected (never skipped), with it a skip fails the run.
OPT_IN = {
    "real_engine": "--real-engine",  # the local CPU vLLM (gym_grpc.engines.local_vllm)
    "ray_cluster": "--ray-cluster",  # a Ray cluster of several real nodes on this machine (ray.cluster_utils)
    "trainers": "--trainers",  # TRL and tinker-cookbook on CPU torch (tests/trainers/run installs them)
    "browser": "--browser",  # Debian's chromium (apt-get install chromium), driven by Playwright
}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--real-engine",
        action="store_true",
        help="run the tests marked real_engine against a local CPU vLLM (prepared and started by the tests)",
    )
    parser.addoption(
        "--lane",
        choices=("http", "other"),
        help="with --real-engine: only the tests that generate on the session's HTTP engine (http), or only "
        "the others (other); CI runs the two side by side (tests/real_engine/conftest.py)",
    )
    parser.addoption(
        "--ray-cluster",
        action="store_true",
        help="run the tests marked ray_cluster on a Ray cluster of several nodes started by the tests",
    )
    parser.addoption(
        "--browser",
        action="store_true",
        help="run the tests marked browser in headless Chromium (Debian's chromium package, installed beforehand)",
    )
    parser.addoption(
        "--trainers",
        action="store_true",
        help="run the tests marked trainers (TRL, tinker-cookbook, torch: installed by tests/trainers/run)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without its option, deselect (never skip) an opt-in suite's tests; with it, insist there are some.

    Deselected tests show in pytest's summary line; a run that asks for a
    suite and finds none fails, so a CI job that asks for the real engine
    cannot pass by testing nothing.
    """
    for marker, option in OPT_IN.items():
        marked = [item for item in items if item.get_closest_marker(marker)]
        if config.getoption(option):
            if not marked:
                raise pytest.UsageError(f"{option} given but no test marked {marker} was collected")
            continue
        if marked:
            config.hook.pytest_deselected(items=marked)
            items[:] = [item for item in items if not item.get_closest_marker(marker)]


_skipped_opt_in_tests: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and any(marker in report.keywords for marker in OPT_IN):
        _skipped_opt_in_tests.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped opt-in test fails a run that asked for its suite: CI asked for it, so it must be tested."""
    asked = [option for option in OPT_IN.values() if session.config.getoption(option)]
    if asked and _skipped_opt_in_tests:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(
                f"{' '.join(asked)}: {len(_skipped_opt_in_tests)} test(s) skipped, which fails the run: "
                + ", ".join(_skipped_opt_in_tests),
                red=True,
            )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
