"""The multiple-choice environment: how letters are read, and what its verifier rewards."""

import math
from pathlib import Path

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.resources.mcqa.server import MCQAEnv, boxed, extract, letter_of, read_question
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message
from gym_grpc.testing import ResourcesConformance, example_rows, static_registry
from gym_grpc.v1 import responses_pb2 as r

DATA = Path(__file__).resolve().parent.parent / "data" / "example.jsonl"

OPTIONS = [{"A": "Paris"}, {"B": "Lyon"}, {"C": "Nice"}, {"D": "Paris, Texas"}]
PROMPT = (
    "Which city is the capital of France?\nA) Paris\nB) Lyon\nC) Nice\nD) Paris, Texas\nPut the letter in \\boxed{}."
)


def _row(**fields):
    return {"responses_create_params": {"input": PROMPT}, "options": OPTIONS, "expected_answer": "A", **fields}


def _read(text, mode="strict", **fields):
    return extract(text, read_question(_row(**fields), mode))


@pytest.mark.parametrize(
    "text, letter",
    [
        ("The answer is \\boxed{A}.", "A"),
        ("\\boxed{b}", "B"),
        ("\\boxed{(C)}", "C"),
        ("\\boxed{\\text{D}}", "D"),
        ("\\boxed{\\textbf{A}}", "A"),
        ("\\boxed{B) Lyon}", "B"),
        ("First \\boxed{A}, but on reflection \\boxed{C}.", "C"),  # the last box wins
        ("\\boxed{C} ... no: \\boxed{42}", ""),  # even when it names no option
        ("\\boxed{E}", ""),  # not one of the options
        ("\\boxed{Because}", ""),  # a letter inside a word is no answer
        ("\\boxed{Paris}", ""),  # the option's text counts only when lenient
        ("Answer: B", ""),  # strict: only a box counts
        ("The answer is (B).", ""),
        ("B", ""),
        ("", ""),
    ],
)
def test_strict_grading_reads_only_boxed_letters(text, letter):
    assert _read(text, "strict") == letter


@pytest.mark.parametrize(
    "text, letter",
    [
        ("\\boxed{B}", "B"),
        ("\\boxed{Paris}", "A"),  # the option's text, in a box
        ("\\boxed{\\text{paris, texas}}", "D"),
        ("Answer: B", "B"),
        ("**Answer:** C", "C"),
        ("The answer is (B).", "B"),
        ("I think the correct option is D because of the name.", "D"),
        ("The answer is option C.", "C"),
        ("Answer: A\nWait, no. Answer: C", "C"),  # the last statement wins
        ("The answer is a bit unclear.", ""),  # a lowercase article is no letter
        ("Answer: Because the other one is smaller, it is not the capital.", ""),  # a letter inside a word
        ("After weighing them all, (B).", "B"),  # alone at the end
        ("C", "C"),
        ("B) Lyon, because the prefecture moved.", "B"),  # alone at the start
        ("Neither (A) nor (B) fits.", ""),  # two letters in parentheses: no answer
        ("I would go with (C) here since it is on the coast.", "C"),
        ("It is Paris, of course.", "A"),  # the one option mentioned
        ("Paris, Texas is a city in the United States.", "D"),  # inside a longer option it does not count
        ("Paris or Lyon, hard to say.", ""),
        ("I am not sure how to answer that.", ""),
        ("\\boxed{E} Answer: B", ""),  # a box is the answer even when it names nothing
    ],
)
def test_lenient_grading_reads_statements_lone_letters_and_option_texts(text, letter):
    assert _read(text, "lenient") == letter


@pytest.mark.parametrize(
    "regex, text, letter",
    [
        (r"Final choice: (\w)", "Final choice: B", "B"),
        (r"Final choice: (\w)", "Final choice: A ... Final choice: C", "C"),
        (r"Final choice: (\w)", "\\boxed{B}", ""),  # the row's regex replaces the boxed rule
        (r"(?i)final choice:\s*\(?(\w)\)?", "FINAL CHOICE: (d)", "D"),
        (r"Final choice: (\w+)", "Final choice: Because", ""),
    ],
)
def test_a_rows_output_regex_takes_precedence(regex, text, letter):
    assert _read(text, "lenient", template_metadata={"output_regex": regex}) == letter


def test_a_rows_grading_mode_overrides_the_configs():
    question = read_question(_row(grading_mode="lenient"), "strict")
    assert question.grading_mode == "lenient"
    assert read_question(_row(), "lenient").grading_mode == "lenient"


def test_boxed_contents_keep_nested_braces():
    assert boxed("\\boxed{\\text{B}} and \\fbox{C} and \\boxed{unclosed") == ["\\text{B}", "C"]


def test_letter_of_names_only_the_options():
    options = {"A": "Paris", "B": "Lyon"}
    assert letter_of("(b)", options) == "B"
    assert letter_of("C", options) == ""
    assert letter_of("lyon", options) == ""
    assert letter_of("lyon", options, by_text=True) == "B"


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"options": []}, "options: expected a non-empty list"),
        ({"options": {"A": "Paris"}}, "options: expected a non-empty list"),
        ({"options": [{"A": "Paris", "B": "Lyon"}]}, "options[0]"),
        ({"options": [{"A": "Paris"}, {"b": "Lyon"}]}, "options[1]"),
        ({"options": [{"A": "Paris"}, {"A": "Lyon"}]}, "letter A is used twice"),
        ({"expected_answer": "E"}, "expected_answer: 'E' is not one of the options' letters A, B, C, D"),
        ({"grading_mode": "fuzzy"}, "grading_mode: 'fuzzy'"),
        ({"template_metadata": {"output_regex": "Answer: ("}}, "output_regex: not a valid regex"),
        ({"template_metadata": {"output_regex": "Answer: [A-D]"}}, "a group that holds the letter"),
    ],
)
def test_a_malformed_row_is_an_error_naming_its_field(fields, message):
    with pytest.raises(errors.TaskDataError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read_question(_row(**fields), "strict")


@pytest.fixture
async def mcqa(start):
    server = await start(MCQAEnv())
    client = ResourcesClient(static_registry(mcqa=server), "mcqa")
    yield client
    await client.registry.close()


async def _verify(client, row, answer):
    verdict = await client.verify("s", rows.task_from_row(row), r.Response(output=[assistant_message(answer)]))
    return verdict.reward, rows.json_field(verdict, "fields")


@pytest.mark.parametrize(
    "row, answer, reward, fields",
    [
        (_row(), "The answer is \\boxed{A}.", 1.0, {"extracted_answer": "A", "grading_mode_used": "strict"}),
        (_row(), "The answer is \\boxed{B}.", 0.0, {"extracted_answer": "B", "grading_mode_used": "strict"}),
        (_row(), "Answer: A", 0.0, {"extracted_answer": "", "grading_mode_used": "strict"}),
        (_row(grading_mode="lenient"), "Answer: A", 1.0, {"extracted_answer": "A", "grading_mode_used": "lenient"}),
        (
            _row(template_metadata={"output_regex": r"Choice: ([A-D])"}),
            "Choice: A",
            1.0,
            {"extracted_answer": "A", "grading_mode_used": "output_regex"},
        ),
    ],
)
async def test_the_right_letter_earns_the_reward_over_grpc(mcqa, row, answer, reward, fields):
    assert await _verify(mcqa, row, answer) == (reward, fields)


async def test_the_configs_grading_mode_is_the_default(start):
    server = await start(MCQAEnv({"grading_mode": "lenient"}))
    client = ResourcesClient(static_registry(mcqa=server), "mcqa")
    assert await _verify(client, _row(), "Answer: A") == (
        1.0,
        {"extracted_answer": "A", "grading_mode_used": "lenient"},
    )
    await client.registry.close()


async def test_a_malformed_row_fails_verification_naming_the_field(mcqa):
    with pytest.raises(errors.GymError) as error:
        await _verify(mcqa, _row(expected_answer="Z"), "\\boxed{A}")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.field == "task.data.expected_answer"
    assert "expected_answer" in error.value.message


async def test_every_example_row_loads_and_verifies(mcqa):
    examples = example_rows(DATA, MCQAEnv)
    assert len(examples) == 5
    for row in examples:
        reward, fields = await _verify(mcqa, row, f"The answer is \\boxed{{{row['expected_answer']}}}.")
        assert math.isfinite(reward) and reward == 1.0, fields
        prompt = row["responses_create_params"]["input"][-1]["content"]
        for option in row["options"]:
            [(letter, text)] = option.items()
            assert f"{letter}) {text}" in prompt  # the prompt shows every option


class TestMCQAConformance(ResourcesConformance):
    task_row = _row()
    answer = "\\boxed{A}"

    def server(self) -> MCQAEnv:
        return MCQAEnv()
