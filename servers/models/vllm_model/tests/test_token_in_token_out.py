"""The token path of the vLLM model server (token_in_token_out), against a fake vLLM whose
model, like a real one, samples token splits its tokenizer never makes and writes tool calls
that its template re-renders differently: every later prompt must be the earlier ids extended."""

import json

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.bundled.servers.models.vllm_model.tool_calls import Hermes
from gym_grpc.client.stubs import AgentClient, ModelClient
from gym_grpc.responses import final_text, function_calls, user_message
from gym_grpc.testing import Calculator, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.testing.fake_engine import IM_END, IM_START, FakeEngine, Turn, encode
from gym_grpc.v1 import responses_pb2 as r


@pytest.fixture
async def vllm(start):
    """vllm(fake, **config): a token-path VLLMModel on `fake`, and a client of it (closed after the test)."""
    clients: list[ModelClient] = []

    async def make(fake: FakeEngine, **config) -> tuple[VLLMModel, ModelClient]:
        server = VLLMModel({"base_url": fake.base_url, "model": "p", "return_token_ids": True, **config}, name="m")
        clients.append(ModelClient(static_registry(m=await start(server)), "m"))
        return server, clients[-1]

    yield make
    for client in clients:
        await client.registry.close()


def _carriers(response: r.Response) -> list:
    """The output items that carry a turn's ids, in order."""
    bodies = [getattr(item, item.WhichOneof("item")) for item in response.output]
    return [body for body in bodies if getattr(body, "generation_token_ids", None)]


def _params(text="What is 2 + 3?", **fields) -> r.CreateParams:
    params = r.CreateParams(**fields)
    params.input_items.items.append(user_message(text))
    return params


def _carrier(response: r.Response):
    return getattr(response.output[-1], response.output[-1].WhichOneof("item"))


def _rendered(role: str, content: str) -> list[int]:
    return [IM_START, *encode(f"{role}\n{content}"), IM_END, *encode("\n")]


async def test_every_later_prompt_is_the_sampled_ids_extended_by_only_the_new_messages(start, engine):
    script = [
        Turn(content="<think>Add with the tool.</think>", tool_calls=[("add", '{"a": 2,   "b": 3}')]),
        Turn(tool_calls=[("add", '{"a": 5, "b": 0}')]),
        Turn(content="The answer is 5, that is it."),
    ]
    fake = await engine(list(script), sampled_splits=True)
    model = await start(VLLMModel({"base_url": fake.base_url, "model": "p", "return_token_ids": True}, name="m"))
    calc = await start(Calculator())
    registry = static_registry(m=model, calc=calc)
    agent = await start(SimpleAgent({"model_server": "m", "resources_server": "calc"}, name="a", registry=registry))
    rollout = await AgentClient(static_registry(agent=agent), "agent").run(task("What is 2 + 3?", expected_answer=5))
    assert rollout.reward == 1.0
    carriers = _carriers(rollout.response)
    assert len(carriers) == 3
    calls = function_calls(rollout.response)
    for turn, (earlier, later) in enumerate(zip(carriers, carriers[1:], strict=False)):
        sampled = [*earlier.prompt_token_ids, *earlier.generation_token_ids]
        assert sampled[-1] == IM_END
        # ChatML's newline after the model's end-of-turn, the tool's answer, the generation prompt.
        after = [*encode("\n"), *_rendered("tool", "5"), IM_START, *encode("assistant\n")]
        assert list(later.prompt_token_ids) == [*sampled, *after]
        assert calls[turn].arguments == json.dumps(json.loads(script[turn].tool_calls[0][1]))
    # The engine only ever got ids; "th" stayed the one token the model sampled.
    completions = [request for request in fake.requests if "prompt" in request]
    assert len(completions) == 3 and not any("messages" in request for request in completions)
    assert 258 in carriers[-1].generation_token_ids


async def _two_turns(model: ModelClient) -> tuple[r.Response, r.Response]:
    params = _params()
    first = await model.create_response(params, "s")
    return first, await _next_turn(model, params, first, "And again?")


async def test_the_chat_path_refuses_the_conversation_the_token_path_keeps(vllm, engine):
    """The same model on both paths: its sampled "th" does not survive re-rendering."""
    fake = await engine([Turn(content="something")], sampled_splits=True)
    _, chat = await vllm(fake, token_in_token_out=False)
    with pytest.raises(errors.FailedPrecondition) as error:
        await _two_turns(chat)
    assert "part from the earlier turns' ids" in error.value.message
    server, tokens = await vllm(fake)
    first, second = await _two_turns(tokens)
    sampled = [*_carrier(first).prompt_token_ids, *_carrier(first).generation_token_ids]
    assert list(_carrier(second).prompt_token_ids)[: len(sampled)] == sampled
    assert server.counters.histories == {}


async def test_reasoning_and_tool_calls_are_read_from_the_generated_text(vllm, engine):
    fake = await engine(
        [Turn(content='<think>two calls</think>Let me check. <tool_call>\n{"name": broken}\n</tool_call>')]
    )
    fake.turns[0].tool_calls = [("add", '{"a": 1,"b": 2}'), ("add", '{"a": "x", "b": [1, 2]}')]
    _, model = await vllm(fake)
    params = _params()
    params.tools.add().function.CopyFrom(r.FunctionTool(name="add", parameters_json='{"type": "object"}'))
    response = await model.create_response(params, "s")
    assert response.output[0].reasoning.summary[0].text == "two calls"
    # A block that is not a call stays in the text, as the model wrote it.
    assert final_text(response) == 'Let me check. <tool_call>\n{"name": broken}\n</tool_call>'
    assert [(c.name, c.arguments) for c in function_calls(response)] == [
        ("add", '{"a": 1, "b": 2}'),
        ("add", '{"a": "x", "b": [1, 2]}'),
    ]
    assert len({c.call_id for c in function_calls(response)}) == 2
    carrier = _carrier(response)
    assert response.output[-1].WhichOneof("item") == "function_call"
    assert len(carrier.generation_token_ids) == len(carrier.generation_log_probs) == response.usage.output_tokens


def _tool_params(choice: r.ToolChoice | None = None, parallel: bool | None = None) -> r.CreateParams:
    params = _params()
    for name in ("add", "mul"):
        params.tools.add().function.CopyFrom(
            r.FunctionTool(name=name, parameters_json='{"type": "object", "properties": {"a": {"type": "integer"}}}')
        )
    if choice is not None:
        params.tool_choice.CopyFrom(choice)
    if parallel is not None:
        params.parallel_tool_calls = parallel
    return params


async def test_tool_choice_becomes_a_structural_tag_that_constrains_the_calls(vllm, engine):
    fake = await engine([Turn(content="ok")])
    _, model = await vllm(fake)
    await model.create_response(_tool_params(r.ToolChoice(mode=r.TOOL_CHOICE_MODE_REQUIRED), parallel=False), "s")
    await model.create_response(_tool_params(r.ToolChoice(function_name="mul")), "s")
    await model.create_response(_tool_params(), "s")
    await model.create_response(_tool_params(r.ToolChoice(mode=r.TOOL_CHOICE_MODE_NONE)), "s")
    required, named, auto, none = (request.get("response_format") for request in fake.requests)
    assert required["type"] == "structural_tag"
    assert required["format"]["type"] == "triggered_tags" and required["format"]["triggers"] == ["<tool_call>"]
    assert required["format"]["at_least_one"] is True and required["format"]["stop_after_first"] is True
    tags = required["format"]["tags"]
    assert [t["begin"] for t in tags] == [f'<tool_call>\n{{"name": "{n}", "arguments": ' for n in ("add", "mul")]
    assert tags[0]["content"] == {
        "type": "json_schema",
        "json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
    }
    assert named["format"]["type"] == "tag" and '"mul"' in named["format"]["begin"]
    assert auto["format"]["at_least_one"] is False and auto["format"]["stop_after_first"] is False
    assert none is None
    with pytest.raises(errors.InvalidArgument) as error:
        await model.create_response(_tool_params(r.ToolChoice(function_name="div")), "s")
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'div'" in error.value.message


async def test_tool_calls_are_not_parsed_under_tool_choice_none_or_without_tools(vllm, engine):
    fake = await engine([Turn(tool_calls=[("add", "{}")])])
    _, model = await vllm(fake, tool_call_grammar=False)
    for params in (_tool_params(r.ToolChoice(mode=r.TOOL_CHOICE_MODE_NONE)), _params()):
        response = await model.create_response(params, "s")
        assert not function_calls(response) and final_text(response).startswith("<tool_call>")
    assert all("response_format" not in request for request in fake.requests)


async def _next_turn(model: ModelClient, params: r.CreateParams, answer: r.Response, text: str) -> r.Response:
    params.input_items.items.extend(answer.output)
    params.input_items.items.append(user_message(text))
    return await model.create_response(params, "s")


async def test_a_template_that_drops_earlier_reasoning_starts_a_new_sample(vllm, engine):
    fake = await engine([Turn(content="<think>hm</think>5"), Turn(content="7"), Turn(content="9")])
    fake.strip_history_reasoning = True
    server, model = await vllm(fake)
    params = _params()
    first = await model.create_response(params, "s")
    second = await _next_turn(model, params, first, "And 3 + 4?")
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<think>hm</think>5"},
        {"role": "user", "content": "And 3 + 4?"},
    ]
    # A new sample: the whole conversation as the template renders it, reasoning dropped.
    assert list(_carrier(second).prompt_token_ids) == fake.render(messages, True)
    assert server.counters.histories == {"template": 1}
    # The next turn extends the new sample: its history is accepted as it is.
    third = await _next_turn(model, params, second, "And 4 + 5?")
    sampled = [*_carrier(second).prompt_token_ids, *_carrier(second).generation_token_ids]
    assert list(_carrier(third).prompt_token_ids)[: len(sampled)] == sampled
    assert server.counters.histories == {"template": 1}


async def test_refuse_fails_the_turn_naming_it_before_the_engine_generates(vllm, engine):
    fake = await engine([Turn(content="<think>hm</think>5"), Turn(content="7")], strip_history_reasoning=True)
    server, model = await vllm(fake, non_monotonic="refuse")
    params = _params()
    first = await model.create_response(params, "s")
    with pytest.raises(errors.FailedPrecondition) as error:
        await _next_turn(model, params, first, "And 3 + 4?")
    assert "assistant turn 1" in error.value.message and "new_sample" in error.value.message
    assert len([request for request in fake.requests if "prompt" in request]) == 1  # turn 2 never generated
    assert server.counters.histories == {"template": 1}


async def test_an_edited_or_dropped_earlier_message_is_detected(vllm, engine):
    fake = await engine([Turn(content="5"), Turn(content="7"), Turn(content="9")])
    server, model = await vllm(fake)
    params = _params()
    first = await model.create_response(params, "s")
    second = await _next_turn(model, params, first, "And 3 + 4?")
    edited = r.CreateParams()
    edited.CopyFrom(params)
    edited.input_items.items[0].message.text = "What is 2 + 30?"
    third = await _next_turn(model, edited, second, "And 4 + 5?")
    whole = fake.render(
        [
            {"role": "user", "content": "What is 2 + 30?"},
            {"role": "assistant", "content": "5"},
            {"role": "user", "content": "And 3 + 4?"},
            {"role": "assistant", "content": "7"},
            {"role": "user", "content": "And 4 + 5?"},
        ],
        True,
    )
    assert list(_carrier(third).prompt_token_ids) == whole
    assert server.counters.histories == {"edited": 1}
    # Dropping the first exchange: the second turn's ids still hold it.
    dropped = _params()
    del dropped.input_items.items[:]
    dropped.input_items.items.extend([params.input_items.items[0], *second.output, user_message("And 4 + 5?")])
    fake.turns.append(Turn(content="9"))
    await model.create_response(dropped, "s")
    assert server.counters.histories == {"edited": 2}


async def test_an_earlier_item_sent_back_otherwise_costs_a_whole_check_and_gives_the_same_prompt(vllm, engine):
    """The session's last prompt is reused only for the items as they came back (their bytes): an
    earlier item whose id the caller rewrote says the same to the template, so the whole history is
    checked (renders of every earlier turn) and the prompt is the one the kept history gives."""
    script = [Turn(content="5"), Turn(content="7"), Turn(content="9")]
    prompts, tokenizes = [], []
    for rewrite in (False, True):
        fake = await engine(list(script))
        server, model = await vllm(fake)
        params = _params()
        first = await model.create_response(params, "s")
        second = await _next_turn(model, params, first, "And 3 + 4?")
        if rewrite:
            params.input_items.items[1].message.id = "msg_rewritten"
        before = fake.calls["/tokenize"]
        third = await _next_turn(model, params, second, "And 4 + 5?")
        prompts.append(list(_carrier(third).prompt_token_ids))
        tokenizes.append(fake.calls["/tokenize"] - before)
        assert server.counters.histories == {}
    assert prompts[0] == prompts[1]
    # Kept: the conversation through the new turn and all of it. Rewritten: the conversation
    # before and through each of the two turns, and all of it.
    assert tokenizes == [2, 5]


async def test_a_turn_cut_at_max_output_tokens_is_closed_as_the_template_closes_a_turn(vllm, engine):
    fake = await engine([Turn(content="a long answer"), Turn(content="ok")])
    server, model = await vllm(fake, non_monotonic="refuse")
    params = _params(max_output_tokens=4)
    first = await model.create_response(params, "s")
    assert first.status == r.RESPONSE_STATUS_INCOMPLETE and _carrier(first).generation_token_ids[-1] != IM_END
    second = await _next_turn(model, params, first, "Go on.")
    sampled = [*_carrier(first).prompt_token_ids, *_carrier(first).generation_token_ids]
    closed = [IM_END, *encode("\n"), *_rendered("user", "Go on."), IM_START, *encode("assistant\n")]
    assert list(_carrier(second).prompt_token_ids) == [*sampled, *closed]
    assert server.counters.histories == {}


async def test_a_context_overflow_on_the_token_path_ends_the_rollout(vllm, engine):
    fake = await engine([Turn(content="never")], max_model_len=10)
    _, model = await vllm(fake)
    response = await model.create_response(_params(), "s")
    assert response.status == r.RESPONSE_STATUS_INCOMPLETE
    assert response.incomplete_details.reason == r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS


def test_the_hermes_parser_keeps_text_around_calls_and_what_does_not_parse():
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>{"x": 1}</tool_call>'
    content, calls = Hermes().parse(text)
    assert content == 'Sure.\n\n<tool_call>{"x": 1}</tool_call>'
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]
    assert Hermes().parse('<tool_call>\n{"name": "f", "arguments": "{\\"y\\": 2}"}\n</tool_call>')[1][0].arguments == (
        '{"y": 2}'
    )


def test_the_hermes_parser_reads_a_call_whose_string_holds_the_closing_tag():
    """What SmolLM2-135M sampled on the real CPU vLLM at temperature 1.0 under the tool-call
    grammar (a CI run): the city's string holds "}}</tool_call>", and the grammar closed the
    call after it. A first "</tool_call>" is not the end of the call."""
    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Seychelles}}</tool_call>'
        '2.946598fbuilding2.single<1_Multi_Feature, "}}\n</tool_call>'
    )
    content, calls = Hermes().parse(text)
    assert content == ""
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Seychelles}}</tool_call>2.946598fbuilding2.single<1_Multi_Feature, "})
    ]


async def test_without_max_output_tokens_the_engine_may_generate_to_the_end_of_its_context(vllm, engine):
    """vLLM's /v1/completions stops at 16 tokens unless told otherwise; Chat Completions (and a
    Responses request without max_output_tokens) goes on to the end of the context."""
    fake = await engine([Turn(content="ok")], max_model_len=5000)
    _, model = await vllm(fake)
    response = await model.create_response(_params(), "s")
    (request,) = [request for request in fake.requests if "prompt" in request]
    assert request["max_tokens"] == 5000 - len(_carrier(response).prompt_token_ids)
    await model.create_response(_params(max_output_tokens=7), "s")
    assert fake.requests[-1]["max_tokens"] == 7
    # More than the context holds is cut to fit, not refused.
    await model.create_response(_params(max_output_tokens=9000), "s")
    assert fake.requests[-1]["max_tokens"] == 5000 - len(_carrier(response).prompt_token_ids)


async def test_a_prompt_that_fills_the_context_ends_the_rollout_without_asking_the_engine(vllm, engine):
    fake = await engine([Turn(content="never")], max_model_len=20)
    _, model = await vllm(fake)
    response = await model.create_response(_params("a question far longer than twenty byte tokens"), "s")
    assert response.status == r.RESPONSE_STATUS_INCOMPLETE
    assert not [request for request in fake.requests if "prompt" in request]


async def test_a_call_with_an_escaped_half_character_keeps_the_escape(vllm, engine):
    """Seen on the real engine: the model wrote a JSON escape of a lone surrogate in its arguments;
    decoded, no protobuf string can carry it (the call failed INTERNAL)."""
    fake = await engine([Turn(tool_calls=[("add", '{"a": "x\\ud8ca"}')])])
    _, model = await vllm(fake)
    params = _params()
    params.tools.add().function.CopyFrom(r.FunctionTool(name="add", parameters_json='{"type": "object"}'))
    (call,) = function_calls(await model.create_response(params, "s"))
    assert call.arguments == '{"a": "x\\ud8ca"}' and json.loads(call.arguments) == {"a": "x\ud8ca"}
    assert Hermes().parse('<tool_call>\n{"name": "f\\udc00", "arguments": {}}\n</tool_call>')[1] == []


async def test_on_an_engine_without_vllms_render_a_conversation_with_images_is_refused_saying_so(vllm, engine):
    """The fake engine serves neither /v1/chat/completions/render nor /inference/v1/generate: the images'
    features cannot go beside the ids (tests/real_engine/test_vision.py has the real engine, which does)."""
    fake = await engine([Turn(content="a cat")])
    _, model = await vllm(fake)
    params = _params("What is this?")
    png = b"\x89PNG\r\n\x1a\n" + b"\0" * 32
    picture = r.ContentPart(input_image=r.InputImage(data=png, media_type="image/png"))
    params.input_items.items.append(r.Item(message=r.Message(role=r.ROLE_USER, parts=r.ContentList(items=[picture]))))
    with pytest.raises(errors.InvalidArgument, match="does not serve /v1/chat/completions/render"):
        await model.create_response(params, "s")
    assert not [request for request in fake.requests if "prompt" in request]  # nothing generated
