"""The vLLM model server with a vLLM gRPC server as its engine (base_url grpc://host:port): prompts rendered
and answers decoded here with the tokenizer the engine sends, one Generate a turn, the same prompt ids as
over HTTP; faults, cancellation and configuration. Against the fake engine's gRPC face (fake_vllm_grpc.py),
a stand-in for the client side: the real vLLM gRPC server runs in tests/real_engine."""

import asyncio
import logging
import socket

import pytest

from gym_grpc import errors
from gym_grpc.bundled.servers.models.vllm_model.server import VLLMModel
from gym_grpc.client.stubs import ModelClient
from gym_grpc.engines.settings import EngineSettings
from gym_grpc.responses import final_text, function_calls, user_message
from gym_grpc.testing import static_registry
from gym_grpc.testing.fake_engine import FakeEngine, Turn, write_tokenizer
from gym_grpc.testing.fake_vllm_grpc import FakeGrpcEngine
from gym_grpc.v1 import responses_pb2 as r

from .test_engine_link import _rollout, _script

FAST_RETRIES = {"backoff_seconds": 0.01, "max_backoff_seconds": 0.05}


@pytest.fixture
async def grpc_engine(engine, tmp_path, monkeypatch):
    """grpc_engine(turns, **options): a FakeEngine (started, for its HTTP face too) and its gRPC face."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # where fetched tokenizers are kept
    faces: list[FakeGrpcEngine] = []

    async def make(*args, **kwargs) -> tuple[FakeEngine, FakeGrpcEngine]:
        fake = await engine(*args, **kwargs)
        face = FakeGrpcEngine(fake, write_tokenizer(tmp_path / f"tokenizer-{len(faces)}"))
        await face.start()
        faces.append(face)
        return fake, face

    yield make
    for face in faces:
        await face.stop()


async def _model(start, base_url: str, **config) -> ModelClient:
    settings = {"base_url": base_url, "model": "p", **FAST_RETRIES, **config}
    return ModelClient(static_registry(model=await start(VLLMModel(settings, name="model"))), "model")


def _params(text="What is 2 + 3?", **fields) -> r.CreateParams:
    params = r.CreateParams(**fields)
    params.input_items.items.append(user_message(text))
    return params


@pytest.mark.parametrize("turns", [3, 8])
async def test_over_grpc_a_turn_is_one_generate_and_the_prompts_are_those_of_http(start, grpc_engine, turns):
    fake, face = await grpc_engine(_script(turns))
    over_grpc, prompts = await _rollout(start, fake, turns, face.base_url, **FAST_RETRIES)
    # The tokenizer fetched once, the model's context and end-of-sequence ids asked once.
    assert over_grpc == {"Generate": turns, "GetTokenizer": 1, "GetModelInfo": 1}
    fake, _ = await grpc_engine(_script(turns))
    _, over_http = await _rollout(start, fake, turns, **FAST_RETRIES)
    assert prompts == over_http and len(prompts) == turns


async def test_the_answer_is_decoded_here_without_its_end_of_sequence_and_its_tool_call_parsed(start, grpc_engine):
    fake, face = await grpc_engine([Turn(content="<think>Add.</think>", tool_calls=[("add", '{"a": 2, "b": 3}')])])
    model = await _model(start, face.base_url, return_token_ids=True)
    params = _params(temperature=0.5, top_p=0.9, max_output_tokens=300)
    params.tools.add().function.name = "add"
    response = await model.create_response(params, "s")
    assert response.output[0].reasoning.summary[0].text == "Add."
    [call] = function_calls(response)
    assert (call.name, call.arguments) == ("add", '{"a": 2, "b": 3}')
    carrier = response.output[-1].function_call
    assert carrier.generation_token_ids[-1] == 257 and len(carrier.generation_log_probs) == len(
        carrier.generation_token_ids
    )
    sent = fake.requests[-1]
    assert (sent["temperature"], sent["top_p"], sent["max_tokens"], sent["logprobs"]) == (0.5, 0.9, 300, 0)
    assert "structural_tag" in sent  # the tool-call grammar, as over HTTP its response_format
    assert sent["skip_special_tokens"] is False
    await model.registry.close()


async def test_without_token_ids_the_answer_is_the_same_text_and_carries_no_ids(start, grpc_engine):
    fake, face = await grpc_engine([Turn(content="The answer is 5.")])
    model = await _model(start, face.base_url)
    response = await model.create_response(_params(), "s")
    assert final_text(response) == "The answer is 5." and not response.output[-1].message.generation_token_ids
    assert response.usage.output_tokens == len("The answer is 5.") + 1
    await model.registry.close()


async def test_a_turn_cut_at_max_output_tokens_is_incomplete(start, grpc_engine):
    fake, face = await grpc_engine([Turn(content="a rather long answer")])
    model = await _model(start, face.base_url, return_token_ids=True)
    response = await model.create_response(_params(max_output_tokens=5), "s")
    assert response.status == r.RESPONSE_STATUS_INCOMPLETE and final_text(response) == "a rat"
    await model.registry.close()


async def test_a_turn_cut_inside_a_character_ends_before_it_as_vllms_detokenizer_writes_it(start, grpc_engine):
    fake, face = await grpc_engine([Turn(content="ab\u20ac and more")])  # the euro sign is 3 byte tokens
    model = await _model(start, face.base_url, return_token_ids=True)
    response = await model.create_response(_params(max_output_tokens=4), "s")
    carrier = response.output[-1].message
    assert final_text(response) == "ab" and len(carrier.generation_token_ids) == 4
    await model.registry.close()


async def test_a_prompt_past_the_context_ends_the_rollout_incomplete(start, grpc_engine):
    fake, face = await grpc_engine([Turn(content="never")], max_model_len=10)
    model = await _model(start, face.base_url, return_token_ids=True)
    response = await model.create_response(_params(), "s")
    assert response.status == r.RESPONSE_STATUS_INCOMPLETE and fake.calls["Generate"] == 0
    await model.registry.close()


async def test_internal_and_resource_exhausted_are_retried_and_logged(start, grpc_engine, caplog):
    fake, face = await grpc_engine([Turn(content="fine")])
    model = await _model(start, face.base_url)
    await model.create_response(_params(), "s")  # the tokenizer and model info fetched
    fake.fail_next = [500, 429]
    caplog.set_level(logging.WARNING, logger="gym_grpc.engines")
    response = await model.create_response(_params(), "s")
    assert final_text(response) == "fine"
    retries = [rec.getMessage() for rec in caplog.records if "retrying" in rec.getMessage()]
    assert "gRPC INTERNAL: injected 500 (server_error retry 1 of 5)" in retries[0]
    assert "gRPC RESOURCE_EXHAUSTED" in retries[1] and "rate_limited retry 1 of 5" in retries[1]
    await model.registry.close()


async def test_an_invalid_argument_is_the_engines_answer_not_retried(start, grpc_engine):
    fake, face = await grpc_engine([Turn(content="fine")])
    model = await _model(start, face.base_url)
    await model.create_response(_params(), "s")
    fake.fail_next = [400]
    with pytest.raises(errors.InvalidArgument, match=r"answered gRPC INVALID_ARGUMENT: injected 400") as error:
        await model.create_response(_params(), "s")
    assert error.value.reason == errors.Reason.ENGINE_REJECTED_REQUEST
    assert fake.calls["Generate"] == 2
    await model.registry.close()


async def test_a_cancelled_call_cancels_its_generation_on_the_engine(start, grpc_engine):
    """The caller gives up mid-generation (a rollout cancelled): the engine's Generate is cancelled too,
    not left generating for no one."""
    fake, face = await grpc_engine([Turn(content="fine")])
    model = await _model(start, face.base_url)
    await model.create_response(_params(), "s")
    fake.hang = True
    pending = asyncio.ensure_future(model.create_response(_params(), "s"))
    async with asyncio.timeout(30):
        while face.running == 0:
            await asyncio.sleep(0.01)
        pending.cancel()
        while face.cancelled == 0:
            await asyncio.sleep(0.01)
    assert face.running == 0 and pending.cancelled()
    await model.registry.close()


async def test_an_engine_not_up_yet_is_waited_for(start, grpc_engine, caplog):
    """A collect started before the engine: UNAVAILABLE is a wait (startup_wait_seconds), not a failure.
    The port is held by a socket that does not listen (connections refused), which the engine's server
    binds too when it starts (gRPC sets SO_REUSEPORT)."""
    fake, face = await grpc_engine([Turn(content="late but fine")])
    caplog.set_level(logging.WARNING, logger="gym_grpc.engines")
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        model = await _model(start, f"grpc://127.0.0.1:{port}", startup_wait_seconds=60)
        pending = asyncio.ensure_future(model.create_response(_params(), "s"))
        async with asyncio.timeout(30):
            while not any("does not answer yet" in rec.getMessage() for rec in caplog.records):
                await asyncio.sleep(0.02)
        late = FakeGrpcEngine(fake, face.tokenizer_dir)
        await late.start(port)
    try:
        assert final_text(await asyncio.wait_for(pending, 60)) == "late but fine"
        assert any("answered after" in rec.getMessage() for rec in caplog.records)
    finally:
        await late.stop()
        await model.registry.close()


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"render": "engine"}, "has no /tokenize"),
        ({"verify_render": True}, "has no /tokenize"),
    ],
)
async def test_what_a_grpc_engine_cannot_do_is_a_config_error_at_start(config, message):
    server = VLLMModel({"base_url": "grpc://127.0.0.1:1", "model": "p", **config}, name="m")
    with pytest.raises(errors.ConfigError, match=message):
        await server.start()


def test_base_urls_are_all_grpc_or_all_http():
    with pytest.raises(ValueError, match="either every base URL is grpc://host:port or none is"):
        EngineSettings(base_url=["grpc://a:1", "http://b:2/v1"], model="p")
    assert EngineSettings(base_url=["grpc://a:1", "grpc://b:1"], model="p").grpc
