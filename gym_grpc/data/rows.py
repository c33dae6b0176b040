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

import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.message import Message as ProtoMessage

from gym_grpc import errors
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

JSON = dict[str, Any]

PARAMS_KEY = "responses_create_params"


class RowError(errors.InvalidArgument, ValueError):
    """A JSON value that does not fit the schema; `field` is its dotted path.

    In a server it is an INVALID_ARGUMENT (JSON text in a request's `*_json`
    field that does not parse, for example)."""

    reason = errors.Reason.ROW_INVALID

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", field=field)
        self.detail = message


# --- JSON text ----------------------------------------------------------------


def dumps(value: Any) -> str:
    """Compact JSON text, as the `*_json` fields hold it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _loads(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise RowError(where, f"not JSON text: {e}") from None


def value_to_python(value: struct_pb2.Value) -> Any:
    """A Struct value as plain Python; integral numbers become ints (the deprecated Struct fields)."""
    kind = value.WhichOneof("kind")
    if kind == "number_value":
        n = value.number_value
        return int(n) if n.is_integer() and abs(n) < 2**53 else n
    if kind == "string_value":
        return value.string_value
    if kind == "bool_value":
        return value.bool_value
    if kind == "struct_value":
        return struct_to_dict(value.struct_value)
    if kind == "list_value":
        return [value_to_python(v) for v in value.list_value.values]
    return None


def struct_to_dict(struct: struct_pb2.Struct) -> JSON:
    """A Struct as a plain dict (see value_to_python)."""
    return {k: value_to_python(v) for k, v in struct.fields.items()}


def json_field(message: ProtoMessage, name: str) -> JSON:
    """The JSON object in `message.<name>_json`, or in the deprecated Struct `message.<name>` when
    the text is empty (a peer built before the `_json` fields); {} when neither is set.

    For Task.data, Rollout.verifier_fields and the verifiers' `fields`."""
    text = getattr(message, f"{name}_json")
    if text:
        value = _loads(text, f"{name}_json")
        if not isinstance(value, dict):
            raise RowError(f"{name}_json", f"expected a JSON object, got {_type_name(value)}")
        return value
    return struct_to_dict(getattr(message, name))


def json_text(message: ProtoMessage, name: str) -> str:
    """`message.<name>_json` as it is, or the deprecated Struct `message.<name>` as JSON text
    when the text is empty: for passing a JSON field on without parsing it."""
    text = getattr(message, f"{name}_json")
    if text or not getattr(message, name).fields:
        return text
    return dumps(struct_to_dict(getattr(message, name)))


def set_json_field(message: ProtoMessage, name: str, value: Mapping[str, Any]) -> None:
    """Set `message.<name>_json` to the JSON object `value` (see json_field); TypeError/ValueError if it is not JSON."""
    setattr(message, f"{name}_json", dumps(dict(value)) if value else "")


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
#: Each table's names by value, for the writer (built once, not per value written).
_NAMES_OF = {
    id(table): names
    for table, names in (
        (ROLES, ROLE_NAMES),
        (ITEM_STATUSES, ITEM_STATUS_NAMES),
        (RESPONSE_STATUSES, RESPONSE_STATUS_NAMES),
        (INCOMPLETE_REASONS, INCOMPLETE_REASON_NAMES),
        (TEXT_FORMAT_TYPES, TEXT_FORMAT_TYPE_NAMES),
    )
}


# --- checked access to JSON values -----------------------------------------


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _obj(value: Any, path: str) -> JSON:
    if not isinstance(value, dict):
        raise RowError(path, f"expected an object, got {_type_name(value)}")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise RowError(path, f"expected a list, got {_type_name(value)}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise RowError(path, f"expected a string, got {_type_name(value)}")
    return value


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise RowError(path, f"expected true or false, got {_type_name(value)}")
    return value


def _number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowError(path, f"expected a number, got {value!r}")
    return float(value)


def _count(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise RowError(path, f"expected a non-negative integer, got {value!r}")
    return value


# --- the generic reader and writer --------------------------------------------
#
# A field spec names a JSON key, the proto field that holds it and its kind:
#   "str" "bool" "count"      scalars
#   "number"                  a double; a JSON integer stays in extra_json when `exact` (its form would change)
#   "json"                    any JSON value, as text in the field (`<attr>` ends in _json)
#   ("enum", table)           an enum; a value the table does not know stays in extra_json, or
#                             with a 3rd member "strict" is an error (a message's role)
#   ("msg", read, write)      a nested object; with a 4th member "lenient", one that does not
#                             fit (a usage in another API's form, a null count) stays in extra_json
#   ("list", read, write)     a list of nested values; an empty list stays in extra_json
#   ("ids",) ("floats",)      lists of token ids / log-probs
# A key whose value is null stays in extra_json. So does a scalar at its proto
# default when the field cannot tell "absent" from "default" (no presence) and
# the key is not `required`: writing it back from the typed field would drop it.

Spec = tuple[str, str, Any, bool]  # (JSON key, proto field, kind, required)
_SCALARS: dict[str, Callable[[Any, str], Any]] = {"str": _str, "bool": _bool, "count": _count}


def _f(key: str, kind: Any = "str", attr: str | None = None, required: bool = False) -> Spec:
    return (key, attr or key, kind, required)


def _read_into(message: ProtoMessage, obj: JSON, path: str, specs: list[Spec], exact: bool, skip: tuple = ()) -> None:
    """Fill `message` from `obj` by `specs`; what they do not take goes to message.extra_json."""
    fields = message.DESCRIPTOR.fields_by_name
    taken = set(skip)
    for key, attr, kind, required in specs:
        value = obj.get(key)
        where = f"{path}.{key}"
        if value is None:
            if required:
                raise RowError(where, "is required" if key not in obj else "expected a value, got null")
            continue
        presence = fields[attr].has_presence if attr in fields else False
        tag = kind if isinstance(kind, str) else kind[0]
        if tag in _SCALARS:
            if not _SCALARS[tag](value, where) and not (presence or required):
                continue  # "", false or 0, which the field would give back as absent
            setattr(message, attr, value)
        elif tag == "number":
            number = _number(value, where)
            if (exact and isinstance(value, int)) or (number == 0 and not (presence or required)):
                continue
            setattr(message, attr, number)
        elif tag == "json":
            try:
                setattr(message, attr, dumps(value))
            except ValueError as e:  # NaN or Infinity
                raise RowError(where, f"not JSON data: {e}") from None
        elif tag == "enum":
            if not isinstance(value, str) or value not in kind[1]:
                if len(kind) > 2:  # ("enum", table, "strict")
                    raise RowError(where, f"expected one of {', '.join(kind[1])}, got {value!r}")
                continue
            setattr(message, attr, kind[1][value])
        elif tag == "msg":
            try:
                getattr(message, attr).CopyFrom(kind[1](value, where, exact))
            except RowError:
                if len(kind) < 4:  # not ("msg", read, write, "lenient")
                    raise
                continue
        elif tag == "list":
            values = _list(value, where)
            if not values:
                continue
            getattr(message, attr).extend(kind[1](v, f"{where}[{i}]", exact) for i, v in enumerate(values))
        elif tag in ("ids", "floats"):
            values = _list(value, where)
            if not values:
                continue
            check = _count if tag == "ids" else _number
            getattr(message, attr).extend(check(v, f"{where}[{i}]") for i, v in enumerate(values))
        taken.add(key)
    extra = {k: v for k, v in obj.items() if k not in taken}
    if extra:
        message.extra_json = dumps(extra)  # type: ignore[attr-defined]


#: What `_write_from` reads of each spec, per (message type, spec list): looked up once, not per row.
_Plan = tuple[tuple[str, str, str, Any, bool, bool], ...]
_PLANS: dict[tuple[Any, int], tuple[list[Spec], _Plan]] = {}


def _plan(message: ProtoMessage, specs: list[Spec]) -> _Plan:
    """The plan of `specs` for `message`'s type. Spec lists are module constants; the
    list is kept with its plan, so that its id cannot be another list's later."""
    descriptor = message.DESCRIPTOR
    cached = _PLANS.get((descriptor, id(specs)))
    if cached is not None and cached[0] is specs:
        return cached[1]
    fields = descriptor.fields_by_name
    plan = tuple(
        (key, attr, kind if isinstance(kind, str) else kind[0], kind, required, fields[attr].has_presence)
        for key, attr, kind, required in specs
    )
    if len(_PLANS) < 1024:  # the module's spec lists are far fewer; a list built per call is not kept
        _PLANS[descriptor, id(specs)] = (specs, plan)
    return plan


def _write_from(message: ProtoMessage, specs: list[Spec], out: JSON) -> JSON:
    """`out` plus the typed fields of `message` by `specs`, then its extra_json."""
    for key, attr, tag, kind, required, presence in _plan(message, specs):
        value = getattr(message, attr)
        if tag in ("list", "ids", "floats"):
            if value:
                out[key] = [kind[2](v) for v in value] if tag == "list" else list(value)
            continue
        if presence:
            if not message.HasField(attr):
                continue
        elif not (value or required):
            continue
        if tag == "json":
            out[key] = _loads(value, attr)
        elif tag == "enum":
            names = _NAMES_OF[id(kind[1])]
            if value in names:
                out[key] = names[value]
        elif tag == "msg":
            out[key] = kind[2](value)
        else:
            out[key] = value
    return _with_extra(out, message.extra_json)  # type: ignore[attr-defined]


def _with_extra(out: JSON, extra_json: str) -> JSON:
    if extra_json:
        for key, value in _loads(extra_json, "extra_json").items():
            out.setdefault(key, value)
    return out


def _reader(cls: type, specs: list[Spec]) -> Callable[[Any, str, bool], Any]:
    def read(value: Any, path: str, exact: bool = True) -> Any:
        message = cls()
        _read_into(message, _obj(value, path), path, specs, exact)
        return message

    return read


def _writer(specs: list[Spec]) -> Callable[[Any], JSON]:
    return lambda message: _write_from(message, specs, {})


# --- content parts -----------------------------------------------------------


_TOP_LOGPROB = [_f("token", required=True), _f("logprob", "number"), _f("bytes", ("ids",))]
_TOKEN_LOGPROB = [
    *_TOP_LOGPROB,
    _f("top_logprobs", ("list", _reader(r.TopLogprob, _TOP_LOGPROB), _writer(_TOP_LOGPROB))),
]
_PART_SPECS: dict[str, list[Spec]] = {
    "input_text": [_f("text", required=True)],
    "output_text": [
        _f("text", required=True),
        _f("annotations", "json", "annotations_json"),
        _f("logprobs", ("list", _reader(r.TokenLogprob, _TOKEN_LOGPROB), _writer(_TOKEN_LOGPROB))),
    ],
    "refusal": [_f("refusal", required=True)],
    "input_image": [_f("image_url"), _f("file_id"), _f("detail")],
    "input_file": [_f("file_id"), _f("file_url"), _f("file_data"), _f("filename")],
}


def _read_union(container: Any, specs: dict[str, list[Spec]], value: Any, path: str, exact: bool) -> Any:
    """A tagged union (a content part, a tool): the oneof member its "type" names (members are
    named as the JSON types), or, for a type the schema does not model, the whole object as opaque."""
    obj = _obj(value, path)
    kind = obj.get("type")
    if kind not in specs:
        container.opaque.type = kind if isinstance(kind, str) else ""
        container.opaque.json = dumps(obj)
        return container
    inner = getattr(container, kind)
    inner.SetInParent()
    _read_into(inner, obj, path, specs[kind], exact, skip=("type",))
    return container


def _write_union(container: Any, oneof: str, specs: dict[str, list[Spec]]) -> JSON:
    kind = container.WhichOneof(oneof)
    if kind == "opaque":
        return _loads(container.opaque.json, f"{oneof}.opaque.json")
    if kind is None:
        raise ValueError(f"{oneof} with nothing set")
    return _write_from(getattr(container, kind), specs[kind], {"type": kind})


def _content_part(value: Any, path: str, exact: bool = True) -> r.ContentPart:
    return _read_union(r.ContentPart(), _PART_SPECS, value, path, exact)


def _content_part_to_json(part: r.ContentPart) -> JSON:
    out = _write_union(part, "part", _PART_SPECS)
    text = part.output_text
    if part.WhichOneof("part") == "output_text" and not text.annotations_json and text.annotations:
        out["annotations"] = [struct_to_dict(a) for a in text.annotations]  # the deprecated Struct list
    return out


def _content_list(value: Any, path: str) -> r.ContentList:
    values = _list(value, path)
    return r.ContentList(items=[_content_part(p, f"{path}[{i}]") for i, p in enumerate(values)])


# --- items --------------------------------------------------------------------

_TOKENS = [
    _f("prompt_token_ids", ("ids",)),
    _f("generation_token_ids", ("ids",)),
    _f("generation_log_probs", ("floats",)),
    _f("policy_version", "count"),
]
_STATUS = _f("status", ("enum", ITEM_STATUSES))


def _typed_parts(cls: type, part_type: str) -> tuple[Callable, Callable]:
    """Readers for reasoning summary/content parts, which must have `part_type` as their type."""
    specs = [_f("text", required=True)]

    def read(value: Any, path: str, exact: bool = True) -> Any:
        obj = _obj(value, path)
        if obj.get("type", part_type) != part_type:
            raise RowError(f"{path}.type", f"expected {part_type!r}, got {obj['type']!r}")
        message = cls()
        _read_into(message, obj, path, specs, exact, skip=("type",) if "type" in obj else ())
        return message

    return read, lambda message: _write_from(message, specs, {"type": part_type})


_MESSAGE = [_f("id"), _f("role", ("enum", ROLES, "strict"), required=True), _STATUS, *_TOKENS]
_REASONING = [
    _f("id"),
    _f("summary", ("list", *_typed_parts(r.SummaryText, "summary_text"))),
    _f("content", ("list", *_typed_parts(r.ReasoningText, "reasoning_text"))),
    _f("encrypted_content"),
    _STATUS,
    *_TOKENS,
]
_FUNCTION_CALL = [
    _f("id"),
    _f("call_id", required=True),
    _f("name", required=True),
    _f("arguments", required=True),
    _STATUS,
    *_TOKENS,
]
_FUNCTION_CALL_OUTPUT = [_f("id"), _f("call_id", required=True), _STATUS]
_CUSTOM_TOOL_CALL = [
    _f("id"),
    _f("call_id", required=True),
    _f("name", required=True),
    _f("input", required=True),
    _STATUS,
    *_TOKENS,
]
_CUSTOM_TOOL_CALL_OUTPUT = [_f("id"), _f("call_id", required=True)]
_MCP_CALL = [
    _f("id"),
    _f("server_label", required=True),
    _f("name", required=True),
    _f("arguments", required=True),
    _f("output"),
    _f("error"),
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
_TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "policy_version")
_ITEM_SPECS_NO_TOKENS = {kind: [s for s in specs if s[0] not in _TOKEN_KEYS] for kind, specs in _ITEM_SPECS.items()}


def item_from_json(value: Any, path: str = "item") -> r.Item:
    """One input or output item. A dict without "type" but with "role" is a message
    (and is written back with its "type"); an item of a type the schema does not
    model is kept whole as an opaque item."""
    obj = _obj(value, path)
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
            raise RowError(f"{path}.content", f"expected a string or a list, got {_type_name(content)}")
        skip += ("content",)
    elif kind in ("function_call_output", "custom_tool_call_output"):
        output = obj.get("output")
        if isinstance(output, str):
            inner.output = output
        elif isinstance(output, list):
            inner.output_parts.CopyFrom(_content_list(output, f"{path}.output"))
        else:
            raise RowError(f"{path}.output", f"expected a string or a list, got {_type_name(output)}")
        skip += ("output",)
    _read_into(inner, obj, path, _ITEM_SPECS[kind], True, skip)
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
        return _loads(item.opaque.json, "opaque.json")
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
    out = _write_from(inner, (_ITEM_SPECS if training else _ITEM_SPECS_NO_TOKENS)[kind], out)
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
    _f("name", required=True),
    _f("description"),
    _f("parameters", "json", "parameters_json"),
    _f("strict", "bool"),
]
_CUSTOM_TOOL = [_f("name", required=True), _f("description"), _f("format", "json", "format_json")]
_MCP_TOOL = [_f("server_label", required=True), _f("server_url"), _f("server_description")]
_TOOL_SPECS = {"function": _FUNCTION_TOOL, "custom": _CUSTOM_TOOL, "mcp": _MCP_TOOL}


def _tool(value: Any, path: str, exact: bool = True) -> r.Tool:
    return _read_union(r.Tool(), _TOOL_SPECS, value, path, exact)


def _tool_to_json(tool: r.Tool) -> JSON:
    out = _write_union(tool, "tool", _TOOL_SPECS)
    fn = tool.function
    if tool.WhichOneof("tool") == "function" and not fn.parameters_json and fn.HasField("parameters"):
        out["parameters"] = struct_to_dict(fn.parameters)  # the deprecated Struct
    return out


def tool_parameters(tool: r.FunctionTool) -> JSON | None:
    """A function tool's parameter schema as a dict (key order kept), None when it has none."""
    if tool.parameters_json:
        return _loads(tool.parameters_json, "parameters_json")
    if tool.HasField("parameters"):
        return struct_to_dict(tool.parameters)
    return None


def format_schema(fmt: r.TextFormat) -> JSON | None:
    """A text format's JSON schema as a dict (key order kept), None when it has none."""
    if fmt.schema_json:
        return _loads(fmt.schema_json, "schema_json")
    return struct_to_dict(fmt.schema) if fmt.HasField("schema") else None


def params_extra(params: r.CreateParams) -> JSON:
    """The create parameters CreateParams does not model (`seed`, `store`, ...), nulls included."""
    if params.extra_json:
        return _loads(params.extra_json, "extra_json")
    return struct_to_dict(params.extra)


def _tool_choice(value: Any, path: str, exact: bool = True) -> r.ToolChoice:
    if isinstance(value, str):
        if value in TOOL_CHOICE_MODES:
            return r.ToolChoice(mode=TOOL_CHOICE_MODES[value])
        return r.ToolChoice(json=dumps(value))
    obj = _obj(value, path)
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
        return _loads(choice.json, "tool_choice.json")
    return TOOL_CHOICE_MODE_NAMES.get(choice.mode, "auto")


_REASONING_CONFIG = [_f("effort"), _f("summary"), _f("generate_summary")]
_TEXT_FORMAT = [
    _f("type", ("enum", TEXT_FORMAT_TYPES)),
    _f("name"),
    _f("description"),
    _f("schema", "json", "schema_json"),
    _f("strict", "bool"),
]


def _text_format_to_json(fmt: r.TextFormat) -> JSON:
    out = _write_from(fmt, _TEXT_FORMAT, {})
    if not fmt.schema_json and fmt.HasField("schema"):  # deprecated Struct
        out["schema"] = struct_to_dict(fmt.schema)
    return out


_TEXT_CONFIG = [
    _f("format", ("msg", _reader(r.TextFormat, _TEXT_FORMAT), _text_format_to_json)),
    _f("verbosity"),
]


def _metadata(value: Any, path: str) -> dict[str, str]:
    obj = _obj(value, path)
    return {k: _str(v, f"{path}.{k}") for k, v in obj.items()}


# The request parameters that a CreateParams holds and a Response echoes (and `metadata`).
_ECHOED = [
    _f("instructions"),
    _f("tools", ("list", _tool, _tool_to_json)),
    _f("tool_choice", ("msg", _tool_choice, _tool_choice_to_json)),
    _f("temperature", "number"),
    _f("top_p", "number"),
    _f("max_output_tokens", "count"),
    _f("parallel_tool_calls", "bool"),
    _f("reasoning", ("msg", _reader(r.ReasoningConfig, _REASONING_CONFIG), _writer(_REASONING_CONFIG))),
    _f("text", ("msg", _reader(r.TextConfig, _TEXT_CONFIG), _writer(_TEXT_CONFIG))),
]
ECHOED_KEYS = (*(spec[0] for spec in _ECHOED), "metadata")


_PARAMS = [*_ECHOED, _f("model")]


def _read_metadata(message: r.CreateParams | r.Response, obj: JSON, path: str) -> tuple[str, ...]:
    """`metadata` when every value is a string (the API's rule); otherwise it stays in extra_json."""
    value = obj.get("metadata")
    if isinstance(value, dict) and value and all(isinstance(v, str) for v in value.values()):
        message.metadata.update(value)
        return ("metadata",)
    return ()


def params_from_json(value: Any, path: str = PARAMS_KEY) -> r.CreateParams:
    """A `responses_create_params` object."""
    obj = _obj(value, path)
    params = r.CreateParams()
    content = obj.get("input")
    if isinstance(content, str):
        params.input_text = content
    elif isinstance(content, list):
        params.input_items.SetInParent()
        params.input_items.items.extend(item_from_json(item, f"{path}.input[{i}]") for i, item in enumerate(content))
    else:
        raise RowError(f"{path}.input", f"expected a string or a list of items, got {_type_name(content)}")
    skip = ("input", *_read_metadata(params, obj, path))
    _read_into(params, obj, path, _PARAMS, False, skip)  # 1 and 1.0 are the same temperature to an engine
    return params


def params_to_json(params: r.CreateParams, training: bool = True) -> JSON:
    """A CreateParams as a `responses_create_params` object (see item_to_json for `training`)."""
    out: JSON = {}
    if params.WhichOneof("input") == "input_text":
        out["input"] = params.input_text
    else:
        out["input"] = [item_to_json(i, training) for i in params.input_items.items]
    out = _write_from(params, _PARAMS, out)
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
    row = _obj(row, "row")
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

_INPUT_DETAILS = [_f("cached_tokens", "count", required=True), _f("cache_write_tokens", "count", required=True)]
_OUTPUT_DETAILS = [_f("reasoning_tokens", "count", required=True)]
_USAGE = [
    _f("input_tokens", "count", required=True),
    _f(
        "input_tokens_details",
        ("msg", _reader(r.InputTokensDetails, _INPUT_DETAILS), _writer(_INPUT_DETAILS), "lenient"),
    ),
    _f("output_tokens", "count", required=True),
    _f(
        "output_tokens_details",
        ("msg", _reader(r.OutputTokensDetails, _OUTPUT_DETAILS), _writer(_OUTPUT_DETAILS), "lenient"),
    ),
    _f("total_tokens", "count", required=True),
]
_INCOMPLETE = [_f("reason", ("enum", INCOMPLETE_REASONS))]
_ERROR = [_f("code"), _f("message")]
_RESPONSE = [
    _f("id"),
    _f("created_at", "number"),
    _f("model"),
    _f("status", ("enum", RESPONSE_STATUSES)),
    _f("output", ("list", _output_item, item_to_json)),
    _f("usage", ("msg", _reader(r.Usage, _USAGE), _writer(_USAGE), "lenient")),
    _f("incomplete_details", ("msg", _reader(r.IncompleteDetails, _INCOMPLETE), _writer(_INCOMPLETE))),
    _f("error", ("msg", _reader(r.ResponseError, _ERROR), _writer(_ERROR))),
    *_ECHOED,
]


def response_from_json(value: Any, path: str = "response") -> r.Response:
    """A Responses API response object, every key kept (see the module docstring)."""
    obj = _obj(value, path)
    response = r.Response()
    _read_into(response, obj, path, _RESPONSE, True, _read_metadata(response, obj, path))
    return response


def response_to_json(response: r.Response) -> JSON:
    """A Response as a Responses API response object: what it holds, in the API's key order."""
    out = _write_from(response, _RESPONSE, {})
    if "output" not in out:
        out["output"] = []
    if response.metadata:
        out["metadata"] = dict(response.metadata)
    return out
