"""Checks of request messages at the edge of every server.

Protobuf guarantees types, not sense: an item with nothing set, a message
without a role, a function call without a name or log-probs that do not
match their token ids all parse. Each check raises InvalidArgument naming the
field as a path (`task.responses_create_params.input_items.items[2].message.role`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from gym_grpc import errors
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2


def _fail(field: str, message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"{field}: {message}", field=field)


_NO_ITEM = "the item has nothing set"


def _problem(item: r.Item) -> tuple[str, str] | None:
    """What is wrong with an item: (its field, relative to the item, and a message), or None.

    Runs for every item of every request, so paths are only built for a failure."""
    kind = item.WhichOneof("item")
    if kind is None:
        return "", _NO_ITEM
    inner = getattr(item, kind)
    if kind == "message":
        if inner.role == r.ROLE_UNSPECIFIED:
            return ".message.role", "is required"
        for i, part in enumerate(inner.parts.items):
            if part.WhichOneof("part") is None:
                return f".message.parts.items[{i}]", "the part has nothing set"
    elif kind in ("function_call_output", "custom_tool_call_output"):
        return (f".{kind}.call_id", "is required") if not inner.call_id else None
    elif kind in ("function_call", "custom_tool_call", "mcp_call") and not inner.name:
        return f".{kind}.name", "is required"
    logprobs = getattr(inner, "generation_log_probs", ())  # on the items a model generates
    if logprobs:
        if len(logprobs) != len(inner.generation_token_ids):
            return (
                f".{kind}.generation_log_probs",
                f"{len(logprobs)} values for {len(inner.generation_token_ids)} generation_token_ids",
            )
        # All finite and <= 0, in C: a NaN or an infinity makes the sum non-finite.
        if max(logprobs) > 0 or not math.isfinite(sum(logprobs)):
            return f".{kind}.generation_log_probs", "log-probabilities must be finite and at most 0"
    return None


def check_items(items: Iterable[r.Item], path: str) -> None:
    for i, item in enumerate(items):
        problem = _problem(item)
        if problem is not None:
            raise _fail(f"{path}[{i}]{problem[0]}", problem[1])


def check_params(params: r.CreateParams, path: str) -> None:
    """A CreateParams that a model can be called with."""
    which = params.WhichOneof("input")
    if which is None:
        raise _fail(f"{path}.input", "is required (input_text or input_items)")
    if which == "input_items":
        check_items(params.input_items.items, f"{path}.input_items.items")
    for i, tool in enumerate(params.tools):
        kind = tool.WhichOneof("tool")
        if kind is None:
            raise _fail(f"{path}.tools[{i}]", "the tool has nothing set")
        if kind in ("function", "custom") and not getattr(tool, kind).name:
            raise _fail(f"{path}.tools[{i}].{kind}.name", "is required")
    ranges: tuple[tuple[Literal["temperature", "top_p"], float], ...] = (("temperature", math.inf), ("top_p", 1.0))
    for key, high in ranges:
        if params.HasField(key):
            value = getattr(params, key)
            if math.isnan(value) or not 0.0 <= value <= high:
                raise _fail(f"{path}.{key}", f"must be between 0 and {high:g}, got {value!r}")


def check_task(task: task_pb2.Task, path: str) -> None:
    check_params(task.responses_create_params, f"{path}.responses_create_params")


def check_response(response: r.Response, path: str) -> None:
    check_items(response.output, f"{path}.output")
