"""A verifiers 0.4 taskset served as a gym-grpc resources server, with the real verifiers package.

The taskset is examples/verifiers_taskset.py, written with verifiers' public
v1 classes only (a per-rollout toolset whose tool writes the rollout's state,
a `@vf.reward` on the answer and a `@vf.metric` on that state). Each reward
the server gives is checked against verifiers' own scoring of the same
conversation: `Task.score` on a `vf.Trace` the test builds by hand from the
rollout's items, with the state the tool calls in it would have written.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import verifiers.v1 as vf
from verifiers.v1.graph import MessageNode

from examples.verifiers_taskset import CAPITALS, CapitalsState, CapitalsTaskset, CapitalsTasksetConfig
from gym_grpc import errors
from gym_grpc.adapters.verifiers_server import TASK_KEY, VerifiersTasksetServer, task_rows
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.client.stubs import AgentClient, ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import new_id, tool_error_output
from gym_grpc.rpc.registry import Registry
from gym_grpc.testing import ResourcesConformance, ScriptedModel, call, say
from gym_grpc.v1 import responses_pb2 as r
from tests.support import REPO, collect_args, start_run

TASKSET = "examples.verifiers_taskset:CapitalsTaskset"
TASKS = REPO / "examples" / "verifiers_tasks.jsonl"
CONFIG = REPO / "examples" / "verifiers.yaml"


def _server(**config) -> VerifiersTasksetServer:
    return VerifiersTasksetServer({"taskset": TASKSET, **config}, name="capitals")


def _file_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _expected_score(row: dict, response: dict) -> vf.Trace:
    """verifiers' own scoring of a rollout: the row's task, the conversation as trace nodes
    written here by hand, the state its capital_of calls write, then Task.score."""
    task = next(t for t in CapitalsTaskset(CapitalsTasksetConfig()) if t.key == row[TASK_KEY])
    calls = [item for item in response["output"] if item["type"] == "function_call"]
    state = CapitalsState(lookups=[json.loads(c["arguments"]).get("country", "") for c in calls])
    trace = vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
        state=state,
    )
    messages: list[tuple[vf.Message, bool]] = [(vf.UserMessage(content=task.data.prompt), False)]
    for item in response["output"]:
        if item["type"] == "function_call":
            tool_call = vf.ToolCall(id=item["call_id"], name=item["name"], arguments=item["arguments"])
            messages.append((vf.AssistantMessage(content=None, tool_calls=[tool_call]), True))
        elif item["type"] == "function_call_output":
            messages.append((vf.ToolMessage(tool_call_id=item["call_id"], content=item["output"]), False))
        elif item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            messages.append((vf.AssistantMessage(content=text), True))
    for index, (message, sampled) in enumerate(messages):
        trace.nodes.append(MessageNode(parent=index - 1 if index else None, message=message, sampled=sampled))
    return trace


async def _verifiers_score(row: dict, response: dict) -> vf.Trace:
    trace = _expected_score(row, response)
    task = next(t for t in CapitalsTaskset(CapitalsTasksetConfig()) if t.key == row[TASK_KEY])
    await task.score(trace)
    return trace


async def test_the_tasks_file_is_what_task_rows_writes_prompts_tools_and_keys():
    written = await task_rows(CapitalsTaskset(CapitalsTasksetConfig()))
    assert _file_rows(TASKS) == written  # the committed example is fresh
    tasks = list(CapitalsTaskset(CapitalsTasksetConfig()))
    assert [row[TASK_KEY] for row in written] == [task.key for task in tasks]
    first = written[0]["responses_create_params"]
    assert first["input"] == [{"role": "user", "content": tasks[0].data.prompt}]
    [tool] = first["tools"]
    assert tool["name"] == "capital_of" and tool["description"] == "Look up the capital city of a country."
    assert tool["parameters"]["properties"]["country"]["type"] == "string"
    assert tool["parameters"]["required"] == ["country"]


async def test_describe_tools_lists_the_toolsets_tools_and_the_server_is_stateful(start):
    running = await start(_server())
    described = await ResourcesClient(Registry(static={"capitals": running.address}), "capitals").describe_tools()
    assert [t.name for t in described.tools] == ["capital_of"]
    assert json.loads(described.tools[0].parameters_json)["required"] == ["country"]
    assert not described.stateless


async def test_each_rollout_keeps_its_own_state_and_verify_runs_the_tasksets_scoring(start):
    running = await start(_server())
    client = ResourcesClient(Registry(static={"capitals": running.address}), "capitals")
    france, japan = _file_rows(TASKS)[:2]
    await client.seed_session("a", rows.task_from_row(france))
    await client.seed_session("b", rows.task_from_row(japan))
    looked = await client.call_tool("a", r.FunctionCall(name="capital_of", arguments='{"country": "France"}'))
    wrong = await client.call_tool("b", r.FunctionCall(name="capital_of", arguments='{"country": "Peru"}'))
    unknown = await client.call_tool("b", r.FunctionCall(name="capital_of", arguments='{"country": "Atlantis"}'))
    assert (looked.output, looked.error) == ("Paris", False)
    assert wrong.output == "Lima"
    assert unknown.error and "no capital known for 'Atlantis'" in unknown.output  # the tool's error, for the model

    def answer(text: str) -> r.Response:
        return r.Response(id=new_id("resp"), output=[rows.item_from_json({"role": "assistant", "content": text})])

    a = await client.verify("a", rows.task_from_row(france), answer("The capital of France is Paris."))
    b = await client.verify("b", rows.task_from_row(japan), answer("It is Lima."))
    assert a.reward == 1.0 and dict(a.reward_components) == {"correct": 1.0}
    assert rows.json_field(a, "fields") == {"looked_up": 1.0}  # the tool's write in session a reached the metric
    assert b.reward == 0.0 and rows.json_field(b, "fields") == {"looked_up": 0.0}  # b looked up Peru, not Japan
    await client.close_session("a")
    await client.close_session("b")
    assert running.app.sessions == {}


async def _stack(start, model) -> Registry:
    policy = await start(model)
    env = await start(_server())
    static = {"policy": policy.address, "capitals": env.address}
    config = {"model_server": "policy", "resources_server": "capitals", "max_steps": 4}
    agent = await start(SimpleAgent(config, name="agent", registry=Registry(static=static)))
    return Registry(static={**static, "agent": agent.address})


async def test_a_wrong_answer_after_a_tool_call_scores_what_verifiers_scores(start):
    row = _file_rows(TASKS)[1]  # Japan
    turns = [[call("capital_of", '{"country": "Japan"}')], say("The capital is Kyoto.")]
    registry = await _stack(start, ScriptedModel(turns))
    rollout = await AgentClient(registry, "agent").run(rows.task_from_row(row))
    response = rows.response_to_json(rollout.response)
    outputs = [item["output"] for item in response["output"] if item["type"] == "function_call_output"]
    assert outputs == ["Tokyo"]
    expected = await _verifiers_score(row, response)
    assert (rollout.reward, expected.reward) == (0.0, 0.0)
    assert rows.json_field(rollout, "verifier_fields") == {"looked_up": 1.0} == expected.metrics


async def test_the_embedded_policys_rollouts_score_as_verifiers_scores_them(start):
    registry = await _stack(start, LocalPolicyModel(name="policy"))
    agent = AgentClient(registry, "agent")
    rewards = []
    for row in _file_rows(TASKS) * 3:
        rollout = await agent.run(rows.task_from_row(row))
        response = rows.response_to_json(rollout.response)
        expected = await _verifiers_score(row, response)
        assert rollout.reward == expected.reward
        assert dict(rollout.reward_components) == {"correct": expected.rewards["correct"].score}
        assert rows.json_field(rollout, "verifier_fields") == expected.metrics
        rewards.append(rollout.reward)
    assert 1.0 in rewards


def _run(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    gym = str(Path(sys.executable).with_name("gym-grpc"))
    return subprocess.run([gym, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


@pytest.mark.slow
async def test_gym_grpc_run_and_collect_score_the_rollouts_as_verifiers_does(tmp_path):
    tasks = tmp_path / "capitals.jsonl"
    dumped = subprocess.run(
        [sys.executable, "-m", "gym_grpc.adapters.verifiers_server", "--taskset", TASKSET, "--output", str(tasks)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert dumped.returncode == 0, dumped.stderr
    assert _file_rows(tasks) == _file_rows(TASKS)
    output = tmp_path / "rollouts.jsonl"
    with start_run(configs=(CONFIG,)) as run:
        collected = _run(*collect_args(run.registry, "capitals_agent", tasks, output), "--num-repeats", "4")
        assert collected.returncode == 0, collected.stderr
    written = _file_rows(output)
    assert len(written) == 5 * 4
    for row in written:
        expected = await _verifiers_score(row, row["response"])
        assert row["reward"] == expected.reward
        assert row["reward_components"] == {"correct": expected.rewards["correct"].score}
        assert row["looked_up"] == expected.metrics["looked_up"]
        calls = [i for i in row["response"]["output"] if i["type"] == "function_call"]
        outputs = [i["output"] for i in row["response"]["output"] if i["type"] == "function_call_output"]
        for tool_call, tool_output in zip(calls, outputs, strict=True):  # the tool's answer reached the model
            country = json.loads(tool_call["arguments"])["country"]
            failed = tool_error_output(f"Error executing tool capital_of: no capital known for {country!r}")
            assert tool_output == CAPITALS.get(country.title(), failed)
    rewards = {row["reward"] for row in written}
    assert 1.0 in rewards  # the embedded policy looks the capital up and reports it


def not_a_taskset() -> dict:
    return {"tasks": []}


@pytest.mark.parametrize(
    ("taskset", "says"),
    [
        ("examples.no_such_module:CapitalsTaskset", "cannot import 'examples.no_such_module'"),
        ("examples.verifiers_taskset:NoSuchTaskset", "has no attribute 'NoSuchTaskset'"),
        ("examples.verifiers_taskset:CAPITALS", "is a dict, not a verifiers Taskset"),
        ("examples.verifiers_taskset:CapitalsState", "is a ModelMetaclass, not a verifiers Taskset"),
        ("examples.verifiers_taskset", "is not 'module:attribute'"),
    ],
)
def test_a_taskset_that_is_no_taskset_is_a_config_error_naming_the_key(taskset, says):
    with pytest.raises(errors.ConfigError, match=r"server 'capitals': config\.taskset: ") as raised:
        VerifiersTasksetServer.checked_config({"taskset": taskset}, "capitals")
    assert says in str(raised.value)


def test_a_factory_that_returns_no_taskset_or_wrong_arguments_are_config_errors():
    with pytest.raises(errors.ConfigError, match=r"config\.taskset: .*returned a dict, not a verifiers Taskset"):
        VerifiersTasksetServer({"taskset": f"{__name__}:not_a_taskset"}, name="capitals")
    with pytest.raises(
        errors.ConfigError, match=r"config\.taskset_args: CapitalsTasksetConfig of .*: countrys: Extra inputs"
    ):
        _server(taskset_args={"countrys": ["France"]})


def test_gym_grpc_run_refuses_a_wrong_taskset_naming_the_key():
    done = _run(
        "run",
        str(CONFIG),
        "--registry",
        "127.0.0.1:0",
        "servers.capitals.config.taskset=examples.verifiers_taskset:CAPITALS",
    )
    assert done.returncode != 0
    # the default layout runs the three servers as one process, which the message names with the server
    started = "process 'capitals_agent' (servers 'policy_model', 'capitals', 'capitals_agent') could not start"
    assert f"{started}: server 'capitals': config.taskset: " in done.stderr
    assert "'examples.verifiers_taskset:CAPITALS' is a dict, not a verifiers Taskset" in done.stderr


class TestVerifiersTasksetConformance(ResourcesConformance):
    task_row = _file_rows(TASKS)[0]
    answer = "The capital of France is Paris."

    def server(self) -> VerifiersTasksetServer:
        return _server()
