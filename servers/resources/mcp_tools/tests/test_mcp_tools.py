"""The MCP tools environment against real MCP server processes (tests/data/fixture_server.py, written with
the mcp package's MCPServer), over stdio and over streamable HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.mcp_tools.server import McpToolsEnv
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.resources import Session
from gym_grpc.responses import assistant_message
from gym_grpc.testing import ResourcesConformance, call, static_registry
from gym_grpc.testing.servers import Servers
from gym_grpc.v1 import responses_pb2 as r
from tests.support import alive

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "data" / "fixture_server.py"
EXAMPLES = HERE.parent / "data" / "example.jsonl"
pytestmark = pytest.mark.slow  # each test starts real MCP server processes

FIXTURE_TOOLS = ["add", "fail", "picture", "remember", "recall", "pid", "crash", "hang"]


def stdio(**more) -> dict:
    return {"command": sys.executable, "args": [str(FIXTURE), "stdio"], **more}


def env(**servers) -> McpToolsEnv:
    return McpToolsEnv(name="mcp", config={"mcp_servers": servers})


@pytest.fixture
async def serve():
    """Start McpToolsEnv servers; yields a function that starts one and returns a client of it."""
    running = Servers()
    clients: list[ResourcesClient] = []

    async def start(app: McpToolsEnv) -> ResourcesClient:
        server = await running.start(app)
        client = ResourcesClient(static_registry(mcp=server), "mcp")
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.registry.close()
    await running.stop()


async def tool(client: ResourcesClient, name: str, arguments: str = "", session: str = "s"):
    return await client.call_tool(session, r.FunctionCall(name=name, arguments=arguments))


@pytest.fixture
def http_fixture():
    """The fixture MCP server over streamable HTTP, in its own process; yields (url, process)."""
    process = subprocess.Popen(
        [sys.executable, str(FIXTURE), "http"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = process.stdout.readline() if process.stdout else ""
        assert line.startswith("PORT "), f"the fixture MCP server did not start: {line!r}"
        yield f"http://127.0.0.1:{int(line.split()[1])}/mcp", process
    finally:
        process.kill()
        process.wait(timeout=30)


# --- tools as the model sees them -----------------------------------------------------------


async def test_describe_tools_lists_the_mcp_tools_with_their_input_schemas(serve):
    client = await serve(env(fx=stdio()))
    described = await client.describe_tools()
    assert [t.name for t in described.tools] == FIXTURE_TOOLS
    add = described.tools[0]
    assert add.description == "Add two integers."
    schema = json.loads(add.parameters_json)
    assert schema["required"] == ["a", "b"] and schema["properties"]["a"]["type"] == "integer"
    assert described.stateless  # one shared MCP process: agents need not seed sessions


async def test_a_tool_call_reaches_the_mcp_tool_and_its_text_comes_back(serve):
    client = await serve(env(fx=stdio()))
    result = await tool(client, "add", '{"a": 2, "b": 40}')
    assert (result.output, result.error) == ("42", False)


async def test_an_is_error_result_is_an_error_output_for_the_model(serve):
    client = await serve(env(fx=stdio()))
    result = await tool(client, "fail", '{"message": "the disk is full"}')
    assert result.error and result.reason == "TOOL_FAILED"
    assert "the disk is full" in result.output


async def test_an_unknown_tool_is_not_found_and_lists_the_tools(serve):
    client = await serve(env(fx=stdio()))
    result = await tool(client, "subtract", '{"a": 1}')
    assert result.error and result.reason == "TOOL_NOT_FOUND"
    assert "unknown tool 'subtract'" in result.output and "add, crash" in result.output


async def test_arguments_that_do_not_fit_the_schema_are_invalid_naming_the_argument(serve):
    client = await serve(env(fx=stdio()))
    for arguments, says in [
        ('{"a": 2, "b": "three"}', "argument 'b': 'three' is not of type 'integer'"),
        ('{"a": 2}', "'b' is a required property"),
        ('{"a": 2, "b": ', "arguments are not valid JSON"),
        ("[2, 3]", "arguments must be a JSON object"),
    ]:
        result = await tool(client, "add", arguments)
        assert result.error and result.reason == "TOOL_ARGUMENTS_INVALID", arguments
        assert says in result.output, (arguments, result.output)


async def test_an_image_result_is_an_image_part(serve):
    client = await serve(env(fx=stdio()))
    result = await tool(client, "picture")
    assert not result.error and result.output == ""
    [part] = result.parts
    assert part.input_image.media_type == "image/png" and part.input_image.data == bytes.fromhex("89504e470d0a1a0a")


async def test_a_tool_that_does_not_answer_in_time_is_an_error_output(serve):
    client = await serve(env(fx=stdio(call_timeout_seconds=1)))
    result = await tool(client, "hang")
    assert result.error and "tool 'hang' did not answer within 1 s" in result.output
    assert (await tool(client, "add", '{"a": 1, "b": 1}')).output == "2"  # the server goes on


def _fixture_children() -> set[int]:
    """The live fixture MCP processes (over stdio) this test process started."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rpartition(")")[2].split()[1])
            cmdline = (stat.parent / "cmdline").read_text()
        except OSError:
            continue
        if ppid == os.getpid() and str(FIXTURE) in cmdline and "stdio" in cmdline and alive(int(stat.parent.name)):
            found.add(int(stat.parent.name))
    return found


# --- a shared MCP server that dies --------------------------------------------------------


async def test_a_shared_mcp_server_that_dies_mid_call_costs_that_call_and_is_started_again(serve):
    app = env(fx=stdio())
    client = await serve(app)
    first = int((await tool(client, "pid")).output)
    died = await tool(client, "crash")
    assert died.error and died.reason == "TOOL_FAILED"
    assert "MCP server 'fx' is unavailable" in died.output and "the call to 'crash' was lost" in died.output
    assert not alive(first)
    second = int((await tool(client, "pid")).output)  # the next call starts it again
    assert second != first and alive(second)
    assert app.restarts == {"fx": 1}
    assert (await tool(client, "add", '{"a": 3, "b": 4}')).output == "7"


# --- a process per session ------------------------------------------------------------------


async def _seed(client: ResourcesClient, session: str) -> None:
    await client.seed_session(session, rows.task_from_row({"responses_create_params": {"input": "hi"}}))


async def test_per_session_servers_keep_each_rollouts_state_apart_and_stop_with_the_session(serve):
    client = await serve(env(fx=stdio(per_session=True)))
    assert not (await client.describe_tools()).stateless
    await _seed(client, "one")
    await _seed(client, "two")
    await tool(client, "remember", '{"note": "milk"}', session="one")
    assert (await tool(client, "recall", session="one")).output == "milk"
    assert (await tool(client, "recall", session="two")).output == "no notes"
    pids = [int((await tool(client, "pid", session=s)).output) for s in ("one", "two")]
    assert pids[0] != pids[1]
    await client.close_session("one")
    assert not alive(pids[0]) and alive(pids[1])


async def test_a_per_session_server_that_dies_fails_its_rollout_clearly_and_no_other(serve):
    client = await serve(env(fx=stdio(per_session=True)))
    await _seed(client, "doomed")
    await _seed(client, "fine")
    for attempt in ("crash", "recall"):  # the call it dies in, and any later one: its state is gone
        with pytest.raises(errors.Unavailable) as failed:
            await tool(client, attempt, session="doomed")
        assert failed.value.reason == errors.Reason.MCP_SERVER_UNAVAILABLE
        assert "MCP server 'fx' of session 'doomed' is gone" in failed.value.message
        assert failed.value.metadata["tool"] == attempt
    assert (await tool(client, "add", '{"a": 1, "b": 2}', session="fine")).output == "3"
    await client.close_session("doomed")


async def test_no_mcp_process_outlives_the_resources_server(serve):
    app = McpToolsEnv(
        name="mcp",
        config={"mcp_servers": {"shared": stdio(), "own": stdio(per_session=True, tool_prefix="own_")}},
    )
    running = Servers()
    server = await running.start(app)
    client = ResourcesClient(static_registry(mcp=server), "mcp")
    try:
        for session in ("a", "b"):
            await _seed(client, session)
        pids = [int((await tool(client, "pid", session="a")).output)]
        pids += [int((await tool(client, "own_pid", session=s)).output) for s in ("a", "b")]
        assert len(set(pids)) == 3 and all(alive(p) for p in pids)
    finally:
        await client.registry.close()
        await running.stop()  # with sessions a and b still open
    assert [p for p in pids if alive(p)] == []


# --- streamable HTTP ------------------------------------------------------------------------


async def test_over_streamable_http_the_tools_are_listed_and_called(serve, http_fixture):
    url, _ = http_fixture
    client = await serve(env(web={"url": url}))
    assert [t.name for t in (await client.describe_tools()).tools] == FIXTURE_TOOLS
    assert (await tool(client, "add", '{"a": 20, "b": 22}')).output == "42"
    failed = await tool(client, "fail", '{"message": "no route"}')
    assert failed.error and "no route" in failed.output


async def test_an_http_mcp_server_that_goes_away_costs_calls_not_the_resources_server(serve, http_fixture):
    url, process = http_fixture
    client = await serve(env(web={"url": url}))
    assert (await tool(client, "add", '{"a": 1, "b": 1}')).output == "2"
    process.kill()
    process.wait(timeout=30)
    for _ in range(2):  # the call that finds it gone, and the next, which cannot reach it again
        result = await tool(client, "add", '{"a": 1, "b": 1}')
        assert result.error and "MCP server 'web'" in result.output
    assert (await client.describe_tools()).tools  # the resources server still answers


# --- names and configuration ------------------------------------------------------------------


async def test_two_servers_with_the_same_tool_names_are_a_config_error_unless_prefixed(serve):
    with pytest.raises(errors.ConfigError) as clash:
        await serve(env(a=stdio(), b=stdio()))
    assert "server 'mcp': config.mcp_servers: MCP servers 'a' and 'b' both offer a tool named 'add'" in str(clash.value)
    assert "tool_prefix" in str(clash.value)
    assert _fixture_children() == set()  # the failed start stopped the two processes it had started
    client = await serve(env(a=stdio(tools=["add"]), b=stdio(tool_prefix="b_", tools=["add", "pid"])))
    assert [t.name for t in (await client.describe_tools()).tools] == ["add", "b_add", "b_pid"]
    assert (await tool(client, "b_add", '{"a": 5, "b": 5}')).output == "10"


async def test_a_listed_tool_the_server_lacks_is_a_config_error(serve):
    with pytest.raises(errors.ConfigError, match=r"config.mcp_servers.fx.tools: 'mul' not among"):
        await serve(env(fx=stdio(tools=["add", "mul"])))


async def test_an_mcp_server_that_cannot_start_is_a_config_error_naming_it(serve):
    with pytest.raises(errors.ConfigError) as failed:
        await serve(env(broken={"command": "/nonexistent/mcp-server"}))
    assert "server 'mcp': config.mcp_servers.broken: cannot start or reach the MCP server" in str(failed.value)
    assert "No such file or directory" in str(failed.value)


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"command": "x", "url": "http://h/mcp"}, "give exactly one of command, module and url (got command, url)"),
        ({}, "give exactly one of command, module and url (got none)"),
        ({"url": "http://h/mcp", "args": ["-v"]}, "args: only for a command or module"),
        ({"command": "x", "headers": {"a": "b"}}, "headers: only for a url"),
        ({"command": "x", "tool_prefx": "a_"}, "tool_prefx: Extra inputs are not permitted"),
    ],
)
def test_a_wrong_mcp_server_entry_is_a_config_error_naming_the_key(spec, says):
    with pytest.raises(errors.ConfigError) as wrong:
        env(fx=spec)
    assert "server 'mcp'" in str(wrong.value) and "mcp_servers.fx" in str(wrong.value) and says in str(wrong.value)


# --- the verifier -------------------------------------------------------------------------------


def _task(expected):
    return rows.task_from_row({"responses_create_params": {"input": "Capital of Japan?"}, "expected_answer": expected})


@pytest.mark.parametrize(
    ("match", "answer", "reward"),
    [
        ("contains", "The capital is  TOKYO.", 1.0),
        ("contains", "It is Kyoto.", 0.0),
        ("exact", "tokyo", 1.0),
        ("exact", "The capital is Tokyo.", 0.0),
    ],
)
async def test_the_reward_is_whether_the_final_answer_holds_the_expected_answer(match, answer, reward):
    app = McpToolsEnv(name="mcp", config={"mcp_servers": {"fx": stdio()}, "answer_match": match})
    response = r.Response(output=[call("add", '{"a": 1, "b": 2}'), assistant_message(answer)])
    verdict = await app.verify(Session(id="s", task=_task("Tokyo")), response)  # no MCP server needed
    assert verdict.reward == reward
    assert verdict.fields == {"tool_calls": 1, "answer_found": bool(reward)}


async def test_a_task_without_an_expected_answer_is_a_task_data_error():
    app = env(fx=stdio())
    with pytest.raises(errors.TaskDataError, match="task.data.expected_answer: is required"):
        await app.verify(Session(id="s", task=_task("")), r.Response(output=[assistant_message("Tokyo")]))


# --- the bundled example --------------------------------------------------------------------------


EXAMPLE = {"facts": {"module": "gym_grpc.bundled.servers.resources.mcp_tools.example_server"}}


async def test_the_example_rows_offer_the_tools_the_example_server_describes(serve):
    client = await serve(McpToolsEnv(name="mcp", config={"mcp_servers": EXAMPLE}))
    described = {t.name: (t.description, json.loads(t.parameters_json)) for t in (await client.describe_tools()).tools}
    lines = EXAMPLES.read_text().splitlines()
    assert len(lines) == 5
    for line in lines:
        row = json.loads(line)
        rows.task_from_row(row)
        assert row["expected_answer"]
        offered = {t["name"]: (t["description"], t["parameters"]) for t in row["responses_create_params"]["tools"]}
        assert offered == described


class TestMcpToolsConformance(ResourcesConformance):
    task_row = {"responses_create_params": {"input": "What is the capital of Japan?"}, "expected_answer": "Tokyo"}

    def server(self) -> McpToolsEnv:
        return McpToolsEnv(name="mcp", config={"mcp_servers": EXAMPLE})


class TestMcpToolsPerSessionConformance(ResourcesConformance):
    """With a process per rollout the server is stateful, and the kit checks that it refuses closed sessions."""

    task_row = {"responses_create_params": {"input": "Add 2 and 3."}, "expected_answer": "5"}

    def server(self) -> McpToolsEnv:
        return env(fx=stdio(per_session=True, tools=["add", "pid"]))
