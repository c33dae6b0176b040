"""The MCP tools environment as a user runs it: `gym-grpc run` + `gym-grpc collect`, with the embedded
policy calling the MCP tools, real MCP server processes behind them, and none of them left after the stop."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gym_grpc.bundled.servers.resources.mcp_tools.example_server import COUNTRIES
from gym_grpc.responses import tool_error_output
from tests.support import REPO, alive, collect_args, gym, read_rows, start_run

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "data" / "fixture_server.py"
MCP_CONFIG = HERE.parent / "config.yaml"
LOCAL_POLICY = REPO / "configs" / "local_policy.yaml"
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
CRASH = {"type": "object", "properties": {}}


def _descendants(pid: int) -> set[int]:
    """Every live process under `pid` (children, their children, ...)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return {p for p in found if alive(p)}


def _mcp_processes(run_pid: int, marker: str) -> set[int]:
    out = set()
    for pid in _descendants(run_pid):
        try:
            if marker in Path(f"/proc/{pid}/cmdline").read_text():
                out.add(pid)
        except OSError:
            pass
    return out


def _tool_turns(row: dict) -> list[tuple[str, dict, str]]:
    """(tool name, arguments, output) of each tool call of a rollout row."""
    items = row["response"]["output"]
    outputs = {i["call_id"]: i["output"] for i in items if i["type"] == "function_call_output"}
    calls = [i for i in items if i["type"] == "function_call"]
    return [(c["name"], json.loads(c["arguments"]), outputs[c["call_id"]]) for c in calls]


def _config(tmp_path: Path, mcp_server: dict) -> Path:
    """A config of an MCP tools server `fixture_mcp` with MCP server `fx`, and its agent `fixture_agent`."""
    config = tmp_path / "mcp.yaml"
    servers = {
        "fixture_mcp": {
            "entrypoint": f"{HERE.parent / 'server.py'}:McpToolsEnv",
            "config": {"mcp_servers": {"fx": mcp_server}},
        },
        "fixture_agent": {
            "entrypoint": f"{REPO / 'servers/agents/simple_agent/agent.py'}:SimpleAgent",
            "config": {"model_server": "policy_model", "resources_server": "fixture_mcp", "max_steps": 3},
        },
    }
    config.write_text(yaml.safe_dump({"servers": servers}))
    return config


TOOLS = [
    {"type": "function", "name": "add", "description": "Add two integers.", "parameters": ADD},
    {"type": "function", "name": "crash", "description": "Exit the process in the middle of the call.",
     "parameters": CRASH},
]  # fmt: skip
ADDS = [("Sum the integers 7 and 7.", "14"), ("Sum the integers 21 and 21.", "42")]


def _tasks_writer(tmp_path: Path):
    def write(name: str, prompts: list[tuple[str, str]]) -> Path:
        path = tmp_path / name
        rows = [{"responses_create_params": {"input": p, "tools": TOOLS}, "expected_answer": a} for p, a in prompts]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        return path

    return write


def _check_adds(written: list[dict]) -> None:
    """Every add call's output is the MCP tool's sum of its arguments, and some rollout earned the reward."""
    assert len(written) == len(ADDS) * 3
    for row in written:
        assert _tool_turns(row), row["response"]
        for name, arguments, answer in _tool_turns(row):
            assert name == "add" and answer == str(arguments["a"] + arguments["b"])
    assert 1.0 in {row["reward"] for row in written}


def test_the_bundled_config_runs_and_collects_with_the_example_mcp_server(tmp_path):
    run = start_run(configs=(LOCAL_POLICY, MCP_CONFIG))
    try:
        mcp = _mcp_processes(run.process.pid, "mcp_tools.example_server")
        assert len(mcp) == len(run.pids("mcp_tools"))  # one per worker process, shared by its rollouts
        output = tmp_path / "rollouts.jsonl"
        tasks = HERE.parent / "data" / "example.jsonl"
        done = gym(*collect_args(run.registry, "mcp_tools_agent", tasks, output), "--num-repeats", "2")
        assert done.returncode == 0, done.stderr
        assert _mcp_processes(run.process.pid, "mcp_tools.example_server") == mcp  # no restart
    finally:
        run.stop()
    written = read_rows(output)
    assert len(written) == 5 * 2
    facts = {"capital_of": 0, "currency_of": 1, "calling_code_of": 2}
    for row in written:
        turns = _tool_turns(row)
        assert turns, row["response"]
        for name, arguments, answer in turns:  # the MCP server's answer reached the model
            known = {c.casefold(): f for c, f in COUNTRIES.items()}.get(arguments["country"].casefold())
            assert answer == (known[facts[name]] if known else _no_facts(name, arguments["country"])), answer
    assert 1.0 in {row["reward"] for row in written}
    assert [p for p in mcp if alive(p)] == []


def _no_facts(tool: str, country: str) -> str:
    """The output of a call for a country the example server does not know (the policy slipped)."""
    known = ", ".join(COUNTRIES)
    return tool_error_output(f"Error executing tool {tool}: no facts about {country!r}; known countries: {known}")


def test_an_mcp_server_crashing_mid_run_costs_its_calls_and_the_collection_goes_on(tmp_path):
    config = _config(tmp_path, {"command": sys.executable, "args": [str(FIXTURE), "stdio"]})
    write = _tasks_writer(tmp_path)
    crash = write("crash.jsonl", [("Please crash the process.", "never")])
    adds = write("adds.jsonl", ADDS)
    crashed, added = tmp_path / "crashed.jsonl", tmp_path / "added.jsonl"
    run = start_run("group_workers=1", configs=(LOCAL_POLICY, config))  # the one MCP process its rollouts share
    try:
        first = _mcp_processes(run.process.pid, str(FIXTURE))
        assert len(first) == 1
        done = gym(*collect_args(run.registry, "fixture_agent", crash, crashed))
        assert done.returncode == 0, done.stderr
        assert [p for p in first if alive(p)] == []  # the process died in the call
        done = gym(*collect_args(run.registry, "fixture_agent", adds, added), "--num-repeats", "3")
        assert done.returncode == 0, done.stderr
        second = _mcp_processes(run.process.pid, str(FIXTURE))
        assert len(second) == 1 and not (first & second)  # started again for the next call
    finally:
        run.stop()
    assert "MCP server 'fx': its connection closed; starting it again" in run.log()
    (row,) = read_rows(crashed)  # the rollout completed: the crash cost its tool call, not the rollout
    ((name, _, answer),) = _tool_turns(row)
    assert name == "crash" and row["reward"] == 0.0
    assert "MCP server 'fx' is unavailable" in answer and "the call to 'crash' was lost" in answer
    _check_adds(read_rows(added))
    assert [p for p in second if alive(p)] == []


def test_over_streamable_http_run_and_collect_call_the_mcp_servers_tools(tmp_path):
    server = subprocess.Popen(
        [sys.executable, str(FIXTURE), "http"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    try:
        line = server.stdout.readline() if server.stdout else ""
        assert line.startswith("PORT "), line
        config = _config(tmp_path, {"url": f"http://127.0.0.1:{int(line.split()[1])}/mcp"})
        adds = _tasks_writer(tmp_path)("adds.jsonl", ADDS)
        run = start_run(configs=(LOCAL_POLICY, config))
        try:
            output = tmp_path / "added.jsonl"
            done = gym(*collect_args(run.registry, "fixture_agent", adds, output), "--num-repeats", "3")
            assert done.returncode == 0, done.stderr
        finally:
            run.stop()
        _check_adds(read_rows(output))
    finally:
        server.kill()
        server.wait(timeout=30)
