"""The Responses-API model server against a fake engine speaking OpenAI's /v1/responses."""

import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.models.openai_model.server import OpenAIModel
from gym_grpc.client.stubs import AgentClient, ModelClient
from gym_grpc.responses import final_text, user_message
from gym_grpc.testing import Calculator, call, static_registry
from gym_grpc.testing import calculator_task as task
from gym_grpc.testing.fake_engine import FakeEngine, Turn
from gym_grpc.v1 import responses_pb2 as r


@pytest.fixture
async def fake():
    engine = FakeEngine([Turn(tool_calls=[("add", '{"a": 2, "b": 3}')]), Turn(content="The answer is 5.")])
    await engine.start()
    yield engine
    await engine.stop()


async def _model(start, fake, **config):
    settings = {"base_url": fake.base_url, "model": "gpt-test", "api_key": "sk-test", "backoff_seconds": 0.01, **config}
    return await start(OpenAIModel(settings, name="model"))


async def test_a_multi_turn_tool_conversation_through_the_responses_api(start, fake):
    model = await _model(start, fake)
    env = await start(Calculator())
    agent = await start(
        SimpleAgent(
            {"model_server": "model", "resources_server": "calc"},
            name="a",
            registry=static_registry(model=model, calc=env),
        )
    )
    client = AgentClient(static_registry(agent=agent), "agent")
    rollout = await client.run(task("What is 2 + 3?", expected_answer=5), timeout=30)
    assert [i.WhichOneof("item") for i in rollout.response.output] == [
        "function_call",
        "function_call_output",
        "message",
    ]
    assert rollout.reward == 1.0 and final_text(rollout.response) == "The answer is 5."
    second = fake.requests[1]
    assert second["model"] == "gpt-test" and second["store"] is False
    assert [item["type"] for item in second["input"]] == ["message", "function_call", "function_call_output"]
    assert second["input"][2]["output"] == "5"
    assert fake.headers[0]["Authorization"] == "Bearer sk-test"
    await client.registry.close()


async def test_training_fields_are_not_sent_to_the_engine(start, fake):
    server = await _model(start, fake)
    model = ModelClient(static_registry(model=server), "model")
    params = r.CreateParams()
    params.input_items.items.append(user_message("hi"))
    earlier = call("add", "{}")
    earlier.function_call.generation_token_ids.extend([1, 2, 3])
    earlier.function_call.generation_log_probs.extend([-1.0, -1.0, -1.0])
    params.input_items.items.append(earlier)
    await model.create_response(params, "s")
    sent = fake.requests[0]["input"][1]
    assert sent["type"] == "function_call" and "generation_token_ids" not in sent and "generation_log_probs" not in sent
    await model.registry.close()


async def test_an_engine_error_is_a_clear_status(start, fake):
    server = await _model(start, fake)
    model = ModelClient(static_registry(model=server), "model")
    params = r.CreateParams(input_text="hi")
    fake.fail_next = [400]
    with pytest.raises(errors.InvalidArgument) as error:
        await model.create_response(params, "s")
    assert "HTTP 400" in error.value.message and "injected 400" in error.value.message
    fake.fail_next = [429, 502]
    response = await model.create_response(params, "s")  # retried through
    assert response.output
    await model.registry.close()
