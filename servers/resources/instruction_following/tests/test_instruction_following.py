"""The instruction-following environment: each check, the reward modes, and the
reward components on their way to the collected rollout row."""

import io
import json
import math
from pathlib import Path

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.batch.collector import CollectOptions, collect
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.resources.instruction_following.server import (
    CHECKS,
    InstructionFollowingEnv,
    component_names,
    count_words,
    read_instructions,
)
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.testing import ResourcesConformance, ScriptedModel, example_rows, say, static_registry
from gym_grpc.v1 import responses_pb2 as r

DATA = Path(__file__).resolve().parent.parent / "data" / "example.jsonl"


def _passes(instruction, text):
    [check] = read_instructions({"instructions": [instruction]})
    return check.passes(text)


@pytest.mark.parametrize(
    "instruction, text, passes",
    [
        ({"type": "max_words", "value": 3}, "one two three", True),
        ({"type": "max_words", "value": 3}, "one two three four", False),
        ({"type": "max_words", "value": 3}, "don't well-known - — 42 !", True),  # dashes and marks are no words
        ({"type": "min_words", "value": 2}, "one two", True),
        ({"type": "min_words", "value": 2}, "one", False),
        ({"type": "include_keywords", "keywords": ["Sleep", "rest"]}, "Good sleep and REST.", True),
        ({"type": "include_keywords", "keywords": ["sleep"]}, "They were sleepy.", False),  # whole words only
        ({"type": "include_keywords", "keywords": ["sleep", "rest"]}, "Good sleep.", False),
        ({"type": "include_keywords", "keywords": ["C++"]}, "I write C++ daily.", True),
        ({"type": "exclude_keywords", "keywords": ["plastic"]}, "A steel bottle.", True),
        ({"type": "exclude_keywords", "keywords": ["plastic"]}, "No Plastic here.", False),
        ({"type": "exclude_keywords", "keywords": ["plastic"]}, "Bioplastics are different.", True),
        ({"type": "json_format"}, '{"capital": "Ottawa"}', True),
        ({"type": "json_format"}, '```json\n{"capital": "Ottawa"}\n```', True),
        ({"type": "json_format"}, "```\n[1, 2]\n```", True),
        ({"type": "json_format"}, '"just a string"', False),  # an object or an array
        ({"type": "json_format"}, 'Here it is: {"capital": "Ottawa"}', False),
        ({"type": "json_format"}, "{capital: Ottawa}", False),
        ({"type": "no_commas"}, "no commas here.", True),
        ({"type": "no_commas"}, "one, two", False),
        ({"type": "end_with", "phrase": "Stay hydrated."}, "Drink up. stay hydrated.  \n", True),
        ({"type": "end_with", "phrase": "Stay hydrated."}, "Stay hydrated!", False),
        ({"type": "end_with", "phrase": "Stay hydrated."}, "Stay hydrated. Cheers.", False),
        ({"type": "num_bullets", "value": 2}, "Intro:\n* one\n  - two\n", True),
        ({"type": "num_bullets", "value": 2}, "* one\n* two\n+ three", False),
        ({"type": "num_bullets", "value": 1}, "**Bold** line\n---\n* one", True),  # bold and rules are no bullets
        ({"type": "num_bullets", "value": 0}, "No list at all.", True),
        ({"type": "lowercase"}, "all quiet on the shore.", True),
        ({"type": "lowercase"}, "all quiet on the Shore.", False),
        ({"type": "lowercase"}, "123 !", False),  # no letter at all
    ],
)
def test_each_check_judges_the_text(instruction, text, passes):
    assert _passes(instruction, text) is passes


def test_an_answer_too_deep_to_parse_is_not_json_format():
    assert _passes({"type": "json_format"}, "[" * 100_000 + "]" * 100_000) is False  # Python's parser overflows


def test_words_are_runs_with_a_letter_or_digit():
    assert count_words("It's a well-known fact — 3 cats!") == 6


@pytest.mark.parametrize(
    "instructions, message",
    [
        (None, "instructions: expected a non-empty list"),
        ([], "instructions: expected a non-empty list"),
        ([{"type": "max_words", "value": 5}, "lowercase"], 'instructions\\[1\\]: expected an object with a "type"'),
        ([{"type": "no_commas"}, {"type": "rhyme"}], "instructions\\[1\\]: unknown type 'rhyme'"),
        ([{"value": 3}], "instructions\\[0\\]: unknown type None"),
        ([{"type": "max_words"}], "instructions\\[0\\]: max_words: value: Field required"),
        ([{"type": "max_words", "value": -1}], "instructions\\[0\\]: max_words: value:"),
        ([{"type": "no_commas", "strict": True}], "instructions\\[0\\]: no_commas: strict: Extra inputs"),
        ([{"type": "include_keywords", "keywords": [" "]}], "instructions\\[0\\]: include_keywords: keywords.0"),
        ([{"type": "end_with", "phrase": ""}], "instructions\\[0\\]: end_with: phrase"),
    ],
)
def test_a_malformed_instruction_is_an_error_naming_its_index_and_type(instructions, message):
    with pytest.raises(errors.TaskDataError, match=message):
        read_instructions({"instructions": instructions})


def test_components_are_named_by_type_with_an_index_only_when_a_type_repeats():
    checks = read_instructions(
        {
            "instructions": [
                {"type": "include_keywords", "keywords": ["a"]},
                {"type": "no_commas"},
                {"type": "include_keywords", "keywords": ["b"]},
            ]
        }
    )
    assert component_names(checks) == ["include_keywords_0", "no_commas", "include_keywords_2"]


def test_every_check_type_is_documented_in_the_module():
    from gym_grpc.bundled.servers.resources.instruction_following import server

    for kind in CHECKS:
        assert f"`{kind}`" in server.__doc__


INSTRUCTIONS = [{"type": "max_words", "value": 5}, {"type": "no_commas"}, {"type": "lowercase"}]


def _row(**fields):
    return {"responses_create_params": {"input": "Say hi."}, "instructions": INSTRUCTIONS, **fields}


@pytest.fixture
async def env(start):
    server = await start(InstructionFollowingEnv())
    client = ResourcesClient(static_registry(env=server), "env")
    yield client
    await client.registry.close()


async def _verify(client, row, answer):
    return await client.verify("s", rows.task_from_row(row), r.Response(output=[assistant_message(answer)]))


@pytest.mark.parametrize(
    "row, answer, reward, failed",
    [
        (_row(), "hi there friend", 1.0, []),
        (_row(), "Hi there, friend", 0.0, ["no_commas", "lowercase"]),
        (_row(reward_mode="fraction"), "Hi there, friend", 1 / 3, ["no_commas", "lowercase"]),
        (_row(reward_mode="fraction"), "hi there friend", 1.0, []),
        (_row(reward_mode="all"), "hi, this is far too many words", 0.0, ["max_words", "no_commas"]),
    ],
)
async def test_the_reward_mode_decides_how_checks_add_up(env, row, answer, reward, failed):
    verdict = await _verify(env, row, answer)
    assert verdict.reward == pytest.approx(reward)
    fields = rows.json_field(verdict, "fields")
    assert fields == {"instructions_passed": 3 - len(failed), "instructions_total": 3, "instructions_failed": failed}
    assert dict(verdict.reward_components) == {
        name: 0.0 if name in failed else 1.0 for name in ("max_words", "no_commas", "lowercase")
    }


async def test_the_configs_reward_mode_is_the_default(start):
    server = await start(InstructionFollowingEnv({"reward_mode": "fraction"}))
    client = ResourcesClient(static_registry(env=server), "env")
    assert (await _verify(client, _row(), "Hi there, friend")).reward == pytest.approx(1 / 3)
    assert (await _verify(client, _row(reward_mode="all"), "Hi there, friend")).reward == 0.0
    await client.registry.close()


@pytest.mark.parametrize(
    "row, message",
    [
        (_row(instructions=[{"type": "no_commas"}, {"type": "haiku"}]), "instructions[1]: unknown type 'haiku'"),
        (_row(reward_mode="most"), "reward_mode: 'most'"),
    ],
)
async def test_a_malformed_row_fails_verification_with_a_clear_message(env, row, message):
    with pytest.raises(errors.GymError) as error:
        await _verify(env, row, "hi")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert message in error.value.message
    assert error.value.field == "task.data." + message.split(":")[0]


async def test_every_example_row_loads_and_verifies(env):
    examples = example_rows(DATA, InstructionFollowingEnv)
    assert len(examples) == 5
    for row in examples:
        verdict = await _verify(env, row, "I am not sure how to answer that.")
        assert math.isfinite(verdict.reward) and 0.0 <= verdict.reward <= 1.0
        assert len(verdict.reward_components) == len(row["instructions"])


async def test_reward_components_reach_the_collected_rows_and_the_summary(start, tmp_path):
    model = await start(ScriptedModel([say("* better sleep\n* more energy\n* a stronger heart")]))
    env = await start(InstructionFollowingEnv())
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "env"},
            name="agent",
            registry=static_registry(model=model, env=env),
        )
    )
    registry = static_registry(agent=agent)
    lines = DATA.read_text().splitlines()
    (tmp_path / "tasks.jsonl").write_text(lines[1] + "\n")  # 3 bullets, mention sleep
    options = CollectOptions(
        input=tmp_path / "tasks.jsonl", output=tmp_path / "out.jsonl", agent="agent", progress=False
    )
    summary = await collect(registry, options, log=io.StringIO())
    [row] = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert row["reward"] == 1.0
    assert row["reward_components"] == {"num_bullets": 1.0, "include_keywords": 1.0}
    assert row["instructions_passed"] == 2 and "instructions_passed" in row["verifier_fields"]
    metrics = summary.metrics["agent"]
    assert metrics["reward_components.num_bullets"] == 1.0
    assert metrics["reward_components.include_keywords"] == 1.0
    assert metrics["instructions_passed"] == 2.0
    await registry.close()


class TestInstructionFollowingConformance(ResourcesConformance):
    task_row = _row()
    answer = "hi there friend"

    def server(self) -> InstructionFollowingEnv:
        return InstructionFollowingEnv()
