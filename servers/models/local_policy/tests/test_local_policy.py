"""The embedded policy is a real participant: it computes, calls tools, slips, and
reports honest token ids and log-probs."""

import ast
import gc
import json
import math
import operator
import random
import sys
import threading
from fractions import Fraction
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


def _read_by_python(text: str) -> object:
    """What Python's own parser makes of `text` as the policy's arithmetic: (value, operations), or
    the kind of refusal. The reference the policy's reader is held to (run in one thread only)."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def value(node: ast.AST) -> tuple[Fraction, int]:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value)), 0
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            inner, count = value(node.operand)
            return (-inner if isinstance(node.op, ast.USub) else inner), count
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            (left, lcount), (right, rcount) = value(node.left), value(node.right)
            return ops[type(node.op)](left, right), lcount + rcount + 1
        raise ValueError(node)

    try:
        return value(ast.parse(text, mode="eval").body)
    except (SyntaxError, ValueError):
        return "not arithmetic"
    except ZeroDivisionError:
        return "division by zero"


def _read_by_policy(text: str) -> object:
    try:
        return policy._evaluate(text)
    except ValueError:
        return "not arithmetic"
    except ZeroDivisionError:
        return "division by zero"


def test_arithmetic_is_read_as_pythons_parser_reads_it():
    """30,000 strings of digits, points, operators, parentheses and whitespace (line breaks among
    them), stripped as find_arithmetic strips its candidates, each read by the policy and by Python's
    parser: the same value and count of operations, or the same refusal (leading zeros, `**`, `//`,
    calls such as `2(3)`, `()`, a line break outside parentheses, unbalanced parentheses)."""
    rng = random.Random(7)
    alphabet = "0123456789" * 3 + "00.. ++--**//(()) " + "\n\t\r\x0c\x0b"
    cases = ["007", "00", "007.5", "3.", ".5", "1..2", "2(3)", "(2)(3)", "()", "--3", "3\n+4", "(3\n+4)", "1/0"]
    cases += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14))) for _ in range(30_000)]
    cases = [case.strip() for case in cases]  # as find_arithmetic reads its candidates
    read = [(case, _read_by_python(case), _read_by_policy(case)) for case in cases]
    mismatches = [(case, by_python, by_policy) for case, by_python, by_policy in read if by_python != by_policy]
    assert not mismatches, mismatches[:10]
    assert sum(isinstance(by_policy, tuple) for _, _, by_policy in read) > 3_000  # not only refusals


def test_arithmetic_is_read_while_another_thread_builds_python_syntax_trees():
    """On Python 3.11 the AST constructor counts its recursion in one place for every thread, so two
    threads building syntax trees at once can make either raise SystemError ("AST constructor
    recursion depth mismatch"): the policy's reading did, beside a traceback formatted in another
    thread (3.11 marks its carets with `ast.parse`), and a turn failed INTERNAL in a test run. Here
    another thread parses while the garbage collector, run often, calls finalizers that let threads
    switch mid-parse: every reading comes out right, and the other thread's parsing never fails
    (with the policy on `ast.parse`, it failed in each of ten runs)."""

    class Finalized:
        def __del__(self):
            sum(range(20))

    failures: list[BaseException] = []
    parses = 0

    def parse_beside() -> None:
        nonlocal parses
        while not done.is_set():
            try:
                junk = [Finalized() for _ in range(3)]
                for item in junk:
                    item.cycle = item  # left to the cyclic collector, whose finalizers run Python code
                del junk
                ast.parse("total = [x * 2 for x in range(10) if x]\n" * 10)
            except Exception as e:
                failures.append(e)
            parses += 1

    done = threading.Event()
    switch, thresholds = sys.getswitchinterval(), gc.get_threshold()
    sys.setswitchinterval(1e-6)
    gc.set_threshold(50)
    beside = threading.Thread(target=parse_beside, daemon=True)
    beside.start()
    try:
        readings = 0
        while (readings < 2_000 or parses < 300) and beside.is_alive():  # both at it for a while
            assert policy.find_arithmetic("Compute 12 * (7 - 3) + 5 / (1 + 1) - 8.")[1:] == (Fraction(85, 2), 6)
            readings += 1
    finally:
        done.set()
        beside.join()
        sys.setswitchinterval(switch)
        gc.set_threshold(*thresholds)
    assert not failures, failures[:3]


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
