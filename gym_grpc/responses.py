"""Small helpers over the Responses messages that servers keep needing."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from random import getrandbits as _random_bits
from typing import Any

from google.protobuf.message import Message

from gym_grpc.data.rows import ECHOED_KEYS, dumps
from gym_grpc.v1 import responses_pb2 as r


def new_id(prefix: str) -> str:
    """A fresh id in the Responses style, such as "msg_3f2a...": 128 random bits in hex, as
    uuid4().hex would give less its version bits (a rollout makes several ids per model call).

    The bits come from `random`, seeded from the OS and again in each forked child: an
    item id needs to be unique, not unguessable, and this is a fifth of os.urandom's cost,
    which is a system call per id."""
    return f"{prefix}_{_random_bits(128):032x}"


#: The keys a Response has that a model server's request may leave out, as extra_json.
_ENVELOPE = dumps({"object": "response"})
_ENVELOPE_WITHOUT_TOOLS = dumps({"object": "response", "tools": []})


def new_response(params: r.CreateParams, model: str) -> r.Response:
    """A Response to `params` as the Responses API starts one: a new id, the time,
    the request parameters echoed, and the keys the API always has (`object`,
    and `tools`, `tool_choice`, `parallel_tool_calls` at their defaults when the
    request left them out). A model server adds the output, usage and status."""
    response = r.Response(id=new_id("resp"), created_at=time.time(), model=model)
    response.usage.input_tokens_details.SetInParent()  # the API always has both details
    response.usage.output_tokens_details.SetInParent()
    source: Message = params  # the keys are names, checked as any message's fields
    for name in ECHOED_KEYS:
        field = getattr(params, name)
        if name in ("tools", "metadata"):
            getattr(response, name).MergeFrom(field)
        elif source.HasField(name):
            if name in ("tool_choice", "reasoning", "text"):
                getattr(response, name).CopyFrom(field)
            else:
                setattr(response, name, field)
    if not response.HasField("tool_choice"):
        response.tool_choice.mode = r.TOOL_CHOICE_MODE_AUTO
    if not response.HasField("parallel_tool_calls"):
        response.parallel_tool_calls = True
    response.extra_json = _ENVELOPE if response.tools else _ENVELOPE_WITHOUT_TOOLS
    return response


def input_items(params: r.CreateParams) -> list[r.Item]:
    """The conversation of a CreateParams as items; plain-text input is one user message."""
    if params.WhichOneof("input") == "input_text":
        return [r.Item(message=r.Message(role=r.ROLE_USER, text=params.input_text))]
    return list(params.input_items.items)


def item_body(item: r.Item) -> Any:
    """What an item holds: its message, reasoning, function call or function call output."""
    kind = item.WhichOneof("item")
    if kind is None:
        raise ValueError("the item has nothing set")
    return getattr(item, kind)


def _from_assistant(item: r.Item) -> bool:
    kind = item.WhichOneof("item")
    return kind in ("reasoning", "function_call") or (kind == "message" and item.message.role == r.ROLE_ASSISTANT)


def turns(items: Sequence[r.Item]) -> Iterator[list[r.Item] | r.Item]:
    """A conversation as a chat template sees it: each assistant turn (consecutive
    reasoning, function calls and assistant messages) as one list, any other item alone."""
    turn: list[r.Item] = []
    for item in items:
        if _from_assistant(item):
            turn.append(item)
            continue
        if turn:
            yield turn
            turn = []
        yield item
    if turn:
        yield turn


def message_text(message: r.Message) -> str:
    """The text of a message: its string content, or its text parts joined."""
    if message.WhichOneof("content") == "text":
        return message.text
    return parts_text(message.parts.items)


def parts_text(parts: Iterable[r.ContentPart]) -> str:
    """The text parts of a content list, joined (images and files left out)."""
    texts = []
    for part in parts:
        kind = part.WhichOneof("part")
        if kind == "input_text":
            texts.append(part.input_text.text)
        elif kind == "output_text":
            texts.append(part.output_text.text)
    return "".join(texts)


def input_text_part(text: str) -> r.ContentPart:
    return r.ContentPart(input_text=r.InputText(text=text))


def final_text(response: r.Response) -> str:
    """Text of the last assistant message of a response ("" when there is none)."""
    for item in reversed(response.output):
        if item.WhichOneof("item") == "message" and item.message.role == r.ROLE_ASSISTANT:
            return message_text(item.message)
    return ""


def function_calls(response: r.Response) -> list[r.FunctionCall]:
    """Every function call of a response, in order."""
    return [i.function_call for i in response.output if i.WhichOneof("item") == "function_call"]


def function_outputs(response: r.Response) -> dict[str, str]:
    """Output of every function call of a response, by call_id (the text parts of one given as parts)."""
    outputs = (i.function_call_output for i in response.output if i.WhichOneof("item") == "function_call_output")
    return {o.call_id: o.output or parts_text(o.output_parts.items) for o in outputs}


#: How an agent tells the model that its tool call failed: the output starts with this.
TOOL_ERROR_PREFIX = "Error: "


def tool_error_output(message: str) -> str:
    """The output a model sees for a failed tool call."""
    return TOOL_ERROR_PREFIX + message


def assistant_message(text: str, status: r.ItemStatus.ValueType = r.ITEM_STATUS_COMPLETED) -> r.Item:
    """An assistant message item with one output_text part."""
    return r.Item(
        message=r.Message(
            id=new_id("msg"),
            role=r.ROLE_ASSISTANT,
            parts=r.ContentList(items=[r.ContentPart(output_text=r.OutputText(text=text, annotations_json="[]"))]),
            status=status,
        )
    )


def user_message(text: str) -> r.Item:
    """A user message item with string content."""
    return r.Item(message=r.Message(role=r.ROLE_USER, text=text))
