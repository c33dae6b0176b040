"""The embedded policy is a real participant: it computes, calls tools, slips, and
reports honest token ids and log-probs."""

import json
import math
from pathlib import Path

import pytest

from gym_grpc.bundled.servers.models.local_policy import policy, tokenizer
from gym_grpc.bundled.servers.models.local_policy.server import LocalPolicyModel
from gym_grpc.client.stubs import ModelClient
from gym_grpc.data import rows
from gym_grpc.responses import final_text, function_calls, item_body
from gym_grpc.testing import call, static_registry
from gym_grpc.v1 import responses_pb2 as r

HERE = Path(__file__).resolve().parent
MATH_DATA = HERE.parents[2] / "resources" / "math" / "data" / "example.jsonl"
WEATHER_DATA = HERE.parents[2] / "resources" / "weather" / "data" / "example.jsonl"


def _params(path: Path, line: int = 0, **overrides) -> r.CreateParams:
    row = json.loads(path.read_text().splitlines()[line])
    row["responses_create_params"].update(overrides)
    return rows.task_from_row(row).responses_create_params


def _last_carrier(response: r.Response):
    last = response.output[-1]
    return item_body(last)


async def test_greedy_policy_solves_the_arithmetic_it_reads(start):
    server = await start(LocalPolicyModel())
    model = ModelClient(static_registry(m=server), "m")
    cases = [
        ("What is 17 + 25?", "42"),
        ("Compute 12 * (7 - 3) + 5.", "53"),
        ("3/4 + 1/8 = ?", "\\frac{7}{8}"),
        ("What is 144 divided by 12?", "12"),
        ("Evaluate 2 - 9.", "-7"),
    ]
    for prompt, answer in cases:
        params = r.CreateParams(input_text=prompt, temperature=0.0)
        assert f"\\boxed{{{answer}}}" in final_text(await model.create_response(params, "s"))
    await model.registry.close()


async def test_policy_calls_the_declared_tool_with_arguments_from_the_prompt(start):
    server = await start(LocalPolicyModel())
    model = ModelClient(static_registry(m=server), "m")
    response = await model.create_response(_params(WEATHER_DATA, 2, temperature=0.0), "s")
    [call] = function_calls(response)
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "New York"}
    await model.registry.close()


async def test_a_tool_output_too_deep_to_parse_is_reported_as_text(start):
    server = await start(LocalPolicyModel())
    model = ModelClient(static_registry(m=server), "m")
    fc = call("get_weather", '{"city": "Paris"}')
    deep = "[" * 100_000 + "]" * 100_000  # Python's JSON parser overflows on it
    output = r.Item(function_call_output=r.FunctionCallOutput(call_id=fc.function_call.call_id, output=deep))
    user = r.Item(message=r.Message(role=r.ROLE_USER, text="Weather in Paris?"))
    response = await model.create_response(r.CreateParams(input_items=r.ItemList(items=[user, fc, output])), "s")
    assert final_text(response) == f"According to get_weather: {deep}."
    await model.registry.close()


async def test_policy_sometimes_slips_when_sampling(start):
    server = await start(LocalPolicyModel({"error_rate": 0.2}))
    model = ModelClient(static_registry(m=server), "m")
    params = r.CreateParams(input_text="What is 12 * (7 - 3) + 5?")  # two operations: ~36% slips at T=1
    answers = [final_text(await model.create_response(params, f"session-{i}")) for i in range(100)]
    wrong = sum("\\boxed{53}" not in a for a in answers)
    assert 10 < wrong < 70
    params.temperature = 0.0
    greedy = [final_text(await model.create_response(params, f"s{i}")) for i in range(20)]
    assert all("\\boxed{53}" in a for a in greedy)
    await model.registry.close()


async def test_token_ids_stay_on_policy_across_turns(start):
    server = await start(LocalPolicyModel())
    model = ModelClient(static_registry(m=server), "m")
    params = _params(WEATHER_DATA, 0, temperature=0.0)
    first = await model.create_response(params, "s")
    turn1 = _last_carrier(first)
    params.input_items.items.extend(first.output)
    params.input_items.items.add().function_call_output.CopyFrom(
        r.FunctionCallOutput(call_id=first.output[-1].function_call.call_id, output='{"temperature_c": 12}')
    )
    second = await model.create_response(params, "s")
    turn2 = _last_carrier(second)
    assert tokenizer.decode(turn1.generation_token_ids).startswith("<tool_call>")
    prefix = list(turn1.prompt_token_ids) + list(turn1.generation_token_ids)
    assert list(turn2.prompt_token_ids)[: len(prefix)] == prefix
    for turn in (turn1, turn2):
        assert len(turn.generation_log_probs) == len(turn.generation_token_ids)
        assert all(lp <= 0.0 for lp in turn.generation_log_probs)
        assert all(0 <= t < tokenizer.VOCAB_SIZE for t in turn.generation_token_ids)
    assert second.usage.input_tokens == len(turn2.prompt_token_ids)
    assert "temperature_c: 12" in final_text(second)


async def test_log_probs_follow_the_sampling_distribution(start):
    server = await start(LocalPolicyModel({"error_rate": 0.2}))
    model = ModelClient(static_registry(m=server), "m")
    params = r.CreateParams(input_text="What is 17 + 25?", temperature=1.0)
    for i in range(30):
        response = await model.create_response(params, f"s{i}")
        decision = [lp for lp in _last_carrier(response).generation_log_probs if lp != 0.0]
        slipped = "\\boxed{42}" not in final_text(response)
        assert len(decision) == 1
        assert math.isclose(decision[0], math.log(0.2 if slipped else 0.8), rel_tol=1e-6)
    await model.registry.close()


async def test_max_output_tokens_cuts_the_generation_and_marks_it_incomplete(start):
    server = await start(LocalPolicyModel())
    model = ModelClient(static_registry(m=server), "m")
    params = r.CreateParams(input_text="What is 17 + 25?", max_output_tokens=5, temperature=0.0)
    response = await model.create_response(params, "s")
    assert response.status == r.RESPONSE_STATUS_INCOMPLETE
    assert response.incomplete_details.reason == r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
    assert len(_last_carrier(response).generation_token_ids) == 5 == response.usage.output_tokens
    assert final_text(response) == "17 + "
    await model.registry.close()


def test_arithmetic_reader_handles_words_and_ignores_plain_numbers():
    assert policy.find_arithmetic("what is 6 times 7?")[1] == 42
    assert policy.find_arithmetic("In 2024 there were 12 apples.") is None
    assert policy.find_arithmetic("divide: 1 / 0") is None
    assert policy.latex(policy.find_arithmetic("1/2 - 1")[1]) == "-\\frac{1}{2}"


MCQA_DATA = HERE.parents[2] / "resources" / "mcqa" / "data" / "example.jsonl"


@pytest.mark.parametrize(
    "prompt, options",
    [
        (
            "Pick one.\nA) Paris\nB) Lyon\nC) Nice\nPut the letter in \\boxed{}.",
            [("A", "Paris"), ("B", "Lyon"), ("C", "Nice")],
        ),
        ("Pick one: (A) red (B) green (C) blue", [("A", "red"), ("B", "green"), ("C", "blue")]),
        ("A. 1985\nB. 1989", [("A", "1985"), ("B", "1989")]),
        ("Plan A. Then B) is up\nA) yes\nB) no\nC) maybe", [("A", "yes"), ("B", "no"), ("C", "maybe")]),
        ("I got an A. Nothing else.", []),  # one marker is no list of options
        ("Compare A) and C) only.", []),  # not a run from A
        ("What is 12 * (7 - 3) + 5?", []),
        ("What's the weather like in Paris right now?", []),
    ],
)
def test_options_are_read_as_a_lettered_run_from_a(prompt, options):
    assert policy.find_options(prompt) == options


async def test_greedy_policy_boxes_the_longest_option(start):
    server = await start(LocalPolicyModel())
    model = ModelClient(static_registry(m=server), "m")
    for line, letter in [(0, "C"), (3, "C"), (4, "A"), (2, "A")]:  # longest, or the first of equally long
        response = await model.create_response(_params(MCQA_DATA, line, temperature=0.0), "s")
        assert final_text(response) == f"The answer is \\boxed{{{letter}}}."
    await model.registry.close()


async def test_policy_sometimes_guesses_another_option_with_an_honest_log_prob(start):
    server = await start(LocalPolicyModel({"error_rate": 0.2}))
    model = ModelClient(static_registry(m=server), "m")
    # Four options, C the longest; with reasoning, which must not take the log-prob's place.
    params = _params(MCQA_DATA, 0, temperature=1.0, reasoning={"effort": "low"})
    letters = []
    for i in range(100):
        response = await model.create_response(params, f"s{i}")
        letter = final_text(response).removeprefix("The answer is \\boxed{").removesuffix("}.")
        carrier = _last_carrier(response)
        [(at, logprob)] = [(i, lp) for i, lp in enumerate(carrier.generation_log_probs) if lp != 0.0]
        assert tokenizer.decode(carrier.generation_token_ids[at : at + 1]) == letter
        assert math.isclose(logprob, math.log(0.8 if letter == "C" else 0.2 / 3), rel_tol=1e-6)
        letters.append(letter)
    assert 5 < sum(letter != "C" for letter in letters) < 40
    assert set(letters) <= {"A", "B", "C", "D"}
    await model.registry.close()


async def test_a_prompt_with_nothing_to_work_out_still_gets_no_answer(start):
    server = await start(LocalPolicyModel())
    model = ModelClient(static_registry(m=server), "m")
    params = r.CreateParams(input_text="Write a poem about plan A.", temperature=0.0)
    assert final_text(await model.create_response(params, "s")) == "I am not sure how to answer that."
    await model.registry.close()
