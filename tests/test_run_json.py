"""AgentService.RunJson: a JSON task row in, the rollout row out as JSON, for clients with no conversion code."""

from __future__ import annotations

import json
import shutil
import subprocess

import grpc
import pytest

from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.rpc import transport
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import agent_service_pb2_grpc as agent_grpc
from tests.corpus import nemo_gym_lines
from tests.support import Calculator, EchoModel, start_run, static_registry, tool


@pytest.mark.slow
def test_grpcurl_rolls_out_a_nemo_gym_row_and_gets_its_rollout_row(tmp_path):
    """The documented pipeline, with the real jq and grpcurl, on a row of NeMo Gym's own pi_math tasks."""
    assert shutil.which("jq"), "jq is needed: apt-get install jq"
    line = next(raw for name, _, raw in nemo_gym_lines("example.jsonl") if name.startswith("environments/pi_math/"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_bytes(line + b"\n")
    run = start_run()
    try:
        agent = run.servers["math_agent"]
        pipeline = (
            f"jq -c '{{row_json: tojson}}' {tasks} | "
            f"{tool('grpcurl')} -plaintext -d @ {agent} gym.v1.AgentService/RunJson | jq -r .rollout_json"
        )
        done = subprocess.run(pipeline, shell=True, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        row = json.loads(done.stdout)
    finally:
        run.stop()
    given = json.loads(line)
    assert {k: row[k] for k in given} == given  # the task row comes back as it was
    assert row["response"]["output"] and row["response"]["object"] == "response"
    assert row["reward"] in (0.0, 1.0) and "verifier_fields" in row
    assert row["stop_reason"] in ("final_message", "max_steps", "incomplete") and row["model_calls"] >= 1


@pytest.fixture
async def agent(start):
    model = await start(EchoModel())
    calc = await start(Calculator())
    registry = static_registry(model=model, calc=calc)
    server = await start(
        SimpleAgent({"model_server": "model", "resources_server": "calc"}, name="a", registry=registry)
    )
    channel = transport.open_channel(server.address)
    yield agent_grpc.AgentServiceStub(channel)
    await channel.close()


@pytest.mark.parametrize(
    "row_json, field",
    [
        ("not json", "row_json"),
        ('{"a": 1, "a": 2}', "row_json"),
        ('{"expected_answer": 5}', "responses_create_params"),
        (
            '{"responses_create_params": {"input": [{"role": "user", "content": 7}]}}',
            "responses_create_params.input[0].content",
        ),
    ],
)
async def test_a_row_that_is_not_a_task_row_is_invalid_argument_naming_the_field(agent, row_json, field):
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await agent.RunJson(agent_pb.RunJsonRequest(row_json=row_json), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(field + ":"), error.value.details()


async def test_run_json_answers_what_collect_writes_for_the_row(agent):
    row = {
        "responses_create_params": {"input": "What is 2 + 3?", "temperature": 1.0},
        "expected_answer": 5,
        "id": 2**60,
    }
    reply = await agent.RunJson(agent_pb.RunJsonRequest(row_json=json.dumps(row)), timeout=30)
    out = json.loads(reply.rollout_json)
    assert {k: out[k] for k in row} == row and isinstance(out["responses_create_params"]["temperature"], float)
    assert set(out) >= {"response", "reward", "verifier_fields", "stop_reason", "model_calls", "timings"}
    skipped = await agent.RunJson(agent_pb.RunJsonRequest(row_json=json.dumps(row), skip_verification=True), timeout=30)
    assert json.loads(skipped.rollout_json)["verification_skipped"] is True
