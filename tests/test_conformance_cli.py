"""`gym-grpc conformance HOST:PORT`: the kit's checks against a server that is already running.

The command runs as a real process; the servers it checks are a real
`gym-grpc run`, or servers this test serves on port 0, some of them broken
on purpose, each in one way a check must catch."""

from __future__ import annotations

import asyncio

import pytest

from gym_grpc import errors
from gym_grpc.agent import AgentServer
from gym_grpc.resources import Session
from gym_grpc.testing import Calculator, ScriptedModel, say, serving
from gym_grpc.testing.checks import AGENT_CHECKS, RESOURCES_CHECKS, name_of
from gym_grpc.v1 import task_pb2
from tests.support import REPO, gym, start_run, tool

WEATHER_ROWS = REPO / "servers" / "resources" / "weather" / "data" / "example.jsonl"


async def _conformance(*args: str) -> tuple[int, str, str]:
    """`gym-grpc conformance ARGS` in a child process, while this event loop goes on serving."""
    child = await asyncio.create_subprocess_exec(
        tool("gym-grpc"), "conformance", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    out, err = await asyncio.wait_for(child.communicate(), timeout=120)
    assert child.returncode is not None
    return child.returncode, out.decode(), err.decode()


def _lines(stdout: str, label: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(label + "  ")]


@pytest.fixture(scope="module")
def quickstart():
    run = start_run()
    yield run
    run.stop()


def test_the_weather_environment_of_a_real_run_passes(quickstart):
    done = gym("conformance", quickstart.servers["weather"], "--row", str(WEATHER_ROWS))
    assert done.returncode == 0, done.stdout + done.stderr
    passed = _lines(done.stdout, "PASS")
    assert len(passed) + len(_lines(done.stdout, "SKIP")) == len(RESOURCES_CHECKS)
    assert "PASS  an unknown tool is not found" in passed
    assert "resources server 'weather' at" in done.stdout and "0 failed" in done.stdout


def test_the_weather_agent_of_a_real_run_passes(quickstart):
    done = gym("conformance", quickstart.servers["weather_agent"], "--row", str(WEATHER_ROWS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert [line.split("  ", 1)[1] for line in _lines(done.stdout, "PASS")] == [name_of(c) for c in AGENT_CHECKS]
    assert "agent server 'weather_agent'" in done.stdout


def test_a_model_server_is_refused_by_its_role(quickstart):
    done = gym("conformance", quickstart.servers["policy_model"])
    assert done.returncode == 1
    assert "SERVER_ROLE_MODEL: conformance checks are for resources and agents" in done.stderr


async def test_without_a_row_the_task_offers_the_servers_tools_and_a_large_cap_is_skipped():
    async with serving(Calculator()) as calculator:
        code, out, err = await _conformance(calculator.address)
    assert code == 0, out + err
    assert "PASS  a stateful server refuses a closed or unknown session" in out
    assert "SKIP  seeding past the session cap is resource exhausted: the server's session cap 50000" in out


async def test_a_small_session_cap_is_filled_and_checked():
    async with serving(Calculator({"max_sessions": 3})) as calculator:
        code, out, err = await _conformance(
            calculator.address, "--row", '{"responses_create_params": {"input": "2+2"}}'
        )
    assert code == 0, out + err
    assert "PASS  seeding past the session cap is resource exhausted" in out


class NeedsAnExpectedAnswer(Calculator):
    """An environment whose tasks must carry data of its own, as most do."""

    async def seed_session(self, session: Session) -> None:
        if "expected_answer" not in session.data:
            raise errors.TaskDataError("expected_answer", "is required")
        await super().seed_session(session)


async def test_a_server_that_needs_task_data_fails_without_a_row_and_is_told_to_give_one():
    async with serving(NeedsAnExpectedAnswer()) as env:
        code, out, err = await _conformance(env.address)
        assert code == 1 and "task.data.expected_answer: is required" in out, out + err
        assert "give one of its task rows with --row" in out
        row = '{"responses_create_params": {"input": "2+2"}, "expected_answer": "4"}'
        code, out, err = await _conformance(env.address, "--row", row)
    assert code == 0 and "--row" not in out, out + err


class AnswersUnknownTools(Calculator):
    """Broken: a tool it does not have is answered with text instead of NOT_FOUND."""

    async def call_tool(self, session: Session, name: str, arguments: str) -> str:
        if name not in self.tools:
            return "no such tool, but here is an answer anyway"
        return await super().call_tool(session, name, arguments)


class VerifierRaises(Calculator):
    """Broken: its verify raises on every answer."""

    async def verify(self, session: Session, response) -> float:
        raise KeyError("expected_answer")


@pytest.mark.parametrize(
    ("broken", "failures"),
    [
        (
            AnswersUnknownTools,
            {"an unknown tool is not found": "CallTool of an unknown tool: answered OK, expected NOT_FOUND"},
        ),
        (
            VerifierRaises,
            {
                "a session seeds verifies and closes": "a call failed: INTERNAL",
                "metrics aggregate its own verdicts": "a call failed: INTERNAL",
            },
        ),
    ],
)
async def test_a_server_that_answers_a_check_wrongly_fails_it_by_name(broken, failures):
    async with serving(broken()) as server:
        code, out, err = await _conformance(server.address)
    assert code == 1, out + err
    failed = dict(line.removeprefix("FAIL  ").split(": ", 1) for line in _lines(out, "FAIL"))
    assert failed.keys() == failures.keys()
    for check, why in failures.items():
        assert failed[check].startswith(why), failed[check]
    assert f"{len(failures)} failed" in out


class SkipsTheModel(AgentServer):
    """Broken: a rollout that never called the model."""

    async def run(self, task, events, *, verify: bool = True) -> task_pb2.Rollout:
        rollout = task_pb2.Rollout(reward=1.0)
        rollout.response.output.extend(say("done"))
        rollout.timings.total_seconds = 0.001
        return rollout


async def test_an_agent_that_skips_the_model_fails_the_run_check():
    async with serving(SkipsTheModel(name="lazy")) as agent:
        code, out, err = await _conformance(agent.address, "--row", '{"responses_create_params": {"input": "hi"}}')
    assert code == 1, out + err
    assert "FAIL  a run returns a verified rollout: Run: the rollout counts no model call" in out
    assert "PASS  a task without input is invalid" in out


async def test_a_scripted_model_is_not_checked_as_a_resources_server_unless_asked():
    async with serving(ScriptedModel([say("hi")])) as model:
        code, out, err = await _conformance(model.address, "--role", "resources")
    assert code == 1
    assert "FAIL  it serves health and reflection: reflection does not list ['gym.v1.ResourcesService']" in out


def test_an_address_nobody_serves_is_one_clear_line():
    done = gym("conformance", "127.0.0.1:1")
    assert done.returncode == 1
    assert done.stderr.startswith("Error: 127.0.0.1:1: UNAVAILABLE")


def test_a_row_that_is_not_a_task_is_a_usage_error(tmp_path):
    done = gym("conformance", "127.0.0.1:1", "--row", '{"no": "params"}')
    assert done.returncode == 2 and "--row" in done.stderr and "responses_create_params" in done.stderr
    done = gym("conformance", "127.0.0.1:1", "--row", str(tmp_path / "missing.jsonl"))
    assert done.returncode == 2 and "neither a JSON object nor a file" in done.stderr
