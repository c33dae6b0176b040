"""One failure model: every error has a reason, documented, and sent in an ErrorInfo a client in
any language can branch on."""

import ast
import re
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

import gym_grpc
from gym_grpc import errors
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.rpc.registry import Registry
from gym_grpc.rpc.transport import open_channel
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from tests.support import Calculator, static_registry, task

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "errors.md"
_ROW = re.compile(r"^\| `([A-Z][A-Z0-9_]*)` \| (`[A-Z_]+`|—) \|", re.MULTILINE)


def _documented() -> dict[str, str | None]:
    return {m[1]: (None if m[2] == "—" else m[2].strip("`")) for m in _ROW.finditer(DOC.read_text())}


def test_every_reason_is_documented_with_its_status_and_nothing_else_is():
    documented = _documented()
    defined = {reason.value: (reason.status.name if reason.status else None) for reason in errors.Reason}
    assert set(defined) - set(documented) == set(), "reasons missing from docs/errors.md"
    assert set(documented) - set(defined) == set(), "docs/errors.md lists reasons the code no longer has"
    assert documented == defined  # and each with the status the code gives it
    assert all(reason.name == reason.value for reason in errors.Reason)  # reason_of looks reasons up by name


def _error_classes() -> list[type]:
    seen, todo = [], [errors.FrameworkError]
    while todo:
        cls = todo.pop()
        seen.append(cls)
        todo.extend(cls.__subclasses__())
    return seen


def test_every_error_class_of_the_framework_has_a_reason_whose_status_is_its_code():
    import gym_grpc.data.jsonl
    import gym_grpc.data.rows
    import gym_grpc.datasets.hub
    import gym_grpc.datasets.mlflow_store
    import gym_grpc.datasets.prepare
    import gym_grpc.engines.http
    import gym_grpc.engines.local_vllm
    import gym_grpc.launch.runner
    import gym_grpc.report.export
    import gym_grpc.training.samples  # noqa: F401  (imported for their error classes)

    classes = _error_classes()
    names = {c.__name__ for c in classes}
    for expected in ("ConfigError", "OutputError", "RolloutFailed", "PrepareError", "RunFileError", "EngineStartError"):
        assert expected in names
    for expected in ("DataError", "StartupError", "HubError", "TooDeep", "DuplicateKey", "RowError", "EngineError"):
        assert expected in names
    for expected in ("MlflowError", "ExportError", "NonMonotonic"):
        assert expected in names
    for cls in classes:
        assert isinstance(cls.reason, errors.Reason), cls
        if issubclass(cls, errors.GymError) and cls.reason.status is not None:
            assert cls.reason.status == cls.code, cls


def test_errors_that_callers_caught_as_builtin_errors_still_are():
    from gym_grpc.data import json_input, jsonl
    from gym_grpc.engines.local_vllm import EngineStartError, PrepareError, RunFileError
    from gym_grpc.launch.runner import StartupError

    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(json_input.TooDeep, ValueError)
    assert issubclass(jsonl.DuplicateKey, ValueError)
    for cls in (StartupError, EngineStartError, PrepareError, RunFileError):
        assert issubclass(cls, RuntimeError)


#: Exception classes that signal something other than an error, and why they stay outside the catalogue.
NOT_ERRORS = {"CheckSkipped": "a conformance check saying it has nothing to check here, as pytest.skip does"}


def _framework_exception_classes_not_in_the_catalogue() -> list[str]:
    """Exception classes defined in gym_grpc whose bases do not lead to FrameworkError."""
    known = {c.__name__ for c in _error_classes()} | set(NOT_ERRORS)
    out = []
    for path in Path(gym_grpc.__file__).parent.rglob("*.py"):
        if "v1" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef) or node.name in known or node.name.startswith("_"):
                continue
            bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
            if bases & {"Exception", "ValueError", "RuntimeError", "BaseException"}:
                out.append(f"{path.name}:{node.name}")
    return out


def test_no_public_exception_class_of_the_framework_stands_outside_the_catalogue():
    test_every_error_class_of_the_framework_has_a_reason_whose_status_is_its_code()  # imports them all
    assert _framework_exception_classes_not_in_the_catalogue() == []


def _error_info(error: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(error)
    assert status is not None, "no google.rpc.Status in the trailers"
    infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    assert len(infos) == 1
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    return info


async def test_a_raw_grpc_client_branches_on_the_error_info_reason(start):
    server = await start(Calculator())
    async with open_channel(server.address) as channel:
        stub = res_grpc.ResourcesServiceStub(channel)
        await stub.SeedSession(res_pb.SeedSessionRequest(session_id="s1", task=task("2 + 3?", expected_answer=5)))
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await stub.CallTool(res_pb.CallToolRequest(session_id="s1", name="subtract", arguments="{}"))
        with pytest.raises(grpc.aio.AioRpcError) as not_open:
            await stub.CallTool(res_pb.CallToolRequest(session_id="nobody", name="add", arguments="{}"))
        with pytest.raises(grpc.aio.AioRpcError) as bad_arguments:
            await stub.CallTool(res_pb.CallToolRequest(session_id="s1", name="add", arguments="{a: 1"))
    info = _error_info(unknown.value)
    assert (info.domain, info.reason, dict(info.metadata)) == ("gym-grpc.dev", "TOOL_NOT_FOUND", {"tool": "subtract"})
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    assert _error_info(not_open.value).reason == "SESSION_NOT_OPEN"
    info = _error_info(bad_arguments.value)
    assert (info.reason, info.metadata["tool"]) == ("TOOL_ARGUMENTS_INVALID", "add")
    assert errors.field_of(bad_arguments.value) == "arguments"  # the BadRequest is still there


async def test_a_bug_is_internal_with_a_reason_and_without_its_detail(start):
    class Buggy(Calculator):
        async def aggregate_metrics(self, results):
            raise KeyError("secret internal detail")

    server = await start(Buggy(name="buggy"))
    async with open_channel(server.address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await res_grpc.ResourcesServiceStub(channel).AggregateMetrics(res_pb.AggregateMetricsRequest())
    assert error.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in error.value.details()
    info = _error_info(error.value)
    assert (info.reason, dict(info.metadata)) == ("INTERNAL_ERROR", {"method": "AggregateMetrics", "server": "buggy"})


async def test_the_python_client_reads_the_reason_back(start):
    server = await start(Calculator(name="calc"))
    client = ResourcesClient(static_registry(calc=server), "calc")
    try:
        with pytest.raises(errors.FailedPrecondition) as error:
            await client.call_tool("never-seeded", r.FunctionCall(name="add", arguments='{"a": 1, "b": 2}'))
        assert error.value.reason == errors.Reason.SESSION_NOT_OPEN
        assert error.value.field == "session_id"
        assert error.value.metadata == {"callee": "calc", "callee_method": "CallTool"}
        with pytest.raises(errors.InvalidArgument) as error:
            await client.seed_session("", task("x"))
        assert error.value.reason == errors.Reason.REQUEST_INVALID
    finally:
        await client.registry.close()


async def test_a_dead_peer_without_error_info_is_peer_unavailable():
    client = ResourcesClient(Registry(static={"gone": "127.0.0.1:1"}), "gone", timeout=5)
    try:
        with pytest.raises(errors.Unavailable) as error:
            await client.describe_tools()
        assert error.value.reason == errors.Reason.PEER_UNAVAILABLE
    finally:
        await client.registry.close()
