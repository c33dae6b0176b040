"""OpenEnv environments played through sessions: the real `openenv` package's server (its own virtualenv,
tests/openenv_support.py) serving the env its `openenv init` template makes (an echo env), reached over
OpenEnv's WebSocket: a session per rollout, the action schema as the step tool, the rewards OpenEnv's env
gives stepped directly, and clear failures when the server is missing, silent or dies."""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path

import pytest
import yaml

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.openenv_envs.server import OpenEnvBridge
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.testing import ResourcesConformance, call, static_registry
from gym_grpc.testing.fake_engine import FakeEngine, Turn
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, collect_args, gym, start_run, worker_process

HERE = Path(__file__).resolve().parent.parent
CONFIG = HERE / "config.yaml"
EXAMPLES = [json.loads(line) for line in (HERE / "data" / "example.jsonl").read_text().splitlines()]
MESSAGES = ["hi", "hello world", "abc"]  # echo rewards min(0.1 * len, 1): 0.2, 1.0, 0.3

DIRECT = """
import json, sys
from echo_env.models import EchoAction
from echo_env.server.echo_env_environment import EchoEnvironment

env = EchoEnvironment()
env.reset(seed=0)
print(json.dumps([env.step(EchoAction(message=m)).reward for m in json.loads(sys.argv[1])]))
"""


@pytest.fixture(scope="module")
def direct_rewards(openenv) -> list[float]:
    """The rewards OpenEnv's echo env gives for MESSAGES, stepped directly in OpenEnv's own interpreter."""
    done = openenv.run(DIRECT, json.dumps(MESSAGES))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _task(seed: int | None = 0, reset: dict | None = None):
    row: dict = {"responses_create_params": {"input": "Act."}}
    if seed is not None:
        row["openenv_seed"] = seed
    if reset is not None:
        row["openenv_reset"] = reset
    return rows.task_from_row(row)


def _step(message) -> r.FunctionCall:
    return r.FunctionCall(name="step", arguments=json.dumps({"message": message}))


@pytest.fixture
async def bridge(start, openenv_echo):
    async def started(**config):
        running = await start(OpenEnvBridge({"url": openenv_echo.url, **config}, name="openenv"))
        return ResourcesClient(static_registry(openenv=running), "openenv"), running.app

    clients: list[ResourcesClient] = []

    async def make(**config):
        client, app = await started(**config)
        clients.append(client)
        return client, app

    yield make
    for client in clients:
        await client.registry.close()


def test_the_example_rows_are_what_task_rows_writes_from_a_server_it_starts(openenv):
    config = {"command": openenv.echo_command(), "cwd": str(openenv.envs)}
    assert OpenEnvBridge(config, name="openenv").task_rows(3) == EXAMPLES
    [tool] = EXAMPLES[0]["responses_create_params"]["tools"]
    assert tool["name"] == "step" and tool["parameters"]["required"] == ["message"]
    assert "metadata" not in tool["parameters"]["properties"]  # OpenEnv's own field, not the policy's
    assert (
        '"echoed_message": "Echo Env environment ready!"'
        in EXAMPLES[0]["responses_create_params"]["input"][0]["content"]
    )


async def test_each_step_is_the_envs_and_verify_scores_the_rewards_openenv_gives_stepped_directly(
    bridge, direct_rewards
):
    client, _ = await bridge()
    [tool] = (await client.describe_tools()).tools
    assert tool.name == "step" and json.loads(tool.parameters_json)["properties"]["message"]["type"] == "string"
    await client.seed_session("s", _task())
    outputs = [await client.call_tool("s", _step(m)) for m in MESSAGES]
    assert not any(o.error for o in outputs)
    first = outputs[0].output.splitlines()
    observation = {"echoed_message": "hi", "message_length": 2, "metadata": {"original_message": "hi", "step": 1}}
    assert json.loads(first[0]) == observation and first[1] == "reward: 0.2"
    verdict = await client.verify("s", _task(), r.Response())
    assert verdict.reward == pytest.approx(sum(direct_rewards)) and direct_rewards == pytest.approx([0.2, 1.0, 0.3])
    fields = rows.json_field(verdict, "fields")
    assert fields == {"seed": 0, "steps": 3, "done": False, "last_reward": pytest.approx(0.3), "replayed": False}
    await client.close_session("s")


async def test_reward_last_scores_the_last_steps_reward(bridge, direct_rewards):
    client, _ = await bridge(reward="last")
    await client.seed_session("s", _task())
    for m in MESSAGES:
        await client.call_tool("s", _step(m))
    assert (await client.verify("s", _task(), r.Response())).reward == pytest.approx(direct_rewards[-1])
    await client.close_session("s")


async def test_an_action_the_env_refuses_is_the_models_error_naming_openenvs_reason(bridge):
    client, _ = await bridge()
    await client.seed_session("s", _task())
    refused = await client.call_tool("s", r.FunctionCall(name="step", arguments='{"text": "hi"}'))
    assert refused.error and "the environment refused the action" in refused.output
    assert "VALIDATION_ERROR" in refused.output
    assert not (await client.call_tool("s", _step("still here"))).error  # the session goes on
    await client.close_session("s")


async def test_without_a_session_verify_replays_the_responses_steps_on_a_new_session(bridge, direct_rewards):
    client, _ = await bridge()
    response = r.Response(output=[call("step", json.dumps({"message": m})) for m in MESSAGES])
    verdict = await client.verify("never-seeded", _task(), response)
    fields = rows.json_field(verdict, "fields")
    assert verdict.reward == pytest.approx(sum(direct_rewards)) and fields["replayed"] and fields["steps"] == 3


async def test_closed_sessions_give_their_env_back_and_a_full_server_is_resource_exhausted(bridge, openenv):
    """The echo env serves 16 sessions at once (tests/openenv_support.py): 20 rollouts one after the other
    fit only if each close ends its OpenEnv session; 17 at once do not, and the 17th is told why."""
    client, app = await bridge()
    for i in range(20):
        await client.seed_session(f"one-{i}", _task(i))
        await client.close_session(f"one-{i}")
    for i in range(16):
        await client.seed_session(f"many-{i}", _task(i))
    with pytest.raises(errors.ResourceExhausted, match="has no room for another session.*max_concurrent_envs"):
        await client.seed_session("one-too-many", _task())
    for i in range(16):
        await client.close_session(f"many-{i}")
    assert app.episodes == {}


def _refusing_port() -> socket.socket:
    """A loopback port held (bound, not listening): connecting to it is refused."""
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    return held


async def test_an_unreachable_server_fails_each_rollout_at_seed_session_naming_it(start):
    held = _refusing_port()
    url = f"http://127.0.0.1:{held.getsockname()[1]}"
    try:
        running = await start(OpenEnvBridge({"url": url}, name="openenv"))  # starts: the server may come later
        client = ResourcesClient(static_registry(openenv=running), "openenv")
        with pytest.raises(errors.Unavailable) as caught:
            await client.seed_session("s", _task())
        assert (
            caught.value.reason == errors.Reason.OPENENV_UNAVAILABLE and f"OpenEnv server {url}" in caught.value.message
        )
        await client.registry.close()
    finally:
        held.close()


async def test_a_server_that_never_answers_fails_the_rollout_within_the_connect_timeout(start):
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never says a word
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        running = await start(OpenEnvBridge({"url": url, "connect_timeout_seconds": 0.5}, name="openenv"))
        client = ResourcesClient(static_registry(openenv=running), "openenv")
        with pytest.raises(errors.Unavailable, match=r"within 0.5 s \(connect_timeout_seconds\)"):
            await asyncio.wait_for(client.seed_session("s", _task()), 30)
        await client.registry.close()
    finally:
        silent.close()


async def test_the_servers_process_dying_fails_the_rollout_with_its_exit_status(start, openenv):
    config = {"command": openenv.echo_command(), "cwd": str(openenv.envs)}
    running = await start(OpenEnvBridge(config, name="openenv"))
    client = ResourcesClient(static_registry(openenv=running), "openenv")
    await client.seed_session("s", _task())
    process = running.app.process.process
    os.kill(process.pid, signal.SIGKILL)
    await process.wait()
    with pytest.raises(errors.Unavailable, match=r"its process exited \(status -9\)") as caught:
        await client.call_tool("s", _step("anyone?"))
    assert caught.value.reason == errors.Reason.OPENENV_UNAVAILABLE
    await client.registry.close()


async def test_stopping_the_server_stops_the_openenv_process_it_started(openenv):
    app = OpenEnvBridge({"command": openenv.echo_command(), "cwd": str(openenv.envs)}, name="openenv")
    await app.start()
    process = app.process.process
    await app.stop()
    assert process.returncode is not None


def test_the_openenv_process_ends_when_its_gym_grpc_server_is_killed(openenv):
    """SIGKILL leaves no stop() to run: the child dies with its parent (PR_SET_PDEATHSIG), seen through a pidfd."""
    config = {"command": openenv.echo_command(), "cwd": str(openenv.envs)}
    server, _ = worker_process(
        "openenv", "gym_grpc.bundled.servers.resources.openenv_envs.server:OpenEnvBridge", config
    )
    try:
        [child] = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        pidfd = os.pidfd_open(int(child))
    finally:
        server.kill()
        server.wait()
    try:
        assert select.select([pidfd], [], [], 30)[0] == [pidfd], "the OpenEnv server outlived its gym-grpc server"
    finally:
        os.close(pidfd)


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({}, "give exactly one of url and command (got neither)"),
        ({"url": "http://127.0.0.1:1", "command": ["x"]}, "give exactly one of url and command (got url, command)"),
        ({"url": "127.0.0.1:8000"}, "is not an http:// or https:// URL"),
        ({"url": "http://127.0.0.1:8000", "cwd": "/tmp"}, "env, cwd: only for a command"),
        ({"url": "http://127.0.0.1:8000", "rewards": "sum"}, "rewards"),
    ],
)
def test_a_config_it_cannot_use_is_refused_naming_the_key(config, says):
    with pytest.raises(errors.ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        OpenEnvBridge(config, name="openenv")


async def test_a_command_that_exits_before_listening_is_a_config_error_quoting_it():
    app = OpenEnvBridge({"command": [sys.executable, "-c", "print('no env here'); raise SystemExit(3)"]})
    with pytest.raises(
        errors.ConfigError, match=r"config.command: .*exited \(status 3\) before listening: no env here"
    ):
        await app.start()


# --- an MCP environment: its tools, one by one ------------------------------------------

MCP_ECHO = REPO / "tests" / "programs" / "openenv_mcp_echo"  # OpenEnv's own envs/echo_env (BSD-3-Clause)

MCP_DIRECT = """
import json
from mcp_echo_env.server.echo_environment import EchoEnvironment
from openenv.core.env_server.mcp_types import CallToolAction

env = EchoEnvironment()
env.reset(seed=0)
result = env.step(CallToolAction(tool_name="echo_with_length", arguments={"message": "hey"})).result
print(json.dumps(result.content[0].text))
"""


def _mcp_echo_config(openenv) -> dict:
    command = [
        str(openenv.python),
        "-m",
        "uvicorn",
        "mcp_echo_env.server.app:app",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    ]
    return {"command": command, "cwd": str(MCP_ECHO)}


async def test_an_mcp_envs_tools_are_offered_one_by_one_and_answer_as_the_env_does_directly(start, openenv):
    running = await start(OpenEnvBridge(_mcp_echo_config(openenv), name="openenv"))
    client = ResourcesClient(static_registry(openenv=running), "openenv")
    tools = {t.name: json.loads(t.parameters_json) for t in (await client.describe_tools()).tools}
    assert set(tools) == {"echo_message", "echo_with_length"} and tools["echo_message"]["required"] == ["message"]
    await client.seed_session("s", _task())
    said = await client.call_tool("s", r.FunctionCall(name="echo_with_length", arguments='{"message": "hey"}'))
    done = await asyncio.to_thread(openenv.run, MCP_DIRECT, cwd=MCP_ECHO)
    assert done.returncode == 0, done.stderr
    assert (
        not said.error
        and said.output == json.loads(done.stdout)
        and json.loads(said.output)
        == {
            "message": "hey",
            "length": 3,
        }
    )
    refused = await client.call_tool("s", r.FunctionCall(name="echo_message", arguments='{"text": "hey"}'))
    assert refused.error and "message" in refused.output  # FastMCP's validation, through OpenEnv, for the model
    unknown = await client.call_tool("s", r.FunctionCall(name="step", arguments='{"message": "hey"}'))
    assert unknown.error and unknown.reason == "TOOL_NOT_FOUND" and "echo_message" in unknown.output
    fields = rows.json_field(await client.verify("s", _task(), r.Response()), "fields")
    assert fields["steps"] == 2 and fields["done"] is False  # the env took both calls; echo gives no reward
    await client.close_session("s")
    await client.registry.close()


# --- a user's run: gym-grpc run + gym-grpc collect -----------------------------------


def _echo_player(body: dict) -> Turn:
    """A scripted policy: says each of MESSAGES through the step tool, then answers."""
    said = [i for i in body["input"] if i.get("type") == "function_call"]
    if len(said) < len(MESSAGES):
        return Turn(tool_calls=[("step", json.dumps({"message": MESSAGES[len(said)]}))])
    return Turn(content="Done.")


@pytest.mark.slow
async def test_gym_grpc_run_and_collect_play_an_openenv_process_and_record_its_rewards(
    tmp_path, openenv, direct_rewards
):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(row) + "\n" for row in EXAMPLES))
    override = tmp_path / "openenv.yaml"  # the bundled config, its server started by the run
    override.write_text(
        yaml.safe_dump(
            {
                "servers": {
                    "openenv": {"config": {"url": None, "command": openenv.echo_command(), "cwd": str(openenv.envs)}}
                }
            }
        )
    )
    engine = FakeEngine(_echo_player)
    base_url = await engine.start()
    output = tmp_path / "rollouts.jsonl"
    try:
        with start_run(
            f"policy_base_url={base_url}",
            "policy_api_key=none",
            "policy_model_name=scripted",
            configs=(REPO / "configs" / "openai.yaml", CONFIG, override),
        ) as run:
            collected = await asyncio.to_thread(gym, *collect_args(run.registry, "openenv_agent", tasks, output))
            assert collected.returncode == 0, collected.stderr
    finally:
        await engine.stop()
    written = [json.loads(line) for line in output.read_text().splitlines()]
    assert sorted(row["openenv_seed"] for row in written) == [0, 1, 2]
    for row in written:
        outputs = [i["output"] for i in row["response"]["output"] if i["type"] == "function_call_output"]
        assert [json.loads(o.splitlines()[0])["echoed_message"] for o in outputs] == MESSAGES
        assert row["reward"] == pytest.approx(sum(direct_rewards)) and row["steps"] == 3 and not row["replayed"]


class TestOpenEnvConformance(ResourcesConformance):
    task_row = EXAMPLES[0]
    answer = "Done."

    @pytest.fixture(autouse=True)
    def _echo_server(self, openenv_echo):
        self.url = openenv_echo.url

    def server(self):
        return OpenEnvBridge({"url": self.url}, name="openenv")
