"""JSONL rows in NeMo Gym's format <-> gym.v1 messages, losing nothing.

A task row is `{"responses_create_params": {...}, <task fields>...}`; a
rollout row is the task row plus `response`, `reward` and the verifier's
extra fields. The JSON side is the OpenAI Responses JSON.

What is read goes back out unchanged (responses.proto says how the messages
hold it): keys the typed fields do not hold are kept in each object's
`extra_json`, in their order, and written back after the typed ones; items,
content parts and tools of types the schema does not model travel whole;
free-form JSON (tool schemas, task fields, verifier fields) travels as JSON
text, so key order, `1.0` and large integers survive. The dumper writes what
the message holds and invents nothing.

Loading is liberal about what it does not know and strict about what it
does: a known key with a value of the wrong type raises `RowError` naming the
field by its dotted path (`responses_create_params.input[2].role`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gym_grpc import images
from gym_grpc.data.field_specs import (
    Spec,
    as_list,
    as_object,
    as_str,
    field,
    read_into,
    read_union,
    reader,
    write_from,
    write_union,
    writer,
)

# RowError and the JSON-text helpers live in json_text.py; callers know them as rows'.
from gym_grpc.data.json_text import JSON, loads, type_name
from gym_grpc.data.json_text import RowError as RowError
from gym_grpc.data.json_text import dumps as dumps
from gym_grpc.data.json_text import json_field as json_field
from gym_grpc.data.json_text import json_text as json_text
from gym_grpc.data.json_text import set_json_field as set_json_field
from gym_grpc.data.json_text import struct_to_dict as struct_to_dict
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

PARAMS_KEY = "responses_create_params"


def task_data(task: task_pb2.Task) -> JSON:
    """A task's own fields (everything in its row but `responses_create_params`)."""
    return json_field(task, "data")


# --- enums: JSON string <-> proto value -------------------------------------

ROLES = {
    "user": r.ROLE_USER,
    "assistant": r.ROLE_ASSISTANT,
    "system": r.ROLE_SYSTEM,
    "developer": r.ROLE_DEVELOPER,
}
ITEM_STATUSES = {
    "in_progress": r.ITEM_STATUS_IN_PROGRESS,
    "completed": r.ITEM_STATUS_COMPLETED,
    "incomplete": r.ITEM_STATUS_INCOMPLETE,
}
RESPONSE_STATUSES = {
    "completed": r.RESPONSE_STATUS_COMPLETED,
    "incomplete": r.RESPONSE_STATUS_INCOMPLETE,
    "failed": r.RESPONSE_STATUS_FAILED,
    "in_progress": r.RESPONSE_STATUS_IN_PROGRESS,
    "cancelled": r.RESPONSE_STATUS_CANCELLED,
    "queued": r.RESPONSE_STATUS_QUEUED,
}
INCOMPLETE_REASONS = {
    "max_output_tokens": r.INCOMPLETE_REASON_MAX_OUTPUT_TOKENS,
    "content_filter": r.INCOMPLETE_REASON_CONTENT_FILTER,
}
TOOL_CHOICE_MODES = {
    "none": r.TOOL_CHOICE_MODE_NONE,
    "auto": r.TOOL_CHOICE_MODE_AUTO,
    "required": r.TOOL_CHOICE_MODE_REQUIRED,
}
TEXT_FORMAT_TYPES = {
    "text": r.TEXT_FORMAT_TYPE_TEXT,
    "json_schema": r.TEXT_FORMAT_TYPE_JSON_SCHEMA,
    "json_object": r.TEXT_FORMAT_TYPE_JSON_OBJECT,
}


def _names(table: Mapping[str, int]) -> dict[int, str]:
    return {v: k for k, v in table.items()}


ROLE_NAMES = _names(ROLES)
ITEM_STATUS_NAMES = _names(ITEM_STATUSES)
RESPONSE_STATUS_NAMES = _names(RESPONSE_STATUSES)
INCOMPLETE_REASON_NAMES = _names(INCOMPLETE_REASONS)
TOOL_CHOICE_MODE_NAMES = _names(TOOL_CHOICE_MODES)
TEXT_FORMAT_TYPE_NAMES = _names(TEXT_FORMAT_TYPES)

# --- content parts -----------------------------------------------------------


_TOP_LOGPROB = [field("token", required=True), field("logprob", "number"), field("bytes", ("ids",))]
_TOKEN_LOGPROB = [
    *_TOP_LOGPROB,
    field("top_logprobs", ("list", reader(r.TopLogprob, _TOP_LOGPROB), writer(_TOP_LOGPROB))),
]
_PART_SPECS: dict[str, list[Spec]] = {
    "input_text": [field("text", required=True)],
    "output_text": [
        field("text", required=True),
        field("annotations", "json", "annotations_json"),
        field("logprobs", ("list", reader(r.TokenLogprob, _TOKEN_LOGPROB), writer(_TOKEN_LOGPROB))),
    ],
    "refusal": [field("refusal", required=True)],
    "input_image": [field("image_url"), field("file_id"), field("detail")],
    "input_file": [field("file_id"), field("file_url"), field("file_data"), field("filename")],
}


def _content_part(value: Any, path: str, exact: bool = True) -> r.ContentPart:
    part = read_union(r.ContentPart(), _PART_SPECS, value, path, exact)
    if part.WhichOneof("part") == "input_image":
        images.from_url(part.input_image)
    return part


def _content_part_to_json(part: r.ContentPart) -> JSON:
    out = write_union(part, "part", _PART_SPECS)
    image = part.input_image
    if part.WhichOneof("part") == "input_image" and (image.data or image.sha256):
        out = {"type": "input_image", "image_url": images.to_url(image), **out}
    text = part.output_text
    if part.WhichOneof("part") == "output_text" and not text.annotations_json and text.annotations:
        out["annotations"] = [struct_to_dict(a) for a in text.annotations]  # the deprecated Struct list
    return out


def _content_list(value: Any, path: str) -> r.ContentList:
    values = as_list(value, path)
    return r.ContentList(items=[_content_part(p, f"{path}[{i}]") for i, p in enumerate(values)])


# --- items --------------------------------------------------------------------

_SPAN = [
    field("version", "count", required=True),
    field("start", "count", required=True),
    field("end", "count", required=True),
]
_TOKENS = [
    field("prompt_token_ids", ("ids",)),
    field("generation_token_ids", ("ids",)),
    field("generation_log_probs", ("floats",)),
    field("policy_version", "count"),
    field("policy_version_spans", ("list", reader(r.PolicyVersionSpan, _SPAN), writer(_SPAN))),
]
_STATUS = field("status", ("enum", ITEM_STATUSES))


def _typed_parts(cls: type, part_type: str) -> tuple[Callable, Callable]:
    """Readers for reasoning summary/content parts, which must have `part_type` as their type."""
    specs = [field("text", required=True)]

    def read(value: Any, path: str, exact: bool = True) -> Any:
        obj = as_object(value, path)
        if obj.get("type", part_type) != part_type:
            raise RowError(f"{path}.type", f"expected {part_type!r}, got {obj['type']!r}")
        message = cls()
        read_into(message, obj, path, specs, exact, skip=("type",) if "type" in obj else ())
        return message

    return read, lambda message: write_from(message, specs, {"type": part_type})


_MESSAGE = [field("id"), field("role", ("enum", ROLES, "strict"), required=True), _STATUS, *_TOKENS]
_REASONING = [
    field("id"),
    field("summary", ("list", *_typed_parts(r.SummaryText, "summary_text"))),
    field("content", ("list", *_typed_parts(r.ReasoningText, "reasoning_text"))),
    field("encrypted_content"),
    _STATUS,
    *_TOKENS,
]
_FUNCTION_CALL = [
    field("id"),
    field("call_id", required=True),
    field("name", required=True),
    field("arguments", required=True),
    _STATUS,
    *_TOKENS,
]
_FUNCTION_CALL_OUTPUT = [field("id"), field("call_id", required=True), _STATUS]
_CUSTOM_TOOL_CALL = [
    field("id"),
    field("call_id", required=True),
    field("name", required=True),
    field("input", required=True),
    _STATUS,
    *_TOKENS,
]
_CUSTOM_TOOL_CALL_OUTPUT = [field("id"), field("call_id", required=True)]
_MCP_CALL = [
    field("id"),
    field("server_label", required=True),
    field("name", required=True),
    field("arguments", required=True),
    field("output"),
    field("error"),
    _STATUS,
]
_ITEM_SPECS: dict[str, list[Spec]] = {
    "message": _MESSAGE,
    "reasoning": _REASONING,
    "function_call": _FUNCTION_CALL,
    "function_call_output": _FUNCTION_CALL_OUTPUT,
    "custom_tool_call": _CUSTOM_TOOL_CALL,
    "custom_tool_call_output": _CUSTOM_TOOL_CALL_OUTPUT,
    "mcp_call": _MCP_CALL,
}
_TOKEN_KEYS = tuple(spec[0] for spec in _TOKENS)
_ITEM_SPECS_NO_TOKENS = {kind: [s for s in specs if s[0] not in _TOKEN_KEYS] for kind, specs in _ITEM_SPECS.items()}


def item_from_json(value: Any, path: str = "item") -> r.Item:
    """One input or output item. A dict without "type" but with "role" is a message
    (and is written back with its "type"); an item of a type the schema does not
    model is kept whole as an opaque item."""
    obj = as_object(value, path)
    kind = obj.get("type", "message" if "role" in obj else None)
    item = r.Item()
    if kind not in _ITEM_SPECS:
        if not isinstance(kind, str):
            raise RowError(f"{path}.type", f"expected the item's type, got {kind!r}")
        item.opaque.type, item.opaque.json = kind, dumps(obj)
        return item
    inner = getattr(item, kind)
    inner.SetInParent()
    skip: tuple[str, ...] = ("type",)
    if kind == "message":
        content = obj.get("content")
        if isinstance(content, str):
            inner.text = content
        elif isinstance(content, list):
            inner.parts.CopyFrom(_content_list(content, f"{path}.content"))
        else:
            raise RowError(f"{path}.content", f"expected a string or a list, got {type_name(content)}")
        skip += ("content",)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = obj.get("output")
        if isinstance(output, str):
            inner.output = output
        elif isinstance(output, list):
            inner.output_parts.CopyFrom(_content_list(output, f"{path}.output"))
        else:
            raise RowError(f"{path}.output", f"expected a string or a list, got {type_name(output)}")
        skip += ("output",)
    read_into(inner, obj, path, _ITEM_SPECS[kind], True, skip)
    if len(getattr(inner, "generation_log_probs", ())) not in (0, len(getattr(inner, "generation_token_ids", ()))):
        raise RowError(
            f"{path}.generation_log_probs",
            f"has {len(inner.generation_log_probs)} values for {len(inner.generation_token_ids)} generation_token_ids",
        )
    return item


def item_to_json(item: r.Item, training: bool = True) -> JSON:
    """One item as Responses JSON (always with its "type").

    `training=False` leaves out the token fields, which engines do not accept."""
    kind = item.WhichOneof("item")
    if kind == "opaque":
        return loads(item.opaque.json, "opaque.json")
    if kind is None:
        raise ValueError("item with nothing set")
    inner = getattr(item, kind)
    out: JSON = {"type": kind}
    if kind == "message":
        if inner.WhichOneof("content") == "text":
            out["content"] = inner.text
        else:
            out["content"] = [_content_part_to_json(p) for p in inner.parts.items]
    elif kind in ("function_call_output", "custom_tool_call_output"):
        if inner.HasField("output_parts"):
            out["output"] = [_content_part_to_json(p) for p in inner.output_parts.items]
        else:
            out["output"] = inner.output
    out = write_from(inner, (_ITEM_SPECS if training else _ITEM_SPECS_NO_TOKENS)[kind], out)
    if kind == "message":
        out.setdefault("role", "user")  # a message built in code without a role
    return out


def _output_item(value: Any, path: str, exact: bool = True) -> r.Item:
    """An output item; one that is not even an object (engines have written lists) is kept as opaque."""
    if not isinstance(value, dict):
        return r.Item(opaque=r.OpaqueItem(json=dumps(value)))
    return item_from_json(value, path)


# --- tools and the request parameters -----------------------------------------

_FUNCTION_TOOL = [
    field("name", required=True),
    field("description"),
    field("parameters", "json", "parameters_json"),
    field("strict", "bool"),
]
_CUSTOM_TOOL = [field("name", required=True), field("description"), field("format", "json", "format_json")]
_MCP_TOOL = [field("server_label", required=True), field("server_url"), field("server_description")]
_TOOL_SPECS = {"function": _FUNCTION_TOOL, "custom": _CUSTOM_TOOL, "mcp": _MCP_TOOL}


def _tool(value: Any, path: str, exact: bool = True) -> r.Tool:
    return read_union(r.Tool(), _TOOL_SPECS, value, path, exact)


def _tool_to_json(tool: r.Tool) -> JSON:
    out = write_union(tool, "tool", _TOOL_SPECS)
    fn = tool.function
    if tool.WhichOneof("tool") == "function" and not fn.parameters_json and fn.HasField("parameters"):
        out["parameters"] = struct_to_dict(fn.parameters)  # the deprecated Struct
    return out


def tool_parameters(tool: r.FunctionTool) -> JSON | None:
    """A function tool's parameter schema as a dict (key order kept), None when it has none."""
    if tool.parameters_json:
        return loads(tool.parameters_json, "parameters_json")
    if tool.HasField("parameters"):
        return struct_to_dict(tool.parameters)
    return None


def format_schema(fmt: r.TextFormat) -> JSON | None:
    """A text format's JSON schema as a dict (key order kept), None when it has none."""
    if fmt.schema_json:
        return loads(fmt.schema_json, "schema_json")
    return struct_to_dict(fmt.schema) if fmt.HasField("schema") else None


def params_extra(params: r.CreateParams) -> JSON:
    """The create parameters CreateParams does not model (`seed`, `store`, ...), nulls included."""
    if params.extra_json:
        return loads(params.extra_json, "extra_json")
    return struct_to_dict(params.extra)


def _tool_choice(value: Any, path: str, exact: bool = True) -> r.ToolChoice:
    if isinstance(value, str):
        if value in TOOL_CHOICE_MODES:
            return r.ToolChoice(mode=TOOL_CHOICE_MODES[value])
        return r.ToolChoice(json=dumps(value))
    obj = as_object(value, path)
    kind = obj.get("type")
    if kind == "function" and set(obj) == {"type", "name"} and isinstance(obj["name"], str):
        return r.ToolChoice(function_name=obj["name"])
    if kind == "custom" and set(obj) == {"type", "name"} and isinstance(obj["name"], str):
        return r.ToolChoice(custom_name=obj["name"])
    return r.ToolChoice(json=dumps(obj))


def _tool_choice_to_json(choice: r.ToolChoice) -> Any:
    kind = choice.WhichOneof("choice")
    if kind == "function_name":
        return {"type": "function", "name": choice.function_name}
    if kind == "custom_name":
        return {"type": "custom", "name": choice.custom_name}
    if kind == "json":
        return loads(choice.json, "tool_choice.json")
    return TOOL_CHOICE_MODE_NAMES.get(choice.mode, "auto")


_REASONING_CONFIG = [field("effort"), field("summary"), field("generate_summary")]
_TEXT_FORMAT = [
    field("type", ("enum", TEXT_FORMAT_TYPES)),
    field("name"),
    field("description"),
    field("schema", "json", "schema_json"),
    field("strict", "bool"),
]


def _text_format_to_json(fmt: r.TextFormat) -> JSON:
    out = write_from(fmt, _TEXT_FORMAT, {})
    if not fmt.schema_json and fmt.HasField("schema"):  # deprecated Struct
        out["schema"] = struct_to_dict(fmt.schema)
    return out


_TEXT_CONFIG = [
    field("format", ("msg", reader(r.TextFormat, _TEXT_FORMAT), _text_format_to_json)),
    field("verbosity"),
]


def _metadata(value: Any, path: str) -> dict[str, str]:
    obj = as_object(value, path)
    return {k: as_str(v, f"{path}.{k}") for k, v in obj.items()}


# The request parameters that a CreateParams holds and a Response echoes (and `metadata`).
_ECHOED = [
    field("instructions"),
    field("tools", ("list", _tool, _tool_to_json)),
    field("tool_choice", ("msg", _tool_choice, _tool_choice_to_json)),
    field("temperature", "number"),
    field("top_p", "number"),
    field("max_output_tokens", "count"),
    field("parallel_tool_calls", "bool"),
    field("reasoning", ("msg", reader(r.ReasoningConfig, _REASONING_CONFIG), writer(_REASONING_CONFIG))),
    field("text", ("msg", reader(r.TextConfig, _TEXT_CONFIG), writer(_TEXT_CONFIG))),
]
ECHOED_KEYS = (*(spec[0] for spec in _ECHOED), "metadata")


_PARAMS = [*_ECHOED, field("model")]


def _read_metadata(message: r.CreateParams | r.Response, obj: JSON, path: str) -> tuple[str, ...]:
    """`metadata` when every value is a string (the API's rule); otherwise it stays in extra_json."""
    value = obj.get("metadata")
    if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
        message.metadata.update(value)
        return ("metadata",)
    return ()


def params_from_json(value: Any, path: str = PARAMS_KEY) -> r.CreateParams:
    """A `responses_create_params` object."""
    obj = as_object(value, path)
    params = r.CreateParams()
    content = obj.get("input")
    if isinstance(content, str):
        params.input_text = content
    elif isinstance(content, list):
        params.input_items.SetInParent()
        params.input_items.items.extend(item_from_json(item, f"{path}.input[{i}]") for i, item in enumerate(content))
    else:
        raise RowError(f"{path}.input", f"expected a string or a list of items, got {type_name(content)}")
    skip = ("input", *_read_metadata(params, obj, path))
    read_into(params, obj, path, _PARAMS, False, skip)  # 1 and 1.0 are the same temperature to an engine
    return params


def params_to_json(params: r.CreateParams, training: bool = True) -> JSON:
    """A CreateParams as a `responses_create_params` object (see item_to_json for `training`)."""
    out: JSON = {}
    if params.WhichOneof("input") == "input_text":
        out["input"] = params.input_text
    else:
        out["input"] = [item_to_json(i, training) for i in params.input_items.items]
    out = write_from(params, _PARAMS, out)
    if params.metadata:
        out["metadata"] = dict(params.metadata)
    if not params.extra_json and params.extra.fields:  # deprecated Struct
        out.update(struct_to_dict(params.extra))
    return out


def agent_name(row: JSON, default: str | None, hint: str = "") -> str:
    """The agent a row names in `agent_ref`, else `default`; RowError when neither names
    one (`hint` says how to give one) or when `agent_ref` is malformed."""
    ref = row.get("agent_ref")
    if ref is None:
        if default:
            return default
        raise RowError("agent_ref.name", f"the row names no agent{hint}")
    name = ref.get("name") if isinstance(ref, dict) else None
    if not isinstance(name, str) or not name:
        raise RowError("agent_ref.name", f"expected the name of an agent, got {ref!r}")
    return name


def task_from_row(row: Any) -> task_pb2.Task:
    """A task row: `responses_create_params` plus any other fields (kept, as JSON text, in `data_json`)."""
    row = as_object(row, "row")
    if PARAMS_KEY not in row:
        raise RowError(PARAMS_KEY, "is required")
    task = task_pb2.Task(responses_create_params=params_from_json(row[PARAMS_KEY]))
    data = {k: v for k, v in row.items() if k != PARAMS_KEY}
    if data:
        try:
            task.data_json = dumps(data)
        except ValueError as e:  # NaN or Infinity
            raise RowError("row", f"not JSON data: {e}") from None
    return task


def task_to_row(task: task_pb2.Task) -> JSON:
    """A Task as a task row."""
    return {PARAMS_KEY: params_to_json(task.responses_create_params), **task_data(task)}


# --- the response -------------------------------------------------------------

_INPUT_DETAILS = [field("cached_tokens", "count", required=True), field("cache_write_tokens", "count", required=True)]
_OUTPUT_DETAILS = [field("reasoning_tokens", "count", required=True)]
_USAGE = [
    field("input_tokens", "count", required=True),
    field(
        "input_tokens_details",
        ("msg", reader(r.InputTokensDetails, _INPUT_DETAILS), writer(_INPUT_DETAILS), "lenient"),
    ),
    field("output_tokens", "count", required=True),
    field(
        "output_tokens_details",
        ("msg", reader(r.OutputTokensDetails, _OUTPUT_DETAILS), writer(_OUTPUT_DETAILS), "lenient"),
    ),
    field("total_tokens", "count", required=True),
]
_INCOMPLETE = [field("reason", ("enum", INCOMPLETE_REASONS))]
_ERROR = [field("code"), field("message")]
_RESPONSE = [
    field("id"),
    field("created_at", "number"),
    field("model"),
    field("status", ("enum", RESPONSE_STATUSES)),
    field("output", ("list", _output_item, item_to_json)),
    field("usage", ("msg", reader(r.Usage, _USAGE), writer(_USAGE), "lenient")),
    field("incomplete_details", ("msg", reader(r.IncompleteDetails, _INCOMPLETE), writer(_INCOMPLETE))),
    field("error", ("msg", reader(r.ResponseError, _ERROR), writer(_ERROR))),
    *_ECHOED,
]


def response_from_json(value: Any, path: str = "response") -> r.Response:
    """A Responses API response object, every key kept (see the module docstring)."""
    obj = as_object(value, path)
    response = r.Response()
    read_into(response, obj, path, _RESPONSE, True, _read_metadata(response, obj, path))
    return response


def response_to_json(response: r.Response) -> JSON:
    """A Response as a Responses API response object: what it holds, in the API's key order."""
    out = write_from(response, _RESPONSE, {})
    if "output" not in out:
        out["output"] = []
    if response.metadata:
        out["metadata"] = dict(response.metadata)
    return out
