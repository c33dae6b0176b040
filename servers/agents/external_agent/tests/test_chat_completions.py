"""Chat Completions requests as Responses parameters, and our answers as the openai SDK's own types read them."""

from __future__ import annotations

import pytest
from openai.types.chat import ChatCompletion
from openai.types.responses import Response as SDKResponse

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.external_agent import chat_completions
from gym_grpc.bundled.servers.agents.external_agent.endpoint import _responses_answer
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message, new_response
from gym_grpc.testing import call
from gym_grpc.v1 import responses_pb2 as r

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_a_chat_conversation_becomes_the_responses_items_it_stands_for():
    body = {
        "model": "any",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Weather here?"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
                ],
            },
            # as the SDK's message.model_dump() sends it back: None for what it does not have
            {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "-3 C"}]},
        ],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_completion_tokens": 64,
        "temperature": 0.5,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}},
        "reasoning_effort": "low",
        "seed": 3,
        "logprobs": True,
        "n": 1,
        "stream": False,
    }
    params = rows.params_from_json(chat_completions.params_json(body))
    kinds = [i.WhichOneof("item") for i in params.input_items.items]
    assert kinds == ["message", "message", "function_call", "function_call_output"]
    system, user, fc, out = params.input_items.items
    assert system.message.role == r.ROLE_SYSTEM and system.message.text == "Be brief."
    parts = user.message.parts.items
    assert parts[0].input_text.text == "Weather here?" and parts[1].input_image.detail == "low"
    assert (fc.function_call.call_id, fc.function_call.name) == ("call_1", "get_weather")
    assert out.function_call_output.call_id == "call_1" and out.function_call_output.output == "-3 C"
    assert params.tools[0].function.name == "get_weather" and params.tool_choice.function_name == "get_weather"
    assert params.max_output_tokens == 64 and params.temperature == 0.5
    assert params.text.format.type == r.TEXT_FORMAT_TYPE_JSON_SCHEMA and params.reasoning.effort == "low"
    extra = rows.params_extra(params)
    assert extra == {"seed": 3}  # an engine option passes on; logprobs, n and stream describe the exchange


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web"}]}, "tools[0]"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 2}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "functions": []}, "functions"),
    ],
)
def test_a_request_this_endpoint_cannot_take_is_invalid_naming_the_field(body, field):
    with pytest.raises(errors.InvalidArgument) as refused:
        chat_completions.params_json(body)
    assert refused.value.field == field and refused.value.message.startswith(field)


def _response(*items: r.Item, incomplete: bool = False) -> r.Response:
    response = new_response(r.CreateParams(), "policy")
    response.status = r.RESPONSE_STATUS_INCOMPLETE if incomplete else r.RESPONSE_STATUS_COMPLETED
    if incomplete:
        response.incomplete_details.reason = r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
    response.output.extend(items)
    response.usage.input_tokens, response.usage.output_tokens, response.usage.total_tokens = 7, 3, 10
    return response


def test_a_response_with_calls_is_a_chat_completion_the_sdk_reads():
    fc = call("get_weather", '{"city": "Oslo"}')
    fc.function_call.generation_token_ids.extend([1, 2])
    reasoning = r.Item(reasoning=r.ReasoningItem(summary=[r.SummaryText(text="look it up")]))
    answer = ChatCompletion.model_validate(
        chat_completions.completion(_response(reasoning, assistant_message("Let me look."), fc), "m")
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    assert choice.message.tool_calls[0].id == fc.function_call.call_id
    assert choice.message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
    assert choice.message.model_extra == {"reasoning_content": "look it up"}
    assert answer.usage.prompt_tokens == 7 and answer.model == "policy"
    cut = ChatCompletion.model_validate(
        chat_completions.completion(_response(assistant_message("It is"), incomplete=True), "m")
    )
    assert cut.choices[0].finish_reason == "length"


def test_a_response_is_answered_without_its_token_ids_as_the_sdk_reads_a_response():
    item = assistant_message("It is 5.")
    item.message.generation_token_ids.extend([4, 5])
    item.message.prompt_token_ids.extend([1, 2, 3])
    item.message.generation_log_probs.extend([-0.1, -0.2])
    bare = r.Response(id="resp_1", status=r.RESPONSE_STATUS_COMPLETED, output=[item])  # a model server's minimum
    answer = _responses_answer(bare, "m")
    assert "generation_token_ids" not in str(answer) and "prompt_token_ids" not in str(answer)
    parsed = SDKResponse.model_validate(answer)
    assert parsed.output_text == "It is 5." and parsed.model == "m" and parsed.status == "completed"
    assert list(item.message.generation_token_ids) == [4, 5]  # the recording keeps them
