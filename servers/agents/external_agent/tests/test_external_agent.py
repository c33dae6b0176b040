"""The external agent: real agent programs (the openai SDK in child processes) against real gRPC servers."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import grpc
import openai
import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.external_agent.agent import ExternalAgent
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.bundled.servers.resources.weather.server import WeatherEnv
from gym_grpc.client.stubs import AgentClient
from gym_grpc.errors import ConfigError
from gym_grpc.responses import item_body
from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import GymServer
from gym_grpc.testing import AgentConformance, Calculator, ScriptedModel, call, say, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.testing.fake_engine import IM_END, IM_START, Turn, encode
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from tests.support import alive

EXAMPLE = Path(__file__).resolve().parent.parent / "example_agent.py"


def _with_ids(items: list[r.Item], prompt: list[int], generated: list[int]) -> list[r.Item]:
    """A turn whose last item carries token ids and log-probs, as a model server gives them."""
    body = item_body(items[-1])
    body.prompt_token_ids.extend(prompt)
    body.generation_token_ids.extend(generated)
    body.generation_log_probs.extend([-0.25] * len(generated))
    return items


def _script(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "agent_program.py"
    path.write_text(text)
    return [sys.executable, str(path)]


async def _rollout(start, model, command, *, the_task=None, policy_version=None, **config):
    m = await start(model)
    env = await start(Calculator())
    agent = ExternalAgent(
        {"model_server": "model", "resources_server": "calc", "command": command, **config},
        name="agent",
        registry=static_registry(model=m, calc=env),
    )
    a = await start(agent)
    client = AgentClient(static_registry(agent=a), "agent")
    try:
        return await client.run(
            the_task or task("What is 2 + 3?", expected_answer=5), timeout=120, policy_version=policy_version
        )
    finally:
        await client.registry.close()


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_the_openai_sdk_in_a_tool_loop_is_recorded_with_every_turns_token_ids_and_verified(start, api):
    first = _with_ids([call("add", '{"a": 2, "b": 3}')], [1, 2, 3], [10, 11, 12, 13])
    second = _with_ids(say("2 + 3 is 5."), [1, 2, 3, 10, 11, 12, 13, 20, 21], [30, 31, 32])
    model = ScriptedModel([first, second])
    rollout = await _rollout(start, model, [sys.executable, str(EXAMPLE), "--api", api], policy_version=7)

    assert rollout.reward == 1.0
    assert json.loads(rollout.verifier_fields_json) == {"tool_calls_seen": 1}  # the tool ran in the environment
    assert rollout.model_calls == 2 and rollout.stop_reason == task_pb2.STOP_REASON_FINAL_MESSAGE
    output = rollout.response.output
    assert [i.WhichOneof("item") for i in output] == ["function_call", "function_call_output", "message"]
    assert list(output[0].function_call.generation_token_ids) == [10, 11, 12, 13]
    assert list(output[0].function_call.prompt_token_ids) == [1, 2, 3]
    assert list(output[2].message.generation_token_ids) == [30, 31, 32]
    assert list(output[2].message.generation_log_probs) == [-0.25] * 3
    assert output[0].function_call.policy_version == 7 and output[2].message.policy_version == 7
    assert output[1].function_call_output.output == "5"
    assert output[1].function_call_output.call_id == output[0].function_call.call_id
    # The second model call got the first turn back with its ids, though the program never saw them.
    sent_back = [i for i in model.requests[1].input_items.items if i.WhichOneof("item") == "function_call"]
    assert len(sent_back) == 1 and list(sent_back[0].function_call.generation_token_ids) == [10, 11, 12, 13]


async def test_run_stream_reports_each_model_call_and_tool_call_of_the_program(start):
    model = ScriptedModel([[call("add", '{"a": 2, "b": 3}')], say("It is 5.")])
    m, env = await start(model), await start(Calculator())
    config = {"model_server": "model", "resources_server": "calc", "command": [sys.executable, str(EXAMPLE)]}
    a = await start(ExternalAgent(config, name="agent", registry=static_registry(model=m, calc=env)))
    client = AgentClient(static_registry(agent=a), "agent")
    try:
        kinds = [e.WhichOneof("event") async for e in client.run_stream(task("2 + 3?", expected_answer=5), timeout=120)]
    finally:
        await client.registry.close()
    assert kinds == ["model_call", "tool_call", "model_call", "verification", "rollout"]


PROBE = """
import json, os
import openai

base = os.environ["OPENAI_BASE_URL"]
client = openai.OpenAI(max_retries=0)
seen = {}


def attempt(name, request):
    try:
        request()
        seen[name] = "accepted"
    except openai.APIStatusError as e:
        seen[name] = [e.status_code, e.message]


messages = [{"role": "user", "content": "What is 2 + 3?"}]
attempt("chat_stream", lambda: list(client.chat.completions.create(model="m", messages=messages, stream=True)))
attempt("responses_stream", lambda: list(client.responses.create(model="m", input="2 + 3?", stream=True)))
attempt("previous_response", lambda: client.responses.create(model="m", input="2 + 3?", previous_response_id="r1"))
attempt("bad_role", lambda: client.chat.completions.create(model="m", messages=[{"role": "robot", "content": "x"}]))
other = openai.OpenAI(base_url=base.replace(os.environ["GYM_GRPC_SESSION_ID"], "nope"), max_retries=0)
attempt("unknown_session", lambda: other.chat.completions.create(model="m", messages=messages))
seen["models"] = [model.id for model in client.models.list()]
# A client whose base URL is fixed: the session id is its API key (OPENAI_API_KEY), sent as the bearer token.
fixed = openai.OpenAI(base_url=base.split("/s/")[0] + "/v1", max_retries=0)
seen["answer"] = fixed.chat.completions.create(model="m", messages=messages).choices[0].message.content
with open(os.environ["PROBE_RESULT"], "w") as f:
    json.dump(seen, f)
"""


async def test_what_the_endpoint_does_not_serve_is_a_clear_4xx_error_the_sdk_raises(start, tmp_path):
    result = tmp_path / "seen.json"
    model = ScriptedModel([say("2 + 3 is 5.")])
    rollout = await _rollout(start, model, _script(tmp_path, PROBE), env={"PROBE_RESULT": str(result)})
    seen = json.loads(result.read_text())
    assert seen["chat_stream"][0] == 400 and "stream: streaming is not supported" in seen["chat_stream"][1]
    assert seen["responses_stream"][0] == 400 and "stream: streaming is not supported" in seen["responses_stream"][1]
    assert seen["previous_response"][0] == 400 and "send the whole conversation" in seen["previous_response"][1]
    assert seen["bad_role"][0] == 400 and "messages[0].role" in seen["bad_role"][1]
    assert seen["unknown_session"][0] == 404
    assert "no rollout is running under session id 'nope'" in seen["unknown_session"][1]
    assert seen["models"] == ["gym-grpc"]
    assert seen["answer"] == "2 + 3 is 5."
    assert len(model.requests) == 1  # the refused requests never reached the model server
    assert rollout.reward == 1.0 and rollout.model_calls == 1


async def test_a_session_no_rollout_has_is_not_found_for_any_client(start):
    model, env = await start(ScriptedModel([say("5")])), await start(Calculator())
    config = {"model_server": "model", "resources_server": "calc", "command": ["true"]}
    agent = ExternalAgent(config, name="agent", registry=static_registry(model=model, calc=env))
    await start(agent)
    client = openai.AsyncOpenAI(base_url=agent.endpoint.base_url("nope"), api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no rollout is running under session id 'nope'"):
        await client.responses.create(model="m", input="hello")
    # Without the session in the path, the API key is the session id.
    fixed = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{agent.endpoint.port}/v1", api_key="sk-1", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no rollout is running under session id 'sk-1'"):
        await fixed.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    await client.close()
    await fixed.close()


CRASH = """
import openai

openai.OpenAI().chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2 + 3?"}])
raise RuntimeError("the agent fell over")
"""


async def test_a_program_that_crashes_fails_the_rollout_with_what_it_wrote(start, tmp_path):
    with pytest.raises(errors.GymError) as failed:
        await _rollout(start, ScriptedModel([say("5")]), _script(tmp_path, CRASH))
    error = failed.value
    assert error.code == grpc.StatusCode.INTERNAL and error.reason == errors.Reason.AGENT_PROCESS_FAILED
    assert "exited with code 1 after 1 model calls" in error.message
    assert "RuntimeError: the agent fell over" in error.message


HANG = """
import os, subprocess, sys, time

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(os.environ["PIDS_FILE"], "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
time.sleep(600)
"""


async def test_a_program_that_hangs_is_stopped_with_what_it_started_and_the_rollout_fails(start, tmp_path):
    pids = tmp_path / "pids"
    with pytest.raises(errors.GymError) as failed:
        await _rollout(
            start, ScriptedModel([say("5")]), _script(tmp_path, HANG), timeout_seconds=5, env={"PIDS_FILE": str(pids)}
        )
    assert failed.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "was still running after 5 s" in failed.value.message
    program, child = map(int, pids.read_text().split())
    assert not alive(program) and not alive(child)


LEAVES_A_CHILD = """
import os, subprocess, sys
import openai

openai.OpenAI().chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 2 + 3?"}])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # holds our stdout and stderr
with open(os.environ["PIDS_FILE"], "w") as f:
    f.write(str(child.pid))
"""


async def test_a_program_that_exits_leaving_a_child_behind_ends_its_rollout_and_the_child(start, tmp_path):
    pids = tmp_path / "pids"
    program = _script(tmp_path, LEAVES_A_CHILD)
    rollout = await _rollout(
        start, ScriptedModel([say("It is 5.")]), program, timeout_seconds=60, env={"PIDS_FILE": str(pids)}
    )
    assert rollout.reward == 1.0
    assert not alive(int(pids.read_text()))


async def test_a_program_that_never_calls_the_model_fails_the_rollout(start, tmp_path):
    with pytest.raises(errors.GymError, match="exited without calling the model at its OPENAI_BASE_URL") as failed:
        await _rollout(start, ScriptedModel([say("5")]), _script(tmp_path, "print('done, I think')"))
    assert failed.value.reason == errors.Reason.AGENT_PROCESS_FAILED
    assert "done, I think" in failed.value.message


async def test_a_program_that_cannot_start_fails_the_rollout_naming_it(start, tmp_path):
    with pytest.raises(errors.GymError, match="cannot start the agent program") as failed:
        await _rollout(start, ScriptedModel([say("5")]), [str(tmp_path / "no-such-agent")])
    assert failed.value.reason == errors.Reason.AGENT_PROCESS_FAILED


async def test_a_failing_model_server_fails_the_rollout_with_its_error(start):
    def broken(params: r.CreateParams) -> r.Response:
        raise RuntimeError("the engine caught fire")

    with pytest.raises(errors.GymError) as failed:
        await _rollout(start, ScriptedModel([broken]), [sys.executable, str(EXAMPLE)])
    assert failed.value.code == grpc.StatusCode.INTERNAL
    assert "model server 'model' CreateResponse" in failed.value.message


async def test_at_max_steps_the_program_is_stopped_and_the_rollout_verified_as_it_stands(start):
    model = ScriptedModel([[call("add", '{"a": 2, "b": 3}')]])  # calls a tool for ever
    rollout = await _rollout(start, model, [sys.executable, str(EXAMPLE), "--max-turns", "50"], max_steps=2)
    assert rollout.model_calls == 2 and len(model.requests) == 2
    assert rollout.stop_reason == task_pb2.STOP_REASON_MAX_STEPS
    assert rollout.reward == 0.0 and not rollout.verification_skipped


def test_the_program_is_given_as_a_command_or_a_python_module_and_not_both():
    base = {"model_server": "m", "resources_server": "r"}
    with pytest.raises(ConfigError, match="server 'ext'.*command .* or python"):
        ExternalAgent(base, name="ext")
    with pytest.raises(ConfigError, match="server 'ext'"):
        ExternalAgent({**base, "command": ["a"], "python": "b"}, name="ext")
    with pytest.raises(ConfigError, match="config.comand.*did you mean 'command'"):
        ExternalAgent({**base, "comand": ["a"]}, name="ext")
    beside = ExternalAgent({**base, "python": ".example_agent:main"}, name="ext").argv
    assert beside[0] == sys.executable and beside[-2:] == [
        "gym_grpc.bundled.servers.agents.external_agent.example_agent",
        "main",
    ]
    assert ExternalAgent({**base, "python": "my.agent"}, name="ext").argv == [sys.executable, "-m", "my.agent"]


class TestExternalAgentConformance(AgentConformance):
    task_row = {"responses_create_params": {"input": "What is the weather in Oslo?"}, "expected_city": "Oslo"}

    def dependencies(self) -> dict[str, GymServer]:
        return {"policy_model": LocalPolicyModel({"seed": 1}), "weather": WeatherEnv()}

    def agent(self, registry: Registry) -> ExternalAgent:
        config = {"model_server": "policy_model", "resources_server": "weather", "python": ".example_agent:main"}
        return ExternalAgent(config, registry=registry)


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_a_token_in_token_out_model_server_extends_the_ids_the_model_sampled(start, fake_engine, api):
    """Through a real token path (the vLLM model server on a fake vLLM whose model samples token splits
    its tokenizer never makes): the program's history, which never held ids, reaches the model server
    with them, so every later prompt is the earlier prompt and generation extended, never re-rendered."""
    script = [
        Turn(content="<think>Add with the tool.</think>", tool_calls=[("add", '{"a": 2,   "b": 3}')]),
        Turn(content="The answer is 5."),
    ]
    fake = await fake_engine(list(script), sampled_splits=True)
    model = VLLMModel({"base_url": fake.base_url, "model": "p", "return_token_ids": True}, name="m")
    rollout = await _rollout(start, model, [sys.executable, str(EXAMPLE), "--api", api])
    assert rollout.reward == 1.0
    bodies = [item_body(i) for i in rollout.response.output if i.WhichOneof("item") != "function_call_output"]
    carriers = [body for body in bodies if body.generation_token_ids]
    assert len(carriers) == 2
    first, second = carriers
    sampled = [*first.prompt_token_ids, *first.generation_token_ids]
    assert sampled[-1] == IM_END
    tool_turn = [IM_START, *encode("tool\n5"), IM_END, *encode("\n")]
    assert list(second.prompt_token_ids) == [*sampled, *encode("\n"), *tool_turn, IM_START, *encode("assistant\n")]
    assert sum(model.counters.histories.values()) == 0  # no history broke its ids


async def test_rollouts_past_max_programs_wait_for_a_slot(start):
    running_at_each_call: list[int] = []

    def answer(params: r.CreateParams) -> r.Response:
        running_at_each_call.append(len(agent.recordings))
        return r.Response(id="resp_1", status=r.RESPONSE_STATUS_COMPLETED, output=say("It is 5."))

    m, env = await start(ScriptedModel([answer])), await start(Calculator())
    config = {"model_server": "model", "resources_server": "calc", "max_programs": 1}
    agent = ExternalAgent(
        {**config, "command": [sys.executable, str(EXAMPLE)]}, name="agent", registry=static_registry(model=m, calc=env)
    )
    client = AgentClient(static_registry(agent=await start(agent)), "agent")
    try:
        rollouts = await asyncio.gather(*(client.run(task("2 + 3?", expected_answer=5), timeout=120) for _ in range(3)))
    finally:
        await client.registry.close()
    assert [rollout.reward for rollout in rollouts] == [1.0] * 3
    assert running_at_each_call == [1, 1, 1]


async def test_a_program_in_the_rollouts_sandbox_reaches_only_its_endpoint_and_its_work_is_scored(start, tmp_path):
    """`in_sandbox`: the program runs in the terminal environment's bubblewrap sandbox for the rollout. It
    finds itself there (its host, no way to a listener on the host's loopback, no host file), its one tool
    call edits the sandbox's repository, and the task's hidden tests score that; every turn has its ids."""
    from gym_grpc.bundled.servers.resources.terminal.server import TerminalEnv
    from gym_grpc.data import rows

    terminal = Path(__file__).resolve().parents[3] / "resources" / "terminal"
    solve = (terminal / "tasks" / "git-commit-feature-branch" / "solution" / "solve.sh").read_text()
    row = next(
        row
        for row in map(json.loads, (terminal / "data" / "example.jsonl").read_text().splitlines())
        if row["task"] == "git-commit-feature-branch"
    )
    listener = await asyncio.start_server(lambda reader, writer: writer.close(), "127.0.0.1", 0)
    secret = tmp_path / "secret.txt"
    secret.write_text("host only")
    first = _with_ids([call("run_command", json.dumps({"command": solve}))], [1, 2, 3], [10, 11, 12])
    second = _with_ids(say("Committed on feature/greeting."), [1, 2, 3, 10, 11, 12, 20], [30, 31])
    m = await start(ScriptedModel([first, second]))
    env = await start(TerminalEnv({"sandbox": {"python_packages": True}}, name="terminal"))
    env_vars = {"PROBE_PORT": str(listener.sockets[0].getsockname()[1]), "PROBE_SECRET": str(secret)}
    agent = ExternalAgent(
        {
            "model_server": "model",
            "resources_server": "terminal",
            "python": "tests.programs.sandbox_probe:main",
            "in_sandbox": True,
            "env": env_vars,
        },
        name="agent",
        registry=static_registry(model=m, terminal=env),
    )
    a = await start(agent)
    client = AgentClient(static_registry(agent=a), "agent")
    try:
        rollout = await client.run(rows.task_from_row(row), timeout=120)
    finally:
        await client.registry.close()
        listener.close()
    assert rollout.reward == 1.0, rollout.response.output[1].function_call_output.output
    assert rollout.model_calls == 2
    output = rollout.response.output
    assert [i.WhichOneof("item") for i in output] == ["function_call", "function_call_output", "message"]
    assert list(output[0].function_call.generation_token_ids) == [10, 11, 12]
    assert list(output[2].message.generation_token_ids) == [30, 31]
