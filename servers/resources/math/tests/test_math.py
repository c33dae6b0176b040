"""The math environment checks answers with math-verify, off the event loop."""

from pathlib import Path

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.math.server import MathEnv
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.testing import ResourcesConformance, example_rows, static_registry
from gym_grpc.v1 import responses_pb2 as r

EXAMPLES = Path(__file__).resolve().parents[1] / "data" / "example.jsonl"


@pytest.fixture
async def math_env(start):
    server = await start(MathEnv())
    client = ResourcesClient(static_registry(math=server), "math")
    yield client
    await client.registry.close()


def _task(expected):
    return rows.task_from_row({"responses_create_params": {"input": "?"}, "expected_answer": expected})


async def _reward(client, expected, answer):
    verdict = await client.verify("s", _task(expected), r.Response(output=[assistant_message(answer)]))
    return verdict.reward, rows.json_field(verdict, "fields")


@pytest.mark.parametrize(
    "expected, answer, reward",
    [
        ("\\frac{7}{8}", "So the sum is \\boxed{\\frac{7}{8}}.", 1.0),
        ("\\frac{7}{8}", "The answer is \\boxed{0.875}.", 1.0),
        ("0.875", "\\boxed{7/8}", 1.0),
        (42, "17 + 25 = 42. The answer is \\boxed{42}.", 1.0),
        (42, "The answer is \\boxed{43}.", 0.0),
        ("x^2 + 2x + 1", "\\boxed{(x+1)^2}", 1.0),
        ("12", "I am not sure.", 0.0),
    ],
)
async def test_answers_are_checked_for_mathematical_equivalence(math_env, expected, answer, reward):
    got, fields = await _reward(math_env, expected, answer)
    assert got == reward
    assert "extracted_answer" in fields


async def test_a_task_without_expected_answer_fails_verification_clearly(math_env):
    task = rows.task_from_row({"responses_create_params": {"input": "?"}})
    with pytest.raises(errors.GymError) as error:
        await math_env.verify("s", task, r.Response(output=[assistant_message("\\boxed{1}")]))
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.field == "task.data.expected_answer"
    assert "task.data.expected_answer: is required" in error.value.message


def test_the_example_rows_are_tasks():
    assert len(example_rows(EXAMPLES, MathEnv)) == 6


class TestMathConformance(ResourcesConformance):
    task_row = {"responses_create_params": {"input": "What is 17 + 25?"}, "expected_answer": "42"}
    answer = "\\boxed{42}"

    def server(self) -> MathEnv:
        return MathEnv()


def test_a_groups_expected_answer_is_parsed_once_in_a_checking_process(monkeypatch):
    """The rollouts of a group share their expected answer: parsed at its first check, kept for the
    rest; an expected answer that parses to nothing is parsed again at each check, never kept."""
    import math_verify

    from gym_grpc.bundled.servers.resources.math import server

    parsed: list[str] = []
    real = math_verify.parse
    monkeypatch.setattr(math_verify, "parse", lambda text, **kw: parsed.append(text) or real(text, **kw))
    monkeypatch.setattr(server, "_GOLD", {})
    for answer, correct in [("\\boxed{12}", True), ("\\boxed{13}", False), ("6 + 6 = 12", True)]:
        assert server.check_answer("12", answer, 5)[0] is correct
    assert parsed.count("$12$") == 1 and len(parsed) == 4
    for _ in range(2):
        assert server.check_answer("$$", "\\boxed{12}", 5)[0] is False
    assert parsed.count("$$") == 2
