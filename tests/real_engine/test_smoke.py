"""The local CPU vLLM answers what the model servers ask of it: token ids, log-probs, parsed tool calls.

These check the engine and its setup (gym_grpc.engines.local_vllm, the chat
template), not gym-grpc's servers: if they fail, every real-engine test of
the servers would fail for a reason that is not theirs.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import time
import urllib.parse
from typing import Any

import pytest

from gym_grpc.engines import local_vllm
from tests.real_engine.gym_cli import post_json

pytestmark = pytest.mark.real_engine

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "the city's name"}},
            "required": ["city"],
        },
    },
}


def _chat(engine: local_vllm.Engine, **body: Any) -> dict[str, Any]:
    return post_json(
        f"{engine.base_url}/chat/completions",
        {
            "model": engine.model,
            "temperature": 1.0,
            "seed": 1234,  # the same sample every run: these tests check structure, not luck
            "logprobs": True,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            **body,
        },
    )


def _detokenize(engine: local_vllm.Engine, ids: list[int]) -> str:
    root = engine.base_url.removesuffix("/v1")  # vLLM serves /tokenize and /detokenize outside /v1
    return post_json(f"{root}/detokenize", {"model": engine.model, "tokens": ids})["prompt"]


def _check_ids_and_logprobs(reply: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Prompt and generated ids are there and agree with usage and with the log-probs; returns both."""
    choice = reply["choices"][0]
    prompt_ids, generated_ids = reply["prompt_token_ids"], choice["token_ids"]
    assert prompt_ids and all(isinstance(i, int) for i in prompt_ids)
    assert generated_ids and all(isinstance(i, int) for i in generated_ids)
    assert reply["usage"]["prompt_tokens"] == len(prompt_ids)
    assert reply["usage"]["completion_tokens"] == len(generated_ids)
    logprobs = choice["logprobs"]["content"]
    # One log-prob per generated token, naming that very token (return_tokens_as_token_ids).
    assert [entry["token"] for entry in logprobs] == [f"token_id:{i}" for i in generated_ids]
    assert all(entry["logprob"] <= 0.0 for entry in logprobs)
    return prompt_ids, generated_ids


def test_chat_completion_returns_prompt_and_generated_ids_with_logprobs(engine: local_vllm.Engine) -> None:
    reply = _chat(engine, messages=[{"role": "user", "content": "What is 2 + 3? Answer briefly."}], max_tokens=24)
    prompt_ids, generated_ids = _check_ids_and_logprobs(reply)
    prompt = _detokenize(engine, prompt_ids)
    assert prompt.endswith("<|im_start|>user\nWhat is 2 + 3? Answer briefly.<|im_end|>\n<|im_start|>assistant\n")
    text = reply["choices"][0]["message"]["content"]
    assert _detokenize(engine, generated_ids).removesuffix("<|im_end|>") == text


def test_tools_are_rendered_and_a_required_tool_call_is_parsed(engine: local_vllm.Engine) -> None:
    reply = _chat(
        engine,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
        # Greedy: "required" does not constrain this build's output, and at temperature 1.0 this
        # model sometimes runs past the closing </tool_call> (then nothing is parsed).
        temperature=0.0,
        max_tokens=128,
    )
    prompt_ids, _ = _check_ids_and_logprobs(reply)
    prompt = _detokenize(engine, prompt_ids)
    # Our template's tool block, with the schema's keys sorted.
    assert "<tools>\n" + json.dumps(WEATHER_TOOL, sort_keys=True) + "\n</tools>" in prompt
    (call,) = reply["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert isinstance(json.loads(call["function"]["arguments"]), dict)


def test_an_earlier_tool_call_and_its_result_render_as_hermes_turns(engine: local_vllm.Engine) -> None:
    reply = _chat(
        engine,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
        ],
        tools=[WEATHER_TOOL],
        max_tokens=16,
    )
    prompt_ids, _ = _check_ids_and_logprobs(reply)
    assert _detokenize(engine, prompt_ids).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        "<|im_end|>\n<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_seeded_requests_arriving_together_do_not_kill_the_engine(engine: local_vllm.Engine) -> None:
    """vLLM 0.32's CPU runner kills its engine core when a seeded request is prefilled in chunks
    (RuntimeError "CPU Generator does not use offset"), which happens as soon as the prompts of
    concurrent requests exceed one step's token budget; gym_grpc.engines.local_vllm starts vLLM with
    whole prefills only. 48 seeded requests of ~230 tokens at once are well past vLLM's default
    budget of 2,048 tokens."""

    def ask(i: int) -> str:
        reply = _chat(
            engine, messages=[{"role": "user", "content": "Weather in Paris? " * 40 + str(i)}], seed=i, max_tokens=8
        )
        return reply["choices"][0]["finish_reason"]

    with concurrent.futures.ThreadPoolExecutor(48) as pool:
        reasons = list(pool.map(ask, range(48)))
    assert len(reasons) == 48 and set(reasons) <= {"stop", "length"}


def test_an_idle_connection_outlives_vllms_default_five_second_keep_alive(engine: local_vllm.Engine) -> None:
    """The local engine keeps an idle connection open past uvicorn's 5 s (VLLM_HTTP_TIMEOUT_KEEP_ALIVE:
    local_vllm's process.KEEPALIVE_SECONDS), so that a model server's connections outlast a trainer's
    step: a request, 6 s of nothing, then a second request on the same connection is answered (a
    connection the engine had closed would fail it, RemoteDisconnected, or be reopened from another
    port)."""
    url = urllib.parse.urlsplit(engine.base_url)
    assert url.hostname is not None and url.port is not None
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.request("GET", "/health")
        first = connection.getresponse()
        first.read()
        assert first.status == 200 and connection.sock is not None
        local = connection.sock.getsockname()
        time.sleep(6)
        connection.request("GET", "/health")
        second = connection.getresponse()
        second.read()
        assert second.status == 200 and connection.sock.getsockname() == local
    finally:
        connection.close()
