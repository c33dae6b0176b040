"""A tool call whose arguments hold half a character, on the real CPU vLLM.

At temperature 1.0 a model may write the JSON escape of a lone surrogate ("\\ud8ca") in a call's
arguments (seen in CI, 2026-12-06). vLLM decodes a call's arguments into an object for its chat
template, and its tokenizer cannot encode that character: /tokenize and the chat path answer 400 for
any conversation that holds the call. The model server gives a template such a call's arguments as
{}, so the next turn is answered, on the token path (rendered here and checked against the engine's
/tokenize, configs/vllm.yaml with verify_render) and on the chat path.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gym_grpc.client.stubs import ModelClient
from gym_grpc.engines import local_vllm
from gym_grpc.responses import user_message
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from tests.real_engine import gym_cli

pytestmark = pytest.mark.real_engine

ARGUMENTS = '{"city": "Par\\ud8ca"}'


def _conversation() -> r.CreateParams:
    params = r.CreateParams(temperature=0.0, max_output_tokens=8)
    items = params.input_items.items
    items.append(user_message("What is the weather in Paris?"))
    items.add().function_call.CopyFrom(r.FunctionCall(call_id="call_1", name="get_weather", arguments=ARGUMENTS))
    items.add().function_call_output.CopyFrom(r.FunctionCallOutput(call_id="call_1", output="Sunny, 21 C."))
    return params


def test_vllm_answers_400_for_a_conversation_with_such_a_call(engine: local_vllm.Engine) -> None:
    """What the model server works around: if vLLM ever renders such a call, this fails, and the
    workaround can go."""
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."},
    ]
    url = f"{engine.base_url.removesuffix('/v1')}/tokenize"
    with pytest.raises(AssertionError, match="-> 400: .*TextEncodeInput"):
        gym_cli.post_json(url, {"model": engine.model, "messages": messages, "add_generation_prompt": True})


@pytest.mark.parametrize("token_in_token_out", [True, False])
def test_the_turn_after_a_call_with_an_escaped_half_character_is_answered(
    engine: local_vllm.Engine, tmp_path: Path, token_in_token_out: bool
) -> None:
    overrides = (f"servers.policy_model.config.token_in_token_out={str(token_in_token_out).lower()}",)
    with gym_cli.serving(engine, tmp_path, gym_cli.VLLM, overrides=overrides) as run:

        async def answer() -> r.Response:
            registry = Registry(run.registry)
            try:
                return await ModelClient(registry, "policy_model").create_response(_conversation(), "s")
            finally:
                await registry.close()

        response = asyncio.run(answer())
    assert response.status in (r.RESPONSE_STATUS_COMPLETED, r.RESPONSE_STATUS_INCOMPLETE)
    said = response.output[-1].message
    assert said.generation_token_ids and len(said.generation_log_probs) == len(said.generation_token_ids)
    assert said.prompt_token_ids, "the turn carries the prompt the engine generated from"
