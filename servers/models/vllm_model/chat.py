"""Responses <-> Chat Completions, for engines that only speak Chat Completions.

Request: the instructions and the leading system/developer messages become
one system message; consecutive assistant items (reasoning, text, function
calls) fold into one assistant message, the reasoning back inside its tags
as the model wrote it; a function_call_output is a `tool` message; tools are
nested the Chat way; max_output_tokens is max_tokens.

Answer: reasoning comes from the engine's reasoning field (`reasoning_content`
or `reasoning`, when it runs a reasoning parser) or from the tags in the text;
then the message, then one function_call per tool call. finish_reason
"length" makes the response incomplete (max_output_tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gym_grpc import images
from gym_grpc.data.rows import TOOL_CHOICE_MODE_NAMES, format_schema, params_extra, tool_parameters
from gym_grpc.responses import (
    assistant_message,
    input_items,
    item_body,
    message_text,
    new_id,
    new_response,
    parts_text,
    turns,
)
from gym_grpc.v1 import responses_pb2 as r

from .tool_calls import for_template

JSON = dict[str, Any]


def _content(message: r.Message) -> str | list[JSON]:
    """A message's content for Chat: a string, or parts when it holds images."""
    if message.WhichOneof("content") == "text":
        return message.text
    parts = message.parts.items
    if not any(p.WhichOneof("part") == "input_image" for p in parts):
        return message_text(message)
    return _chat_parts(parts)


def _chat_parts(parts: Iterable[r.ContentPart]) -> list[JSON]:
    out: list[JSON] = []
    for part in parts:
        kind = part.WhichOneof("part")
        if kind in ("input_text", "output_text"):
            out.append({"type": "text", "text": getattr(part, kind).text})
        elif kind == "input_image":
            image = {"url": images.to_url(part.input_image)}  # by value here: the server resolved references
            if part.input_image.detail:
                image["detail"] = part.input_image.detail
            out.append({"type": "image_url", "image_url": image})
    return out


def _tool_messages(output: r.FunctionCallOutput) -> list[JSON]:
    """A function_call_output as Chat messages: a `tool` message with its text, and when it holds images
    a user message with them after it (Chat's tool messages are text only)."""
    parts = output.output_parts.items
    if not parts:
        return [{"role": "tool", "tool_call_id": output.call_id, "content": output.output}]
    shown = [p for p in parts if p.WhichOneof("part") == "input_image"]
    messages: list[JSON] = [{"role": "tool", "tool_call_id": output.call_id, "content": parts_text(parts)}]
    if shown:
        messages.append({"role": "user", "content": _chat_parts(shown)})
    return messages


def _assistant_message(turn: list[r.Item], tags: tuple[str, str]) -> JSON:
    reasoning = "".join(s.text for i in turn if i.WhichOneof("item") == "reasoning" for s in i.reasoning.summary)
    text = "".join(message_text(i.message) for i in turn if i.WhichOneof("item") == "message")
    if reasoning:
        text = f"{tags[0]}{reasoning}{tags[1]}{text}"
    message: JSON = {"role": "assistant", "content": text or None}
    calls = [i.function_call for i in turn if i.WhichOneof("item") == "function_call"]
    if calls:
        message["tool_calls"] = [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": for_template(c.arguments)}}
            for c in calls
        ]
    return message


def to_messages(params: r.CreateParams, tags: tuple[str, str]) -> list[JSON]:
    """The conversation of a CreateParams as Chat Completions messages."""
    items = input_items(params)
    system = [params.instructions] if params.instructions else []
    start = 0
    for item in items:
        if item.WhichOneof("item") == "message" and item.message.role in (r.ROLE_SYSTEM, r.ROLE_DEVELOPER):
            system.append(message_text(item.message))
            start += 1
        else:
            break
    messages: list[JSON] = [{"role": "system", "content": "\n\n".join(system)}] if system else []
    for part in turns(items[start:]):
        if isinstance(part, list):
            messages.append(_assistant_message(part, tags))
        elif part.WhichOneof("item") == "function_call_output":
            messages.extend(_tool_messages(part.function_call_output))
        else:
            role = "user" if part.message.role == r.ROLE_USER else "system"
            messages.append({"role": role, "content": _content(part.message)})
    return messages


def to_request(params: r.CreateParams, model: str, tags: tuple[str, str]) -> JSON:
    """A Chat Completions request body for a CreateParams (token options not included)."""
    body: JSON = {"model": model, "messages": to_messages(params, tags)}
    tools = [t.function for t in params.tools if t.WhichOneof("tool") == "function"]
    if tools:
        body["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.name,
                    "description": t.description,
                    "parameters": tool_parameters(t) or {"type": "object"},
                },
            }
            for t in tools
        ]
        if params.HasField("parallel_tool_calls"):
            body["parallel_tool_calls"] = params.parallel_tool_calls
    choice = params.tool_choice
    if choice.WhichOneof("choice") == "function_name":
        body["tool_choice"] = {"type": "function", "function": {"name": choice.function_name}}
    elif choice.WhichOneof("choice") == "mode" and choice.mode:
        body["tool_choice"] = TOOL_CHOICE_MODE_NAMES[choice.mode]
    if params.HasField("max_output_tokens"):
        body["max_tokens"] = params.max_output_tokens
    for key in ("temperature", "top_p"):
        if params.HasField(key):
            body[key] = getattr(params, key)
    if params.reasoning.effort:
        body["reasoning_effort"] = params.reasoning.effort
    fmt = params.text.format
    if fmt.type == r.TEXT_FORMAT_TYPE_JSON_SCHEMA:
        schema: JSON = {"name": fmt.name or "response", "schema": format_schema(fmt) or {}}
        if fmt.HasField("strict"):
            schema["strict"] = fmt.strict
        body["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt.type == r.TEXT_FORMAT_TYPE_JSON_OBJECT:
        body["response_format"] = {"type": "json_object"}
    body.update(_other_options(params))
    return body


#: Responses parameters that mean nothing to a Chat Completions engine (or would break the exchange).
_RESPONSES_ONLY = frozenset(
    {"stream", "stream_options", "background", "include", "previous_response_id", "conversation"}
)


def _other_options(params: r.CreateParams) -> JSON:
    """The request's parameters that CreateParams does not model, for the engine: null means unset."""
    return {k: v for k, v in params_extra(params).items() if v is not None and k not in _RESPONSES_ONLY}


def split_reasoning(content: str, tags: tuple[str, str]) -> tuple[str, str]:
    """(reasoning, text) of a generated text that may hold `<think>...</think>`.

    A text with the closing tag but no opening one started inside the
    reasoning (the chat template opened it in the prompt)."""
    opening, closing = tags
    if opening in content:
        before, _, rest = content.partition(opening)
        reasoning, found, after = rest.partition(closing)
        return reasoning.strip(), (before + after if found else before).strip()
    if closing in content:
        reasoning, _, after = content.partition(closing)
        return reasoning.strip(), after.strip()
    return "", content.strip()


def _unicode(text: str) -> str:
    """`text` as a protobuf string can carry it: a lone surrogate (JSON's escape of half a
    character, which an engine may pass on from what the model wrote) becomes U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def to_response(answer: JSON, tags: tuple[str, str], params: r.CreateParams) -> r.Response:
    """A Chat Completions answer to `params` as a Response (token fields not included)."""
    choice = answer["choices"][0]
    message = choice.get("message") or {}
    content = _unicode(message.get("content") or "")
    field = _unicode(message.get("reasoning_content") or message.get("reasoning") or "")
    if field:
        reasoning, text = field.strip(), content.strip()
    else:
        reasoning, text = split_reasoning(content, tags)
    response = new_response(params, str(answer.get("model", "")))
    response.status = r.RESPONSE_STATUS_COMPLETED
    if isinstance(answer.get("created"), int | float) and answer["created"]:
        response.created_at = float(answer["created"])
    if reasoning:
        response.output.add().reasoning.CopyFrom(
            r.ReasoningItem(id=new_id("rs"), summary=[r.SummaryText(text=reasoning)], status=r.ITEM_STATUS_COMPLETED)
        )
    calls = message.get("tool_calls") or []
    if text or not calls:
        response.output.append(assistant_message(text))
    for call in calls:
        function = call.get("function") or {}
        response.output.add().function_call.CopyFrom(
            r.FunctionCall(
                id=new_id("fc"),
                call_id=call.get("id") or new_id("call"),
                name=_unicode(function.get("name", "")),
                arguments=_unicode(function.get("arguments") or "{}"),
                status=r.ITEM_STATUS_COMPLETED,
            )
        )
    reason = choice.get("finish_reason")
    if reason in ("length", "content_filter"):
        response.status = r.RESPONSE_STATUS_INCOMPLETE
        response.incomplete_details.reason = (
            r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS if reason == "length" else r.INCOMPLETE_REASON_CONTENT_FILTER
        )
        for item in response.output:
            item_body(item).status = r.ITEM_STATUS_INCOMPLETE
    usage = answer.get("usage") or {}
    response.usage.input_tokens = int(usage.get("prompt_tokens") or 0)
    response.usage.output_tokens = int(usage.get("completion_tokens") or 0)
    response.usage.total_tokens = int(usage.get("total_tokens") or 0)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached:
        response.usage.input_tokens_details.cached_tokens = int(cached)
    thought = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens")
    if thought:
        response.usage.output_tokens_details.reasoning_tokens = int(thought)
    return response
