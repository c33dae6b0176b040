"""The embedded default model: a local policy that needs no GPU, key or download.

It is a real participant in the rollout, not an oracle: it never sees the
task's expected answer. It computes arithmetic, calls the declared tools with
arguments read from the prompt, answers from tool outputs, guesses at
multiple-choice questions, and sometimes slips (see policy.py). Its token ids
come from a byte-level tokenizer with a ChatML-style template (tokenizer.py),
and each generated token has a log-probability: the log of the probability
of the random decision the token carries (the first token of the decided
text), 0.0 for tokens that follow from it with certainty. max_output_tokens
truncates the generation and makes the response incomplete, as an engine
would.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import sys
import zlib
from array import array
from typing import Any

from pydantic import Field

from gym_grpc.model import ModelServer
from gym_grpc.responses import assistant_message, input_items, item_body, new_id, new_response
from gym_grpc.server.serving import ServerConfig
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import responses_pb2 as r

from . import policy, tokenizer


def _low_bytes(ids: list[int]) -> bytes:
    """The low byte of every id, in C: the ids are hashed once per model call and grow with the conversation."""
    if sys.byteorder == "little":
        return array("I", ids).tobytes()[::4]
    return bytes(i & 0xFF for i in ids)


class LocalPolicyConfig(ServerConfig):
    error_rate: float = Field(0.15, ge=0.0, lt=0.5, description="chance of a slip per decision at temperature 1")
    model_name: str = Field("local-policy", description="model name reported in responses")
    seed: int = Field(0, description="seed of the sampling, combined with the session id")
    latency_seconds: float = Field(0.0, ge=0.0, description="wait this long per call, as a slow engine would")
    max_concurrent_calls: int | None = Field(
        None,
        ge=1,
        description="at most this many calls take their latency_seconds at once; the others queue, as in "
        "an engine that serves fewer requests than it is sent; null: no limit",
    )


class LocalPolicyModel(ModelServer):
    Config = LocalPolicyConfig
    config: LocalPolicyConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        limit = self.config.max_concurrent_calls
        self._serving = asyncio.Semaphore(limit) if limit is not None else contextlib.nullcontext()

    def capabilities(self) -> admin_pb.Capabilities:
        # Its tokenizer renders history exactly as generated: later prompts begin with earlier ids.
        capabilities = super().capabilities()
        capabilities.token_ids = capabilities.token_in_token_out = True
        return capabilities

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        if self.config.latency_seconds:
            async with self._serving:
                await asyncio.sleep(self.config.latency_seconds)
        items = input_items(params)
        prompt_ids = tokenizer.render_prompt(params.instructions, params.tools, items)
        temperature = params.temperature if params.HasField("temperature") else 1.0
        top_p = params.top_p if params.HasField("top_p") else 1.0
        rng = random.Random(f"{self.config.seed}:{session_id}:{zlib.crc32(_low_bytes(prompt_ids))}")
        turn = policy.decide(items, params, rng, self.config.error_rate, temperature, top_p)

        text = tokenizer.render_turn(turn.reasoning, turn.text, turn.calls)
        gen_ids = tokenizer.encode(text) + [tokenizer.IM_END]
        log_probs = [0.0] * len(gen_ids)
        at = text.find(turn.decided) if turn.decided else -1
        log_probs[len(text[: max(at, 0)].encode("utf-8"))] = turn.logprob

        response = new_response(params, params.model or self.config.model_name)
        response.status = r.RESPONSE_STATUS_COMPLETED
        limit = params.max_output_tokens if params.HasField("max_output_tokens") else None
        if limit is not None and len(gen_ids) > limit:
            gen_ids, log_probs = gen_ids[:limit], log_probs[:limit]
            response.status = r.RESPONSE_STATUS_INCOMPLETE
            response.incomplete_details.reason = r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS
            response.output.append(assistant_message(tokenizer.decode(gen_ids), r.ITEM_STATUS_INCOMPLETE))
        else:
            if turn.reasoning:
                response.output.add().reasoning.CopyFrom(
                    r.ReasoningItem(
                        id=new_id("rs"), summary=[r.SummaryText(text=turn.reasoning)], status=r.ITEM_STATUS_COMPLETED
                    )
                )
            if turn.text:
                response.output.append(assistant_message(turn.text, r.ITEM_STATUS_COMPLETED))
            for name, arguments in turn.calls:
                response.output.add().function_call.CopyFrom(
                    r.FunctionCall(
                        id=new_id("fc"),
                        call_id=new_id("call"),
                        name=name,
                        arguments=arguments,
                        status=r.ITEM_STATUS_COMPLETED,
                    )
                )
        last = response.output[-1]
        carrier = item_body(last)
        carrier.prompt_token_ids.extend(prompt_ids)
        carrier.generation_token_ids.extend(gen_ids)
        carrier.generation_log_probs.extend(log_probs)

        reasoning_tokens = len(tokenizer.encode(f"<think>{turn.reasoning}</think>\n")) if turn.reasoning else 0
        usage = response.usage
        usage.input_tokens = len(prompt_ids)
        usage.output_tokens = len(gen_ids)
        usage.total_tokens = len(prompt_ids) + len(gen_ids)
        usage.output_tokens_details.reasoning_tokens = min(reasoning_tokens, len(gen_ids))
        return response
