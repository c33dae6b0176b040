"""The local CPU vLLM for the real_engine tests: prepared (cached), started once per session, stopped after.

Run them with `pytest --real-engine tests/real_engine`. The first run builds
the engine's virtualenv and model under GYM_GRPC_ENGINE_CACHE (about 2
minutes and 3.5 GB); later runs reuse them. Any failure to prepare or start is
an error of every test that needs the engine, never a skip.

To iterate on the tests without starting vLLM each time, start it once
(`python -m gym_grpc.engines.local_vllm start`) and give its base URL in
GYM_GRPC_REAL_ENGINE_URL; the tests then use it and leave it running.

The token-path tests run on both of vLLM's servers (`policy`): the HTTP one and its
gRPC one (`grpc_engine`, `start --grpc`, GYM_GRPC_REAL_GRPC_ENGINE_URL to reuse one),
the same model; the HTTP engine's /tokenize and /detokenize check what the model
server renders and decodes for the gRPC one.

`--lane http` runs only the tests that generate on the HTTP engine, `--lane other` the rest (`_lane`
below). With engines given by URL, .ci/run runs the two lanes as two pytest processes side by side,
so that each lane's engine generates on a core of its own; without engines given, each lane would
start the ones it uses.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

from gym_grpc.engines import local_vllm
from gym_grpc.engines.local_vllm.installation import MODEL_NAME
from tests.otlp import Receiver, grpc_receiver

#: What a traced vLLM reads from its environment: its name in traces, and a short batch delay.
TRACED_ENGINE_ENV = {"OTEL_SERVICE_NAME": "vllm", "OTEL_BSP_SCHEDULE_DELAY": "200"}


@contextlib.contextmanager
def traced_vllm(receiver: Receiver, log_path: Path, **options: object) -> Iterator[local_vllm.Engine]:
    """The local CPU vLLM, sending the spans of its requests to `receiver` (--otlp-traces-endpoint)."""
    with contextlib.ExitStack() as stack:
        with mock.patch.dict(os.environ, TRACED_ENGINE_ENV):  # the process takes its environment when it starts
            engine = stack.enter_context(
                local_vllm.running(
                    log_path=log_path, extra_args=["--otlp-traces-endpoint", receiver.endpoint], **options
                )
            )
        yield engine


def _given_http(variable: str, tmp_path_factory: pytest.TempPathFactory) -> local_vllm.Engine | None:
    """The running HTTP engine whose base URL `variable` gives (its model asked of it), or None."""
    given = os.environ.get(variable)
    if not given:
        return None
    with urllib.request.urlopen(f"{given.rstrip('/')}/models", timeout=10) as reply:
        model = json.loads(reply.read())["data"][0]["id"]
    return local_vllm.Engine(given.rstrip("/"), pid=0, log_path=tmp_path_factory.mktemp("none"), model=model)


#: The port of the OTLP receiver that an engine given by URL was started to send its spans to
#: (`local_vllm start --otlp-traces-endpoint http://127.0.0.1:PORT`, as .ci/run does).
TRACES_PORT_VARIABLE = "GYM_GRPC_REAL_ENGINE_TRACES_PORT"


@pytest.fixture(scope="session")
def engine_traces() -> Iterator[Receiver]:
    """The OTLP receiver that the session's engine sends its requests' spans to (test_traces.py): on the
    port TRACES_PORT_VARIABLE names, for an engine given by URL, else on a free one."""
    with grpc_receiver(int(os.environ.get(TRACES_PORT_VARIABLE, "0"))) as receiver:
        yield receiver


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_vllm.Engine]:
    """The HTTP engine: the one GYM_GRPC_REAL_ENGINE_URL gives, else one started for the session and
    sending its spans to `engine_traces` (asked for only then: with two lanes, only the lane of
    test_traces.py may bind the receiver's port that .ci/run gives)."""
    given = _given_http("GYM_GRPC_REAL_ENGINE_URL", tmp_path_factory)
    if given is not None:
        yield given
        return
    receiver = request.getfixturevalue("engine_traces")
    prepared = local_vllm.prepare()
    log_path = tmp_path_factory.mktemp("vllm") / "vllm.log"
    with traced_vllm(receiver, log_path, prepared=prepared) as running:
        yield running


@pytest.fixture(scope="session")
def vision_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_vllm.Engine]:
    """The vision-language model served by the local CPU vLLM (`start --vision`, or
    GYM_GRPC_REAL_VISION_ENGINE_URL to reuse one): tests/real_engine/test_vision.py."""
    given = _given_http("GYM_GRPC_REAL_VISION_ENGINE_URL", tmp_path_factory)
    if given is not None:
        yield given
        return
    prepared = local_vllm.prepare(vision=True)
    with local_vllm.running(prepared, log_path=tmp_path_factory.mktemp("vllm-vision") / "vllm.log") as running:
        yield running


@pytest.fixture(scope="session")
def grpc_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_vllm.Engine]:
    """The local CPU vLLM's gRPC server (base_url grpc://127.0.0.1:PORT), as `engine` is its HTTP one."""
    given = os.environ.get("GYM_GRPC_REAL_GRPC_ENGINE_URL")
    if given:
        yield local_vllm.Engine(given, pid=0, log_path=tmp_path_factory.mktemp("none"), model=MODEL_NAME)
        return
    prepared = local_vllm.prepare()
    log_path = tmp_path_factory.mktemp("vllm-grpc") / "vllm.log"
    with local_vllm.running(prepared, log_path=log_path, grpc=True) as running:
        yield running


@pytest.fixture(params=["http", "grpc"])
def policy(request: pytest.FixtureRequest) -> local_vllm.Engine:
    """The engine a token-path test's model server talks to: vLLM's HTTP server, then its gRPC one."""
    return request.getfixturevalue("engine" if request.param == "http" else "grpc_engine")


#: Test files whose tests generate elsewhere than on the session's HTTP engine: on the vision engine,
#: or on engines they start (and stop) themselves.
_ELSEWHERE = ("test_vision.py", "test_engine_restart.py", "test_engine_cli.py")


def _lane(nodeid: str) -> str:
    """The lane of a test: "http" when it generates on the session's HTTP engine; "other" when it
    generates on the gRPC engine (a `[grpc]` case), the vision engine or an engine of its own. (The
    HTTP engine's /tokenize and /detokenize, which some of the others read for reference, generate
    nothing.)"""
    path, _, name = nodeid.partition("::")
    return "other" if "[grpc]" in name or path.rsplit("/", 1)[-1] in _ELSEWHERE else "http"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--lane NAME`: only the real-engine tests of that lane.

    The local vLLM generates on one thread in its engine core (gym_grpc/engines/local_vllm/process.py),
    so on two cores the two lanes, run side by side, each have an engine generating on a core of its
    own, and their generations do not queue behind each other. Within a lane the tests run one at a
    time, in order: the tests that count an engine's requests, reload its weights or restart one still
    have their engine to themselves."""
    lane = config.getoption("lane")
    if lane is None:
        return
    kept: list[pytest.Item] = []
    elsewhere: list[pytest.Item] = []
    for item in items:
        (elsewhere if item.get_closest_marker("real_engine") and _lane(item.nodeid) != lane else kept).append(item)
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = kept
