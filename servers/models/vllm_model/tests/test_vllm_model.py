"""The vLLM model server against a fake vLLM speaking the real wire format: the Chat Completions
path, and what both paths share (retries, context errors, engine pools, options). The token path
has its own tests in test_token_in_token_out.py."""

import asyncio
import json
import logging
import time

import grpc
import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.vllm_model import chat
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.client.stubs import AgentClient, ModelClient
from gym_grpc.data import record
from gym_grpc.responses import final_text, function_calls, user_message
from gym_grpc.server import validation
from gym_grpc.testing import Calculator, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.testing.fake_engine import Turn
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

FAST_RETRIES = {"backoff_seconds": 0.01, "max_backoff_seconds": 0.05}


async def _model(start, fake, **config) -> ModelClient:
    settings = {"base_url": fake.base_url, "model": "policy", "api_key": "sk-test", **FAST_RETRIES, **config}
    server = await start(VLLMModel(settings, name="model"))
    return ModelClient(static_registry(model=server), "model")


def _params(text="What is 2 + 3?", **fields) -> r.CreateParams:
    params = r.CreateParams(**fields)
    params.input_items.items.append(user_message(text))
    return params


async def test_a_multi_turn_tool_conversation_round_trips_the_token_ids(start, engine):
    fake = await engine(
        [
            Turn(content="<think>I should add.</think>", tool_calls=[("add", '{"a": 2, "b": 3}')]),
            Turn(content="<think>It is 5.</think>The answer is 5."),
        ]
    )
    model = await start(
        VLLMModel(
            {"base_url": fake.base_url, "model": "policy", "return_token_ids": True, "token_in_token_out": False},
            name="m",
        )
    )
    env = await start(Calculator())
    agent = await start(
        SimpleAgent(
            {"model_server": "m", "resources_server": "calc"}, name="a", registry=static_registry(m=model, calc=env)
        )
    )
    client = AgentClient(static_registry(agent=agent), "agent")
    rollout = await client.run(task("What is 2 + 3?", expected_answer=5), timeout=30)
    kinds = [i.WhichOneof("item") for i in rollout.response.output]
    assert kinds == ["reasoning", "function_call", "function_call_output", "reasoning", "message"]
    assert rollout.reward == 1.0 and rollout.response.output[2].function_call_output.output == "5"
    # The engine saw the first turn folded into one assistant message, reasoning back in its tags.
    second = fake.requests[1]["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "tool"]
    assert second[1]["content"] == "<think>I should add.</think>"
    assert second[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    assert second[2]["tool_call_id"] == rollout.response.output[1].function_call.call_id
    assert all(request["return_token_ids"] and request["return_tokens_as_token_ids"] for request in fake.requests)
    # Token ids sit on the last item of each turn, and turn 2's prompt extends turn 1.
    first, last = rollout.response.output[1].function_call, rollout.response.output[4].message
    assert len(first.generation_log_probs) == len(first.generation_token_ids) > 0
    prefix = list(first.prompt_token_ids) + list(first.generation_token_ids)
    assert list(last.prompt_token_ids)[: len(prefix)] == prefix
    assert not rollout.response.output[0].reasoning.generation_token_ids
    await client.registry.close()


async def test_reasoning_is_read_from_the_field_or_from_the_tags(start, engine):
    fake = await engine(
        [
            Turn(content="Five.", reasoning_field="two plus three"),
            Turn(content="[[thinking]]add them[[/thinking]]Five."),
            Turn(content="add them</think>Five."),
        ]
    )
    model = await _model(start, fake, reasoning_tags=["[[thinking]]", "[[/thinking]]"])
    for expected_close in ("two plus three", "add them"):
        response = await model.create_response(_params(), "s")
        assert response.output[0].reasoning.summary[0].text == expected_close
        assert final_text(response) == "Five."
    model = await _model(start, fake)
    response = await model.create_response(_params(), "s")  # started inside the reasoning: no opening tag
    assert response.output[0].reasoning.summary[0].text == "add them" and final_text(response) == "Five."
    await model.registry.close()


async def test_length_truncation_makes_an_incomplete_response(start, engine):
    fake = await engine([Turn(content="a rather long answer")])
    model = await _model(start, fake, return_token_ids=True)
    response = await model.create_response(_params(max_output_tokens=5), "s")
    assert fake.requests[0]["max_tokens"] == 5
    assert response.status == r.RESPONSE_STATUS_INCOMPLETE
    assert response.incomplete_details.reason == r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
    assert final_text(response) == "a rat"
    assert len(response.output[-1].message.generation_token_ids) == 5
    await model.registry.close()


async def test_a_context_length_error_ends_the_rollout_instead_of_failing_it(start, engine):
    fake = await engine([Turn(content="never")], max_model_len=10)
    model = await _model(start, fake)
    response = await model.create_response(_params(), "s")
    assert response.status == r.RESPONSE_STATUS_INCOMPLETE
    assert response.incomplete_details.reason == r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
    await model.registry.close()


async def test_a_429_storm_recovers_and_every_retry_is_logged(start, engine, caplog):
    fake = await engine([Turn(content="fine")])
    fake.fail_next = [429, 429, 503, 429]
    model = await _model(start, fake)
    caplog.set_level(logging.WARNING, logger="gym_grpc.engines")
    response = await model.create_response(_params(), "s")
    assert final_text(response) == "fine" and len(fake.requests) == 5
    retries = [rec.getMessage() for rec in caplog.records if "retrying" in rec.getMessage()]
    assert len(retries) == 4
    assert "HTTP 429" in retries[0] and "rate_limited retry 1 of 5" in retries[0]
    assert "HTTP 503" in retries[2] and "server_error retry 1 of 5" in retries[2]
    await model.registry.close()


async def test_retries_are_bounded_then_unavailable(start, engine):
    fake = await engine([Turn(content="never")])
    fake.fail_next = [503] * 10
    model = await _model(start, fake, max_retries=2)
    with pytest.raises(errors.Unavailable) as error:
        await model.create_response(_params(), "s")
    assert "gave up after 2 server_error retries" in error.value.message and "HTTP 503" in error.value.message
    assert len(fake.requests) == 3
    await model.registry.close()


async def test_an_engine_that_never_answers_fails_in_bounded_time(start, engine):
    fake = await engine()
    fake.hang = True
    model = await _model(start, fake, read_timeout=0.3, max_retries=1)
    began = time.monotonic()
    with pytest.raises(errors.Unavailable) as error:
        await model.create_response(_params(), "s")
    assert "gave up after 1 timeout retries" in error.value.message and time.monotonic() - began < 5
    # With the caller's deadline shorter than the read timeout, the deadline wins.
    patient = await _model(start, fake, read_timeout=60)
    began = time.monotonic()
    with pytest.raises(errors.DeadlineExceeded):
        await patient._call("CreateResponse", _request(), timeout=0.5)
    assert time.monotonic() - began < 5
    await model.registry.close()
    await patient.registry.close()


def _request():
    from gym_grpc.v1 import model_service_pb2

    return model_service_pb2.CreateResponseRequest(params=_params())


async def test_an_engine_that_is_down_is_unavailable(start):
    model = await start(
        VLLMModel(
            {
                "base_url": "http://127.0.0.1:1/v1",
                "model": "p",
                "max_retries": 1,
                "startup_wait_seconds": 0,
                **FAST_RETRIES,
            },
            name="m",
        )
    )
    client = ModelClient(static_registry(m=model), "m")
    with pytest.raises(errors.Unavailable) as error:
        await client.create_response(_params(), "s")
    assert "127.0.0.1:1" in error.value.message
    await client.registry.close()


@pytest.mark.slow
async def test_4000_concurrent_requests_through_one_model_server(start, engine):
    fake = await engine([Turn(content="ok")])
    model = await _model(start, fake, return_token_ids=True)
    replies = await asyncio.gather(
        *(model.create_response(_params(), f"s{i}") for i in range(4000)), return_exceptions=True
    )
    failures = [x for x in replies if isinstance(x, BaseException)]
    assert not failures, failures[:3]
    assert len(fake.requests) == 4000
    assert all(final_text(x) == "ok" and x.output[-1].message.generation_token_ids for x in replies)
    await model.registry.close()


@pytest.mark.parametrize("token_in_token_out", [True, False])
async def test_token_sources_that_disagree_are_an_error(start, engine, token_in_token_out):
    fake = await engine([Turn(content="ok")])
    fake.disagree = True
    model = await _model(start, fake, return_token_ids=True, token_in_token_out=token_in_token_out)
    with pytest.raises(errors.GymError) as error:
        await model.create_response(_params(), "s")
    assert error.value.code == grpc.StatusCode.INTERNAL and "disagree" in error.value.message
    await model.registry.close()


async def _two_turns(model) -> r.Response:
    params = _params()
    first = await model.create_response(params, "s")
    params.input_items.items.extend(first.output)
    params.input_items.items.append(user_message("And 3 + 4?"))
    return await model.create_response(params, "s")


async def test_a_template_that_rewrites_history_is_caught_unless_the_prefix_is_required(start, engine):
    turns = [Turn(content="<think>hm</think>5"), Turn(content="7")]
    fake = await engine(turns, strip_history_reasoning=True)
    checking = await _model(start, fake, return_token_ids=True, token_in_token_out=False)
    with pytest.raises(errors.FailedPrecondition) as error:
        await _two_turns(checking)
    assert "part from the earlier turns' ids" in error.value.message
    fake.requests.clear()
    requiring = await _model(start, fake, return_token_ids=True, token_in_token_out=False, prefix_token_ids="require")
    second = await _two_turns(requiring)
    sent = fake.requests[1]["required_prefix_token_ids"]
    assert list(second.output[-1].message.prompt_token_ids)[: len(sent)] == sent
    await checking.registry.close()
    await requiring.registry.close()


async def test_prompt_ids_come_from_tokenize_when_the_engine_does_not_return_them(start, engine):
    fake = await engine([Turn(content="ok")])
    fake.without_token_ids = True  # an older vLLM
    model = await _model(start, fake, return_token_ids=True, token_in_token_out=False)
    response = await model.create_response(_params(), "s")
    carrier = response.output[-1].message
    assert list(carrier.prompt_token_ids) == fake.render(fake.requests[0]["messages"], True)
    assert len(carrier.generation_token_ids) == len(carrier.generation_log_probs) > 0
    await model.registry.close()


async def test_a_session_sticks_to_one_engine_and_sessions_spread(start, engine):
    engines = [await engine([Turn(content="a")]), await engine([Turn(content="b")])]
    server = await start(VLLMModel({"base_url": [e.base_url for e in engines], "model": "p"}, name="m"))
    model = ModelClient(static_registry(m=server), "m")
    answers = {}
    for i in range(20):
        answers[i] = {final_text(await model.create_response(_params(), f"session-{i}")) for _ in range(3)}
    assert all(len(seen) == 1 for seen in answers.values())  # each session always saw one engine
    assert {next(iter(seen)) for seen in answers.values()} == {"a", "b"}
    await model.registry.close()


async def test_route_by_prompt_keeps_a_groups_rollouts_and_their_turns_on_one_engine(start, engine):
    """A GRPO group's rollouts share their prompt: with route_by prompt they share an engine (its prefix
    cache), whatever their session ids, and so does every later turn of each."""
    engines = [await engine([Turn(content="a")]), await engine([Turn(content="b")])]
    config = {"base_url": [e.base_url for e in engines], "model": "p", "route_by": "prompt"}
    model = ModelClient(static_registry(m=await start(VLLMModel(config, name="m"))), "m")
    seen = {}
    for group in range(12):
        answers = set()
        for member in range(4):
            first = _params(f"task {group}")
            answer = await model.create_response(first, f"group-{group}-rollout-{member}")
            later = _params(f"task {group}")  # the rollout's next turn: its answer and a new message appended
            later.input_items.items.extend(answer.output)
            later.input_items.items.append(user_message("go on"))
            answers |= {final_text(answer), final_text(await model.create_response(later, f"x-{member}"))}
        seen[group] = answers
    assert all(len(answers) == 1 for answers in seen.values()), seen
    assert {next(iter(answers)) for answers in seen.values()} == {"a", "b"}  # and the groups spread
    await model.registry.close()


async def test_a_prompt_cache_key_puts_calls_on_one_engine_whatever_their_prompt_or_session(start, engine):
    engines = [await engine([Turn(content="a")]), await engine([Turn(content="b")])]
    model = await _model(start, engines[0], base_url=[e.base_url for e in engines])
    for key in ("group-1", "group-2", "group-3", "group-4"):
        answers = set()
        for i in range(6):
            params = _params(f"question {i}")
            params.extra_json = json.dumps({"prompt_cache_key": key})
            answers.add(final_text(await model.create_response(params, f"session-{i}")))
        assert len(answers) == 1, (key, answers)
    assert all(request.get("prompt_cache_key") for e in engines for request in e.requests)  # sent on as it came
    await model.registry.close()


def test_the_request_folds_system_messages_nests_tools_and_maps_parameters():
    params = r.CreateParams(instructions="Be brief.", temperature=0.5, max_output_tokens=64)
    params.reasoning.effort = "high"
    params.input_items.items.add().message.CopyFrom(r.Message(role=r.ROLE_DEVELOPER, text="Use tools."))
    params.input_items.items.append(user_message("hi"))
    tool = params.tools.add().function
    tool.name, tool.description = "add", "Add."
    tool.parameters.update({"type": "object"})
    params.tool_choice.function_name = "add"
    params.extra.update({"top_k": 20})
    body = chat.to_request(params, "policy", ("<think>", "</think>"))
    assert body["messages"] == [
        {"role": "system", "content": "Be brief.\n\nUse tools."},
        {"role": "user", "content": "hi"},
    ]
    assert body["tools"] == [
        {"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {"type": "object"}}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "add"}}
    assert (body["max_tokens"], body["temperature"], body["reasoning_effort"], body["top_k"]) == (64, 0.5, "high", 20)
    assert body["model"] == "policy"


async def test_the_api_key_goes_as_a_bearer_token(start, engine):
    fake = await engine([Turn(content="ok")])
    model = await _model(start, fake)
    await model.create_response(_params(), "s")
    assert fake.headers[0]["Authorization"] == "Bearer sk-test"
    fake.fail_next = [401]
    with pytest.raises(errors.FailedPrecondition) as error:
        await model.create_response(_params(), "s")
    assert "check the API key" in error.value.message
    await model.registry.close()


def test_an_answer_becomes_a_valid_response_and_rollout_row():
    answer = {
        "choices": [{"message": {"content": "hi", "tool_calls": []}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
    }
    response = chat.to_response(answer, ("<think>", "</think>"), _params())
    assert function_calls(response) == [] and response.usage.total_tokens == 4
    validation.check_response(response, "response")  # what Verify would accept
    row = record.scored({"responses_create_params": {"input": "hi"}}, task_pb2.Rollout(response=response))
    assert row["response"]["output"][0]["role"] == "assistant"
    assert row["response"]["output"][0]["content"][0]["text"] == "hi"


async def test_special_tokens_are_asked_for_unless_the_config_or_the_row_says_otherwise(start, engine):
    """The engine is asked to keep special tokens in the text (tests/real_engine/test_token_ids.py shows
    why with the real vLLM); a row's extra_body wins, and a null config sends no field at all."""
    fake = await engine([Turn(content="ok")] * 3)
    model = await _model(start, fake)
    await model.create_response(_params(), "s")
    params = _params()
    params.metadata["extra_body"] = json.dumps({"skip_special_tokens": True})
    await model.create_response(params, "s")
    assert [sent["skip_special_tokens"] for sent in fake.requests] == [False, True]
    await model.registry.close()
    quiet = await _model(start, fake, skip_special_tokens=None)
    await quiet.create_response(_params(), "s")
    assert "skip_special_tokens" not in fake.requests[-1]
    await quiet.registry.close()


async def test_row_engine_options_merge_over_the_config_and_under_the_rows_own_fields(start, engine):
    fake = await engine([Turn(content="ok")])
    config = {"extra_body": {"seed": 1, "min_p": 0.1}, "chat_template_kwargs": {"enable_thinking": True, "x": 1}}
    model = await _model(start, fake, **config)
    params = _params(temperature=0.5)
    params.metadata["extra_body"] = json.dumps({"seed": 7, "top_k": 5, "temperature": 2.0})
    params.metadata["chat_template_kwargs"] = json.dumps({"enable_thinking": False})
    await model.create_response(params, "s")
    sent = fake.requests[0]
    assert (sent["seed"], sent["top_k"], sent["min_p"]) == (7, 5, 0.1)  # the row's over the config's
    assert sent["temperature"] == 0.5  # the row's own field wins over its extra_body, as in NeMo Gym
    assert sent["chat_template_kwargs"] == {"enable_thinking": False, "x": 1}
    params.metadata["extra_body"] = "seed=7"
    with pytest.raises(errors.InvalidArgument) as error:
        await model.create_response(params, "s")
    assert error.value.field == "params.metadata.extra_body" and "not JSON" in error.value.message
    assert len(fake.requests) == 1  # refused before the engine is asked
    await model.registry.close()


async def test_a_lone_surrogate_from_the_engine_becomes_a_replacement_character(start, engine):
    """JSON can carry an escaped half character that no protobuf string can: it must not fail the call."""
    fake = await engine([Turn(content="ok \ud8ca", tool_calls=[("add", '{"a": "\ud8ca"}')])])
    model = await _model(start, fake, token_in_token_out=False)
    response = await model.create_response(_params(), "s")
    assert final_text(response) == "ok \ufffd"
    assert function_calls(response)[0].arguments == '{"a": "\ufffd"}'
    await model.registry.close()
