"""Bad input, at the gRPC edge and in task files: each gets a clear error that
names the field or line, and nothing else is lost."""

import io
import json
import subprocess
import sys

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.data import json_input
from gym_grpc.data.jsonl import failures_path
from gym_grpc.launch.runner import RegistryServer
from gym_grpc.rpc import transport
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import model_service_pb2_grpc as model_grpc
from gym_grpc.v1 import registry_service_pb2 as reg_pb
from gym_grpc.v1 import registry_service_pb2_grpc as reg_grpc
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from tests.support import (
    MATH,
    Calculator,
    EchoModel,
    call,
    collect_args,
    gym,
    gym_grpc_command,
    nested_json,
    start_run,
    static_registry,
    task,
)


def _params(*items: r.Item) -> r.CreateParams:
    return r.CreateParams(input_items=r.ItemList(items=list(items)))


def _user(text: str = "hi") -> r.Item:
    return r.Item(message=r.Message(role=r.ROLE_USER, text=text))


def _bad_log_probs() -> r.Item:
    item = call("add", "{}")
    item.function_call.generation_token_ids.extend([1, 2])
    item.function_call.generation_log_probs.extend([-0.5])
    return item


# (service, method, request, expected code, field named in the BadRequest detail)
CASES = [
    ("agent", "Run", agent_pb.RunRequest(), grpc.StatusCode.INVALID_ARGUMENT, "task.responses_create_params.input"),
    (
        "agent",
        "Run",
        agent_pb.RunRequest(task=task_pb2.Task(responses_create_params=_params(r.Item()))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "task.responses_create_params.input_items.items[0]",
    ),
    (
        "agent",
        "Run",
        agent_pb.RunRequest(task=task_pb2.Task(responses_create_params=_params(r.Item(message=r.Message(text="x"))))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "task.responses_create_params.input_items.items[0].message.role",
    ),
    (
        "model",
        "CreateResponse",
        model_pb.CreateResponseRequest(params=_params(_user(), r.Item(function_call=r.FunctionCall(arguments="{}")))),
        grpc.StatusCode.INVALID_ARGUMENT,
        "params.input_items.items[1].function_call.name",
    ),
    (
        "model",
        "CreateResponse",
        model_pb.CreateResponseRequest(params=_params(_user(), _bad_log_probs())),
        grpc.StatusCode.INVALID_ARGUMENT,
        "params.input_items.items[1].function_call.generation_log_probs",
    ),
    (
        "model",
        "CreateResponse",
        model_pb.CreateResponseRequest(params=r.CreateParams(input_text="x", temperature=-1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "params.temperature",
    ),
    (
        "model",
        "CreateResponse",
        model_pb.CreateResponseRequest(params=r.CreateParams(input_text="x", tools=[r.Tool()])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "params.tools[0]",
    ),
    (
        "model",
        "CreateResponse",
        model_pb.CreateResponseRequest(
            params=r.CreateParams(input_text="x", tools=[r.Tool(function=r.FunctionTool(parameters_json="{}"))])
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "params.tools[0].function.name",
    ),
    (
        "resources",
        "CallTool",
        res_pb.CallToolRequest(session_id="s", name="subtract", arguments="{}"),
        grpc.StatusCode.NOT_FOUND,
        "name",
    ),
    (
        "resources",
        "CallTool",
        res_pb.CallToolRequest(session_id="s", name="add", arguments="{1: 2}"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "arguments",
    ),
    (
        "resources",
        "CallTool",
        res_pb.CallToolRequest(session_id="s", name="add", arguments='{"a": [], "b": 1}'),
        grpc.StatusCode.INVALID_ARGUMENT,
        "arguments",
    ),
    (
        "resources",
        "CallTool",
        res_pb.CallToolRequest(session_id="s", arguments="{}"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "name",
    ),
    (
        "resources",
        "CallTool",
        res_pb.CallToolRequest(session_id="never-seeded", name="add", arguments="{}"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "session_id",
    ),
    ("resources", "SeedSession", res_pb.SeedSessionRequest(), grpc.StatusCode.INVALID_ARGUMENT, "session_id"),
    (
        "resources",
        "Verify",
        res_pb.VerifyRequest(response=r.Response(output=[r.Item()])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "response.output[0]",
    ),
    (
        "resources",
        "AggregateMetrics",
        res_pb.AggregateMetricsRequest(results=[task_pb2.VerificationResult(fields_json="[1")]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "fields_json",
    ),
    ("registry", "GetServer", reg_pb.GetServerRequest(), grpc.StatusCode.INVALID_ARGUMENT, "name"),
    ("registry", "GetServer", reg_pb.GetServerRequest(name="nobody"), grpc.StatusCode.NOT_FOUND, "name"),
]


@pytest.fixture
async def servers(start):
    model = await start(EchoModel())
    calc = await start(Calculator())
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=static_registry(model=model, calc=calc),
        )
    )
    registry = await start(RegistryServer())
    stubs = {
        "agent": agent_grpc.AgentServiceStub,
        "model": model_grpc.ModelServiceStub,
        "resources": res_grpc.ResourcesServiceStub,
        "registry": reg_grpc.RegistryServiceStub,
    }
    addresses = {
        "agent": agent.address,
        "model": model.address,
        "resources": calc.address,
        "registry": registry.address,
    }
    channels = {name: transport.open_channel(address) for name, address in addresses.items()}
    await stubs["resources"](channels["resources"]).SeedSession(
        res_pb.SeedSessionRequest(session_id="s", task=task("x"))
    )
    yield {name: stubs[name](channel) for name, channel in channels.items()}
    for channel in channels.values():
        await channel.close()


@pytest.mark.parametrize("service, method, request_, code, field", CASES, ids=[f"{c[1]}-{c[4]}" for c in CASES])
async def test_a_malformed_request_gets_a_status_naming_the_field(servers, service, method, request_, code, field):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await getattr(servers[service], method)(request_, timeout=10)
    assert error.value.code() == code, error.value.details()
    assert errors.field_of(error.value) == field  # in the google.rpc.BadRequest detail
    assert error.value.details()


async def test_a_request_nested_deeper_than_protobuf_parses_is_invalid_argument(servers):
    """What a client that skips our row loader (another language, hand-built messages) gets."""
    request = agent_pb.RunRequest()
    request.task.responses_create_params.input_text = "hi"
    request.task.data.update({"deep": json.loads(nested_json(300))})  # builds and serialises; no parser takes it
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await servers["agent"].Run(request, timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "the request is not a valid message" in error.value.details()


async def test_a_payload_over_the_message_limit_is_refused_and_the_server_goes_on(start, monkeypatch):
    monkeypatch.setattr(transport, "MAX_MESSAGE_BYTES", 1 << 20)
    server = await start(Calculator())
    monkeypatch.setattr(transport, "MAX_MESSAGE_BYTES", 64 << 20)  # the client may send more
    async with transport.open_channel(server.address) as channel:
        stub = res_grpc.ResourcesServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await stub.CallTool(res_pb.CallToolRequest(session_id="s", name="add", arguments="x" * (2 << 20)))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "larger than max" in error.value.details()
        reply = await stub.DescribeTools(res_pb.DescribeToolsRequest())  # still serving
        assert len(reply.tools) == 2


GOOD = json.dumps({"responses_create_params": {"input": "ok"}, "expected_answer": "ok"})

# (raw line, what the report says about it)
BAD_LINES = [
    (b"\xff\xfe not utf-8", "not UTF-8"),
    (b'{"responses_create_params": {"input": "x"', "not JSON"),
    (b'{"expected_answer": 1}', "responses_create_params: is required"),
    (b'{"responses_create_params": {"input": "x", "temperature": "hot"}}', "responses_create_params.temperature"),
    (b'{"responses_create_params": {"input": "x"}, "a": 1, "a": 2}', "duplicate key 'a'"),
    (b'["a", "list"]', "row: expected an object"),
    (b'{"responses_create_params": {"input": [{"role": "user", "content": 5}]}}', "input[0].content"),
    (b'{"responses_create_params": {"input": "x", "tools": [{"type": "function"}]}}', "tools[0].name"),
]


async def test_bad_rows_are_reported_by_line_and_the_rest_is_collected(start, tmp_path):
    model = await start(EchoModel())
    calc = await start(Calculator())
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=static_registry(model=model, calc=calc),
        )
    )
    lines = [GOOD.encode()] + [line for line, _ in BAD_LINES] + [GOOD.encode()]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(b"\n".join(lines) + b'\n{"responses_create_params": {"inp')  # a truncated last line
    out, log = tmp_path / "out.jsonl", io.StringIO()
    summary = await collect(
        Registry(static={"agent": agent.address}),
        CollectOptions(input=tasks, output=out, agent="agent", progress=False),
        log=log,
    )
    assert (summary.done, summary.bad_rows) == (2, len(BAD_LINES) + 1)
    assert summary.failure_counts == {f"bad rows in {tasks}": len(BAD_LINES) + 1}
    (told,) = log.getvalue().splitlines()  # the first bad row only; the sidecar has them all
    assert told.startswith(f"{tasks}:2: not UTF-8")
    sidecar = {f["line"]: f["error"] for f in map(json.loads, failures_path(out).read_text().splitlines())}
    assert sorted(sidecar) == [*range(2, len(BAD_LINES) + 2), len(lines) + 1]
    for number, (_, expected) in enumerate(BAD_LINES, start=2):
        assert expected in sidecar[number]["message"] and sidecar[number]["code"] == "INVALID_ARGUMENT"
    assert sidecar[len(lines) + 1]["message"].startswith("not JSON")  # the truncated last line
    assert sorted(row["task_index"] for row in map(json.loads, out.read_text().splitlines())) == [0, len(lines) - 1]


async def test_rows_nested_too_deep_go_to_the_sidecar_by_line_and_the_rest_is_collected(start, tmp_path):
    """100,000 levels overflow Python's JSON parser; 300 parse, but no protobuf parser takes the message.
    A row at exactly the limit travels to every server and back."""
    model = await start(EchoModel())
    calc = await start(Calculator())
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="agent",
            registry=static_registry(model=model, calc=calc),
        )
    )
    deep = '{"responses_create_params": {"input": "x"}, "deep": %s}'
    at_the_limit = deep % nested_json(json_input.MAX_DEPTH - 1)
    lines = [GOOD, deep % ("[" * 100_000 + "]" * 100_000), at_the_limit, deep % nested_json(300), GOOD]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(line + "\n" for line in lines))
    out, log = tmp_path / "out.jsonl", io.StringIO()
    summary = await collect(
        Registry(static={"agent": agent.address}),
        CollectOptions(input=tasks, output=out, agent="agent", progress=False),
        log=log,
    )
    assert (summary.done, summary.failed, summary.bad_rows) == (3, 0, 2)
    # The terminal tells the first bad row at once; the sidecar has every one.
    assert f"{tasks}:2: nested deeper than {json_input.MAX_DEPTH} levels" in log.getvalue()
    sidecar = [json.loads(line) for line in failures_path(out).read_text().splitlines()]
    assert [(f["line"], f["task_index"]) for f in sidecar] == [(2, 1), (4, 3)]
    assert all("nested deeper than" in f["error"]["message"] for f in sidecar)
    collected = {row["task_index"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert sorted(collected) == [0, 2, 4]
    assert collected[2]["deep"] == json.loads(at_the_limit)["deep"]


@pytest.mark.parametrize(
    "option",
    [
        ["--limit", "-1"],
        ["--num-repeats", "0"],
        ["--max-in-flight", "0"],
        ["--timeout", "0"],
        ["--reward-range", "zero,one"],
    ],
)
def test_bad_command_line_values_are_usage_errors(option, tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(GOOD + "\n")
    done = gym("collect", "--input", str(tasks), "--output", str(tmp_path / "o.jsonl"), *option)
    assert done.returncode == 2 and option[0] in done.stderr


def test_an_empty_task_file_collects_nothing_without_error(tmp_path):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n\n")
    done = gym("collect", "--input", str(tasks), "--output", str(tmp_path / "o.jsonl"), "--registry", "127.0.0.1:1")
    assert done.returncode == 0, done.stderr
    assert "0 rollouts collected" in done.stderr


#: Runs a command and prints the peak memory (KiB) of it and what it started.
_PEAK_RSS = (
    "import resource, subprocess, sys; done = subprocess.run(sys.argv[1:]); "
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, done.returncode)"
)


@pytest.mark.slow
def test_a_row_too_large_to_send_is_a_bad_row_and_costs_no_other(tmp_path):
    """A 257 MiB row among 40 good ones, collected by real processes: it goes to the sidecar by line
    with the limit named, before anything is sent, the 40 are collected, a re-run sends it neither,
    and the collector never holds it (its peak memory stays far below the row's size)."""
    good = MATH.read_text().splitlines()
    huge = json.dumps({"responses_create_params": {"input": "What is 1 + 1?"}, "padding": "x" * (257 * 2**20)})
    tasks = tmp_path / "tasks.jsonl"
    with tasks.open("w") as f:
        for i in range(40):
            f.write(good[i % len(good)] + "\n")
            if i == 19:
                f.write(huge + "\n")
    del huge
    out = tmp_path / "out.jsonl"
    with start_run() as run:
        args = [*collect_args(run.registry, "math_agent", tasks, out), "--no-progress"]
        done = subprocess.run(
            [sys.executable, "-c", _PEAK_RSS, gym_grpc_command(), *args], capture_output=True, text=True, timeout=600
        )
        peak_kib, code = map(int, done.stdout.splitlines()[-1].split())  # after what collect printed
        assert code == 1, done.stderr  # 1 for the bad row
        assert len(out.read_text().splitlines()) == 40
        (bad,) = [json.loads(line) for line in failures_path(out).read_text().splitlines()]
        assert (bad["line"], bad["task_index"]) == (21, 20)
        assert "over the 268,435,456 bytes one gRPC message between gym-grpc peers carries" in bad["error"]["message"]
        assert peak_kib < 512 * 1024, f"the collector peaked at {peak_kib / 1024:.0f} MiB"
        again = gym(*args)
        assert again.returncode == 1 and "40 already done" in again.stderr and "1 bad rows" in again.stderr
