"""NeMo Gym-style JSON rows load into the gym.v1 messages and dump back."""

import copy
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response as OpenAIResponse

from gym_grpc.data import record, rows
from gym_grpc.responses import new_response
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}

# A row in canonical form (every item has its "type"), using every part of the schema.
CANONICAL_ROW = {
    "responses_create_params": {
        "input": [
            {"type": "message", "role": "developer", "content": "Be brief."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [{"type": "summary_text", "text": "I should call the tool."}],
                "status": "completed",
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
                "status": "completed",
                "prompt_token_ids": [1, 2, 3],
                "generation_token_ids": [4, 5],
                "generation_log_probs": [-0.5, -0.25],
            },
            {
                "type": "function_call_output",
                "id": "fco_1",
                "call_id": "call_1",
                "output": "18 C",
                "status": "completed",
            },
            {
                "type": "message",
                "id": "msg_1",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "It is 18 C.", "annotations": []}],
                "status": "completed",
                "prompt_token_ids": [1, 2, 3, 4, 5, 6],
                "generation_token_ids": [7],
                "generation_log_probs": [-0.125],
            },
        ],
        "instructions": "You are a weather bot.",
        "tools": [TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "temperature": 0.7,
        "top_p": 0.95,
        "max_output_tokens": 512,
        "parallel_tool_calls": False,
        "metadata": {"split": "train"},
        "reasoning": {"effort": "high", "summary": "auto"},
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object"}, "strict": True}},
        "model": "policy",
        "top_logprobs": 5,
    },
    "expected_answer": "18",
    "options": [{"A": "18"}, {"B": "20"}],
    "verifier_metadata": {"tolerance": 0.5, "units": "C"},
    "agent_ref": {"type": "responses_api_agents", "name": "weather_agent"},
}


def test_nemo_gym_row_round_trips_through_the_messages():
    task = rows.task_from_row(CANONICAL_ROW)
    wire = task_pb2.Task.FromString(task.SerializeToString())  # through the wire format too
    assert rows.task_to_row(wire) == CANONICAL_ROW
    assert json.dumps(rows.task_to_row(wire), sort_keys=True) == json.dumps(CANONICAL_ROW, sort_keys=True)


def test_training_fields_survive_a_later_turn():
    task = rows.task_from_row(CANONICAL_ROW)
    # A later turn sends the conversation back as input, through the wire.
    later = r.CreateParams()
    later.input_items.items.extend(task.responses_create_params.input_items.items)
    later = r.CreateParams.FromString(later.SerializeToString())
    call = later.input_items.items[3].function_call
    assert list(call.prompt_token_ids) == [1, 2, 3]
    assert list(call.generation_token_ids) == [4, 5]
    assert list(call.generation_log_probs) == [-0.5, -0.25]
    assert list(later.input_items.items[5].message.generation_token_ids) == [7]


def test_shorthand_row_loads_as_messages():
    row = {
        "responses_create_params": {
            "input": [{"role": "user", "content": "What is 2 + 2?"}],
            "temperature": None,
        },
        "expected_answer": 4,
    }
    task = rows.task_from_row(row)
    message = task.responses_create_params.input_items.items[0].message
    assert message.role == r.ROLE_USER and message.text == "What is 2 + 2?"
    assert not task.responses_create_params.HasField("temperature")
    assert rows.task_data(task) == {"expected_answer": 4}
    assert isinstance(rows.task_data(task)["expected_answer"], int)
    text_input = rows.task_from_row({"responses_create_params": {"input": "hi"}})
    assert text_input.responses_create_params.input_text == "hi"
    assert rows.task_to_row(text_input) == {"responses_create_params": {"input": "hi"}}


def test_unknown_fields_are_kept():
    row = {"responses_create_params": {"input": "hi", "seed": 7, "engine_knob": {"x": [1, 2]}}, "my_field": "kept"}
    task = rows.task_from_row(row)
    assert rows.task_to_row(task) == row


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda row: row.pop("responses_create_params"), "responses_create_params"),
        (lambda row: row["responses_create_params"].pop("input"), "responses_create_params.input"),
        (
            lambda row: row["responses_create_params"]["input"][1].update(content=7),
            "responses_create_params.input[1].content",
        ),
        (
            lambda row: row["responses_create_params"]["input"][3].update(arguments={"city": "Paris"}),
            "responses_create_params.input[3].arguments",
        ),
        (
            lambda row: row["responses_create_params"]["input"][3]["generation_token_ids"].append(-1),
            "responses_create_params.input[3].generation_token_ids[2]",
        ),
        (
            lambda row: row["responses_create_params"]["input"][3]["generation_log_probs"].pop(),
            "responses_create_params.input[3].generation_log_probs",
        ),
        (lambda row: row["responses_create_params"].update(temperature="hot"), "responses_create_params.temperature"),
        (lambda row: row["responses_create_params"]["input"][0].pop("role"), "responses_create_params.input[0].role"),
        (
            lambda row: row["responses_create_params"]["input"][3].update(call_id=None),
            "responses_create_params.input[3].call_id",
        ),
        (
            lambda row: row["responses_create_params"]["tools"][0].update(parameters=float("nan")),
            "responses_create_params.tools[0].parameters",
        ),
        (
            lambda row: row["responses_create_params"].update(max_output_tokens=-1),
            "responses_create_params.max_output_tokens",
        ),
        (
            lambda row: row["responses_create_params"].update(tools={"type": "function"}),
            "responses_create_params.tools",
        ),
    ],
)
def test_a_bad_row_is_an_error_naming_the_field(mutate, field):
    row = copy.deepcopy(CANONICAL_ROW)
    mutate(row)
    with pytest.raises(rows.RowError) as error:
        rows.task_from_row(row)
    assert error.value.field == field
    assert field in str(error.value)


def test_a_row_that_is_not_an_object_is_an_error():
    with pytest.raises(rows.RowError, match="expected an object"):
        rows.task_from_row(["not", "a", "row"])


def _response() -> r.Response:
    task = rows.task_from_row(CANONICAL_ROW)
    resp = new_response(task.responses_create_params, "policy")
    resp.id, resp.created_at, resp.status = "resp_1", 1700000000.5, r.RESPONSE_STATUS_INCOMPLETE
    resp.output.extend(task.responses_create_params.input_items.items[2:])
    resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens = 6, 3, 9
    resp.incomplete_details.reason = r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
    return resp


def test_dumped_response_is_valid_for_the_openai_sdk():
    dumped = rows.response_to_json(_response())
    parsed = OpenAIResponse.model_validate(dumped)
    assert parsed.status == "incomplete"
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.usage.total_tokens == 9
    assert [o.type for o in parsed.output] == ["reasoning", "function_call", "function_call_output", "message"]
    assert rows.response_from_json(dumped) == _response()


def test_rollout_row_is_the_task_row_plus_response_reward_and_verifier_fields():
    rollout = task_pb2.Rollout(response=_response(), reward=0.5)
    rollout.verifier_fields.update({"extracted_answer": "18", "close": True})
    rollout.reward_components["format"] = 1.0
    row = record.scored(CANONICAL_ROW, rollout)
    assert {k: row[k] for k in CANONICAL_ROW} == CANONICAL_ROW
    assert row["reward"] == 0.5 and row["extracted_answer"] == "18" and row["close"] is True
    assert row["verifier_fields"] == ["close", "extracted_answer"]
    assert row["reward_components"] == {"format": 1.0}
    assert row["response"]["id"] == "resp_1"


# --- property: every message survives dump -> load -----------------------------

_text = st.text(max_size=20)
_ids = st.lists(st.integers(0, 2**32 - 1), max_size=5)
_float32 = st.floats(-50, 0, width=32)


@st.composite
def _token_fields(draw, item):
    gen = draw(_ids)
    item.prompt_token_ids.extend(draw(_ids))
    item.generation_token_ids.extend(gen)
    if draw(st.booleans()):
        item.generation_log_probs.extend(draw(st.lists(_float32, min_size=len(gen), max_size=len(gen))))
    return item


@st.composite
def _items(draw):
    kind = draw(st.sampled_from(["text", "parts", "reasoning", "call", "output"]))
    item = r.Item()
    if kind in ("text", "parts"):
        m = item.message
        m.role = draw(st.sampled_from(list(rows.ROLES.values())))
        if kind == "text":
            m.text = draw(_text)
        else:
            m.parts.SetInParent()
            for t in draw(st.lists(_text, max_size=3)):
                m.parts.items.add().output_text.text = t
        if draw(st.booleans()):
            m.id = "msg_" + draw(st.text("abc123", min_size=1, max_size=5))
        draw(_token_fields(m))
    elif kind == "reasoning":
        item.reasoning.summary.extend(r.SummaryText(text=t) for t in draw(st.lists(_text, max_size=2)))
        draw(_token_fields(item.reasoning))
    elif kind == "call":
        fc = item.function_call
        fc.call_id, fc.name, fc.arguments = draw(_text), draw(_text), draw(_text)
        fc.status = draw(st.sampled_from(list(rows.ITEM_STATUSES.values())))
        draw(_token_fields(fc))
    else:
        item.function_call_output.call_id, item.function_call_output.output = draw(_text), draw(_text)
    return item


@st.composite
def _params(draw):
    params = r.CreateParams()
    if draw(st.booleans()):
        params.input_text = draw(_text)
    else:
        params.input_items.SetInParent()
        params.input_items.items.extend(draw(st.lists(_items(), max_size=4)))
    if draw(st.booleans()):
        params.temperature = draw(st.floats(0, 2, allow_nan=False))
    if draw(st.booleans()):
        params.max_output_tokens = draw(st.integers(0, 2**32 - 1))
    if draw(st.booleans()):
        params.tool_choice.mode = draw(st.sampled_from(list(rows.TOOL_CHOICE_MODES.values())))
    params.metadata.update(draw(st.dictionaries(_text, _text, max_size=2)))
    return params


@settings(max_examples=200, deadline=None)
@given(_params())
def test_any_create_params_survive_dump_and_load(params):
    dumped = json.loads(json.dumps(rows.params_to_json(params)))
    assert rows.params_from_json(dumped) == params
    for value in params.input_items.items:
        for item in (value.message, value.reasoning, value.function_call):
            assert all(math.isfinite(x) for x in item.generation_log_probs)
