"""A byte-level tokenizer and a ChatML-style chat template.

Token ids 0-255 are the UTF-8 bytes of the text; 256 and 257 open and close a
turn. Byte-level means no vocabulary file to ship or download, and a token's
position is its byte offset, which keeps the policy's log-probs easy to place.

The template renders an assistant turn that carries `generation_token_ids`
from those ids verbatim, so the prompt of turn t+1 starts with the prompt of
turn t followed by its generation: multi-turn training stays on-policy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from gym_grpc.data.rows import tool_parameters
from gym_grpc.responses import item_body, message_text, turns
from gym_grpc.v1 import responses_pb2 as r

IM_START = 256
IM_END = 257
VOCAB_SIZE = 258

_ROLE_TAGS = {r.ROLE_USER: "user", r.ROLE_ASSISTANT: "assistant", r.ROLE_SYSTEM: "system", r.ROLE_DEVELOPER: "system"}


def encode(text: str) -> list[int]:
    """Token ids of a text (its UTF-8 bytes)."""
    return list(text.encode("utf-8"))


def decode(ids: Sequence[int]) -> str:
    """Text of token ids; turn markers are dropped, broken UTF-8 is replaced."""
    return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def render_turn(reasoning: str | None, text: str | None, calls: Sequence[tuple[str, str]]) -> str:
    """The text of one assistant turn: <think>, the message, then <tool_call>s."""
    parts = []
    if reasoning:
        parts.append(f"<think>{reasoning}</think>\n")
    if text:
        parts.append(text)
    for name, arguments in calls:
        prefix = "\n" if parts else ""
        parts.append(f'{prefix}<tool_call>{{"name": {json.dumps(name)}, "arguments": {arguments}}}</tool_call>')
    return "".join(parts)


def _block(role: str, text: str) -> list[int]:
    return [IM_START, *encode(f"{role}\n{text}"), IM_END, *encode("\n")]


def _assistant_turn(turn: list[r.Item]) -> list[int]:
    for item in reversed(turn):
        inner = item_body(item)
        if inner.generation_token_ids:
            return [IM_START, *encode("assistant\n"), *inner.generation_token_ids, *encode("\n")]
    reasoning = " ".join(s.text for i in turn if i.WhichOneof("item") == "reasoning" for s in i.reasoning.summary)
    text = "".join(message_text(i.message) for i in turn if i.WhichOneof("item") == "message")
    calls = [(i.function_call.name, i.function_call.arguments) for i in turn if i.WhichOneof("item") == "function_call"]
    return [IM_START, *encode("assistant\n" + render_turn(reasoning, text, calls)), IM_END, *encode("\n")]


def render_prompt(instructions: str, tools: Sequence[r.Tool], items: Sequence[r.Item]) -> list[int]:
    """Token ids of the whole prompt, ending with the opening of the assistant's turn."""
    ids: list[int] = []
    system = instructions
    if tools:
        described = "\n".join(
            json.dumps(
                {
                    "name": t.function.name,
                    "description": t.function.description,
                    "parameters": tool_parameters(t.function) or {},
                },
                sort_keys=True,
            )
            for t in tools
        )
        system = f"{system}\n\n# Tools\n{described}".strip()
    if system:
        ids += _block("system", system)
    for part in turns(items):
        if isinstance(part, list):
            ids += _assistant_turn(part)
        elif part.WhichOneof("item") == "function_call_output":
            ids += _block("tool", part.function_call_output.output)
        else:
            ids += _block(_ROLE_TAGS.get(part.message.role, "user"), message_text(part.message))
    return ids + [IM_START, *encode("assistant\n")]
