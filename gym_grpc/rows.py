"""JSONL rows in NeMo Gym's format <-> gym.v1 messages.

A task row is `{"responses_create_params": {...}, <task fields>...}`; a
rollout row is the task row plus `response`, `reward` and the verifier's
extra fields. The JSON side is the OpenAI Responses JSON. Loading checks
every value and raises `RowError` naming the field (a dotted path such as
`responses_create_params.input[2].role`); dumping writes the canonical form
(items always carry their `"type"`), so `load(dump(m)) == m` for every message
and a row already in canonical form dumps back unchanged.

Free-form values (task fields, tool schemas, verifier fields) travel as
`google.protobuf.Struct`, whose numbers are doubles; on the way back to JSON
an integral number becomes an int again (`42.0` -> `42`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from google.protobuf import struct_pb2

from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

JSON = dict[str, Any]
E = TypeVar("E", bound=int)

PARAMS_KEY = "responses_create_params"


class RowError(ValueError):
    """A JSON value that does not fit the schema; `field` is its dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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


# --- checked access to JSON values -----------------------------------------


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _obj(value: Any, path: str, known: frozenset[str] | None = None) -> JSON:
    if not isinstance(value, dict):
        raise RowError(path, f"expected an object, got {_type_name(value)}")
    if known is not None:
        unknown = sorted(set(value) - known)
        if unknown:
            raise RowError(f"{path}.{unknown[0]}", f"unknown key (known: {', '.join(sorted(known))})")
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


def _enum(table: Mapping[str, E], value: Any, path: str) -> E:
    if value not in table:
        raise RowError(path, f"expected one of {', '.join(table)}, got {value!r}")
    return table[value]


def _struct(value: Any, path: str) -> struct_pb2.Struct:
    struct = struct_pb2.Struct()
    try:
        struct.update(_obj(value, path))
    except (ValueError, TypeError) as e:
        raise RowError(path, f"not JSON data: {e}") from None
    return struct


def _tokens(item: Any, obj: JSON, path: str) -> None:
    """Copy the training fields of an assistant item, checking their types."""
    for key in ("prompt_token_ids", "generation_token_ids"):
        if obj.get(key) is not None:
            values = _list(obj[key], f"{path}.{key}")
            getattr(item, key).extend(_count(v, f"{path}.{key}[{i}]") for i, v in enumerate(values))
    if obj.get("generation_log_probs") is not None:
        key = f"{path}.generation_log_probs"
        values = _list(obj["generation_log_probs"], key)
        item.generation_log_probs.extend(_number(v, f"{key}[{i}]") for i, v in enumerate(values))
    if len(item.generation_log_probs) and len(item.generation_log_probs) != len(item.generation_token_ids):
        raise RowError(
            f"{path}.generation_log_probs",
            f"has {len(item.generation_log_probs)} values for {len(item.generation_token_ids)} generation_token_ids",
        )


# --- JSON -> proto -----------------------------------------------------------

_TOKEN_KEYS = frozenset({"prompt_token_ids", "generation_token_ids", "generation_log_probs"})
_MESSAGE_KEYS = frozenset({"type", "id", "role", "content", "status"}) | _TOKEN_KEYS
_REASONING_KEYS = frozenset({"type", "id", "summary", "content", "encrypted_content", "status"}) | _TOKEN_KEYS
_CALL_KEYS = frozenset({"type", "id", "call_id", "name", "arguments", "status"}) | _TOKEN_KEYS
_CALL_OUTPUT_KEYS = frozenset({"type", "id", "call_id", "output", "status"})


def _content_part(obj: Any, path: str, strict: bool = True) -> r.ContentPart:
    kind = _obj(obj, path).get("type")
    part = r.ContentPart()
    known = (lambda keys: frozenset(keys)) if strict else (lambda keys: None)
    if kind == "input_text":
        _obj(obj, path, known({"type", "text"}))
        part.input_text.text = _str(obj.get("text"), f"{path}.text")
    elif kind == "output_text":
        _obj(obj, path, known({"type", "text", "annotations"}))
        part.output_text.text = _str(obj.get("text"), f"{path}.text")
        for i, a in enumerate(_list(obj.get("annotations") or [], f"{path}.annotations")):
            part.output_text.annotations.append(_struct(a, f"{path}.annotations[{i}]"))
    elif kind == "refusal":
        _obj(obj, path, known({"type", "refusal"}))
        part.refusal.refusal = _str(obj.get("refusal"), f"{path}.refusal")
    elif kind == "input_image":
        _obj(obj, path, known({"type", "image_url", "file_id", "detail"}))
        for key in ("image_url", "file_id", "detail"):
            if obj.get(key) is not None:
                setattr(part.input_image, key, _str(obj[key], f"{path}.{key}"))
    else:
        raise RowError(f"{path}.type", f"expected input_text, output_text, refusal or input_image, got {kind!r}")
    return part


def _id_and_status(target: Any, obj: JSON, path: str) -> None:
    """The `id` and `status` every item may carry (the load side of `_common`)."""
    if obj.get("id") is not None:
        target.id = _str(obj["id"], f"{path}.id")
    if obj.get("status") is not None:
        target.status = _enum(ITEM_STATUSES, obj["status"], f"{path}.status")


def item_from_json(obj: Any, path: str = "item", strict: bool = True) -> r.Item:
    """One input or output item. A dict without "type" but with "role" is a message.

    `strict` rejects keys outside the schema (for rows); an engine's answer is
    read with strict=False, which ignores them."""
    obj = _obj(obj, path)
    kind = obj.get("type", "message" if "role" in obj else None)
    item = r.Item()
    if kind == "message":
        _obj(obj, path, _MESSAGE_KEYS if strict else None)
        m = item.message
        m.SetInParent()
        m.role = _enum(ROLES, obj.get("role"), f"{path}.role")
        content = obj.get("content")
        if isinstance(content, str):
            m.text = content
        elif isinstance(content, list):
            m.parts.SetInParent()
            m.parts.items.extend(_content_part(p, f"{path}.content[{i}]", strict) for i, p in enumerate(content))
        else:
            raise RowError(f"{path}.content", f"expected a string or a list, got {_type_name(content)}")
        _id_and_status(m, obj, path)
        _tokens(m, obj, path)
    elif kind == "reasoning":
        _obj(obj, path, _REASONING_KEYS if strict else None)
        rs = item.reasoning
        rs.SetInParent()
        for key, target, part_type in (
            ("summary", rs.summary, "summary_text"),
            ("content", rs.content, "reasoning_text"),
        ):
            for i, p in enumerate(_list(obj.get(key) or [], f"{path}.{key}")):
                p = _obj(p, f"{path}.{key}[{i}]", frozenset({"type", "text"}) if strict else None)
                if p.get("type", part_type) != part_type:
                    raise RowError(f"{path}.{key}[{i}].type", f"expected {part_type!r}, got {p['type']!r}")
                target.add(text=_str(p.get("text"), f"{path}.{key}[{i}].text"))
        if obj.get("encrypted_content") is not None:
            rs.encrypted_content = _str(obj["encrypted_content"], f"{path}.encrypted_content")
        _id_and_status(rs, obj, path)
        _tokens(rs, obj, path)
    elif kind == "function_call":
        _obj(obj, path, _CALL_KEYS if strict else None)
        fc = item.function_call
        fc.SetInParent()
        for key in ("call_id", "name", "arguments"):
            setattr(fc, key, _str(obj.get(key), f"{path}.{key}"))
        _id_and_status(fc, obj, path)
        _tokens(fc, obj, path)
    elif kind == "function_call_output":
        _obj(obj, path, _CALL_OUTPUT_KEYS if strict else None)
        out = item.function_call_output
        out.SetInParent()
        out.call_id = _str(obj.get("call_id"), f"{path}.call_id")
        out.output = _str(obj.get("output"), f"{path}.output")
        _id_and_status(out, obj, path)
    else:
        raise RowError(
            f"{path}.type",
            f"expected message, reasoning, function_call or function_call_output, got {kind!r}",
        )
    return item


def _tool(obj: Any, path: str) -> r.Tool:
    obj = _obj(obj, path)
    if obj.get("type") != "function":
        raise RowError(f"{path}.type", f"only function tools are supported, got {obj.get('type')!r}")
    _obj(obj, path, frozenset({"type", "name", "description", "parameters", "strict"}))
    tool = r.Tool()
    fn = tool.function
    fn.name = _str(obj.get("name"), f"{path}.name")
    if obj.get("description") is not None:
        fn.description = _str(obj["description"], f"{path}.description")
    if obj.get("parameters") is not None:
        fn.parameters.CopyFrom(_struct(obj["parameters"], f"{path}.parameters"))
    if obj.get("strict") is not None:
        fn.strict = _bool(obj["strict"], f"{path}.strict")
    return tool


def _tool_choice(value: Any, path: str) -> r.ToolChoice:
    if isinstance(value, str):
        return r.ToolChoice(mode=_enum(TOOL_CHOICE_MODES, value, path))
    obj = _obj(value, path, frozenset({"type", "name"}))
    if obj.get("type") != "function":
        raise RowError(f"{path}.type", f"expected 'function', got {obj.get('type')!r}")
    return r.ToolChoice(function_name=_str(obj.get("name"), f"{path}.name"))


def _reasoning(value: Any, path: str) -> r.ReasoningConfig:
    obj = _obj(value, path, frozenset({"effort", "summary"}))
    cfg = r.ReasoningConfig()
    for key in ("effort", "summary"):
        if obj.get(key) is not None:
            setattr(cfg, key, _str(obj[key], f"{path}.{key}"))
    return cfg


def _text_config(value: Any, path: str) -> r.TextConfig:
    obj = _obj(value, path, frozenset({"format", "verbosity"}))
    cfg = r.TextConfig()
    if obj.get("verbosity") is not None:
        cfg.verbosity = _str(obj["verbosity"], f"{path}.verbosity")
    if obj.get("format") is not None:
        fpath = f"{path}.format"
        fmt = _obj(obj["format"], fpath, frozenset({"type", "name", "description", "schema", "strict"}))
        cfg.format.type = _enum(TEXT_FORMAT_TYPES, fmt.get("type"), f"{fpath}.type")
        for key in ("name", "description"):
            if fmt.get(key) is not None:
                setattr(cfg.format, key, _str(fmt[key], f"{fpath}.{key}"))
        if fmt.get("schema") is not None:
            cfg.format.schema.CopyFrom(_struct(fmt["schema"], f"{fpath}.schema"))
        if fmt.get("strict") is not None:
            cfg.format.strict = _bool(fmt["strict"], f"{fpath}.strict")
    return cfg


def _metadata(value: Any, path: str) -> dict[str, str]:
    obj = _obj(value, path)
    return {k: _str(v, f"{path}.{k}") for k, v in obj.items()}


# The typed keys of a create-params object, each with its parser and setter.
# Keys outside this table go to CreateParams.extra verbatim.
_PARAM_FIELDS: dict[str, Callable[[r.CreateParams, Any, str], None]] = {
    "instructions": lambda p, v, f: setattr(p, "instructions", _str(v, f)),
    "tools": lambda p, v, f: p.tools.extend(_tool(t, f"{f}[{i}]") for i, t in enumerate(_list(v, f))),
    "tool_choice": lambda p, v, f: p.tool_choice.CopyFrom(_tool_choice(v, f)),
    "temperature": lambda p, v, f: setattr(p, "temperature", _number(v, f)),
    "top_p": lambda p, v, f: setattr(p, "top_p", _number(v, f)),
    "max_output_tokens": lambda p, v, f: setattr(p, "max_output_tokens", _count(v, f)),
    "parallel_tool_calls": lambda p, v, f: setattr(p, "parallel_tool_calls", _bool(v, f)),
    "metadata": lambda p, v, f: p.metadata.update(_metadata(v, f)),
    "reasoning": lambda p, v, f: p.reasoning.CopyFrom(_reasoning(v, f)),
    "text": lambda p, v, f: p.text.CopyFrom(_text_config(v, f)),
    "model": lambda p, v, f: setattr(p, "model", _str(v, f)),
}


def params_from_json(obj: Any, path: str = PARAMS_KEY) -> r.CreateParams:
    """A `responses_create_params` object. `null` values count as not set."""
    obj = _obj(obj, path)
    params = r.CreateParams()
    value = obj.get("input")
    if isinstance(value, str):
        params.input_text = value
    elif isinstance(value, list):
        params.input_items.SetInParent()
        params.input_items.items.extend(item_from_json(item, f"{path}.input[{i}]") for i, item in enumerate(value))
    else:
        raise RowError(f"{path}.input", f"expected a string or a list of items, got {_type_name(value)}")
    extra = {}
    for key, value in obj.items():
        if key == "input" or value is None:
            continue
        setter = _PARAM_FIELDS.get(key)
        if setter is None:
            extra[key] = value
        else:
            setter(params, value, f"{path}.{key}")
    if extra:
        params.extra.CopyFrom(_struct(extra, path))
    return params


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
    """A task row: `responses_create_params` plus any other fields (kept in `data`)."""
    row = _obj(row, "row")
    if PARAMS_KEY not in row:
        raise RowError(PARAMS_KEY, "is required")
    task = task_pb2.Task(responses_create_params=params_from_json(row[PARAMS_KEY]))
    data = {k: v for k, v in row.items() if k != PARAMS_KEY}
    if data:
        task.data.CopyFrom(_struct(data, "row"))
    return task


def _usage(obj: Any, path: str) -> r.Usage:
    obj = _obj(obj, path)
    usage = r.Usage()
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        if obj.get(key) is not None:
            setattr(usage, key, _count(obj[key], f"{path}.{key}"))
    for key, subs in (
        ("input_tokens_details", ("cached_tokens", "cache_write_tokens")),
        ("output_tokens_details", ("reasoning_tokens",)),
    ):
        if obj.get(key) is not None:
            details = _obj(obj[key], f"{path}.{key}")
            for sub in subs:
                if details.get(sub):  # a zero count is the default: leave the detail unset
                    setattr(getattr(usage, key), sub, _count(details[sub], f"{path}.{key}.{sub}"))
    return usage


def response_from_json(obj: Any, path: str = "response") -> r.Response:
    """A Responses API response object. Keys outside the schema are ignored."""
    obj = _obj(obj, path)
    resp = r.Response()
    for key in ("id", "model"):
        if obj.get(key) is not None:
            setattr(resp, key, _str(obj[key], f"{path}.{key}"))
    if obj.get("created_at") is not None:
        resp.created_at = _number(obj["created_at"], f"{path}.created_at")
    if obj.get("status") is not None:
        resp.status = _enum(RESPONSE_STATUSES, obj["status"], f"{path}.status")
    resp.output.extend(
        item_from_json(item, f"{path}.output[{i}]", strict=False)
        for i, item in enumerate(_list(obj.get("output", []), f"{path}.output"))
    )
    if obj.get("usage") is not None:
        resp.usage.CopyFrom(_usage(obj["usage"], f"{path}.usage"))
    if obj.get("incomplete_details") is not None:
        details = _obj(obj["incomplete_details"], f"{path}.incomplete_details")
        resp.incomplete_details.reason = _enum(
            INCOMPLETE_REASONS, details.get("reason"), f"{path}.incomplete_details.reason"
        )
    if obj.get("error") is not None:
        err = _obj(obj["error"], f"{path}.error")
        resp.error.code = str(err.get("code") or "")
        resp.error.message = str(err.get("message") or "")
    # The echoed request parameters share the create-params parsers.
    for key in _PARAM_FIELDS.keys() - {"model"}:
        if obj.get(key) is not None:
            _PARAM_FIELDS[key](resp, obj[key], f"{path}.{key}")  # type: ignore[arg-type]
    return resp


# --- proto -> JSON -----------------------------------------------------------


def value_to_python(value: struct_pb2.Value) -> Any:
    """A Struct value as plain Python; integral numbers become ints."""
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


def _dump_tokens(item: Any, out: JSON) -> JSON:
    if item.prompt_token_ids:
        out["prompt_token_ids"] = list(item.prompt_token_ids)
    if item.generation_token_ids:
        out["generation_token_ids"] = list(item.generation_token_ids)
    if item.generation_log_probs:
        out["generation_log_probs"] = list(item.generation_log_probs)
    return out


def _content_part_to_json(part: r.ContentPart) -> JSON:
    kind = part.WhichOneof("part")
    if kind == "input_text":
        return {"type": "input_text", "text": part.input_text.text}
    if kind == "output_text":
        return {
            "type": "output_text",
            "text": part.output_text.text,
            "annotations": [struct_to_dict(a) for a in part.output_text.annotations],
        }
    if kind == "refusal":
        return {"type": "refusal", "refusal": part.refusal.refusal}
    if kind == "input_image":
        img = part.input_image
        out: JSON = {"type": "input_image"}
        for key in ("image_url", "file_id", "detail"):
            if getattr(img, key):
                out[key] = getattr(img, key)
        return out
    raise ValueError("content part with nothing set")


def _common(out: JSON, item: Any) -> JSON:
    if item.id:
        out["id"] = item.id
    if item.status:
        out["status"] = ITEM_STATUS_NAMES[item.status]
    return out


def item_to_json(item: r.Item, training: bool = True) -> JSON:
    """One item in the canonical Responses JSON (always with its "type").

    `training=False` leaves out the token fields, which engines do not accept."""
    kind = item.WhichOneof("item")
    tokens = _dump_tokens if training else (lambda inner, out: out)
    if kind == "message":
        m = item.message
        out: JSON = {"type": "message", "role": ROLE_NAMES.get(m.role, "user")}
        if m.WhichOneof("content") == "text":
            out["content"] = m.text
        else:
            out["content"] = [_content_part_to_json(p) for p in m.parts.items]
        return tokens(m, _common(out, m))
    if kind == "reasoning":
        rs = item.reasoning
        out = {"type": "reasoning", "summary": [{"type": "summary_text", "text": s.text} for s in rs.summary]}
        if rs.content:
            out["content"] = [{"type": "reasoning_text", "text": c.text} for c in rs.content]
        if rs.HasField("encrypted_content"):
            out["encrypted_content"] = rs.encrypted_content
        return tokens(rs, _common(out, rs))
    if kind == "function_call":
        fc = item.function_call
        out = {"type": "function_call", "call_id": fc.call_id, "name": fc.name, "arguments": fc.arguments}
        return tokens(fc, _common(out, fc))
    if kind == "function_call_output":
        fo = item.function_call_output
        return _common({"type": "function_call_output", "call_id": fo.call_id, "output": fo.output}, fo)
    raise ValueError("item with nothing set")


def _tool_to_json(tool: r.Tool) -> JSON:
    fn = tool.function
    out: JSON = {"type": "function", "name": fn.name}
    if fn.description:
        out["description"] = fn.description
    if fn.HasField("parameters"):
        out["parameters"] = struct_to_dict(fn.parameters)
    if fn.HasField("strict"):
        out["strict"] = fn.strict
    return out


def _tool_choice_to_json(choice: r.ToolChoice) -> Any:
    if choice.WhichOneof("choice") == "function_name":
        return {"type": "function", "name": choice.function_name}
    return TOOL_CHOICE_MODE_NAMES.get(choice.mode, "auto")


def _text_config_to_json(cfg: r.TextConfig) -> JSON:
    out: JSON = {}
    if cfg.HasField("format"):
        f = cfg.format
        fmt: JSON = {"type": TEXT_FORMAT_TYPE_NAMES.get(f.type, "text")}
        for key in ("name", "description"):
            if getattr(f, key):
                fmt[key] = getattr(f, key)
        if f.HasField("schema"):
            fmt["schema"] = struct_to_dict(f.schema)
        if f.HasField("strict"):
            fmt["strict"] = f.strict
        out["format"] = fmt
    if cfg.verbosity:
        out["verbosity"] = cfg.verbosity
    return out


def _reasoning_to_json(cfg: r.ReasoningConfig) -> JSON:
    return {k: getattr(cfg, k) for k in ("effort", "summary") if getattr(cfg, k)}


def _echoed_params(msg: r.CreateParams | r.Response, out: JSON) -> JSON:
    """The request parameters a CreateParams holds or a Response echoes."""
    if msg.HasField("instructions"):
        out["instructions"] = msg.instructions
    if msg.tools:
        out["tools"] = [_tool_to_json(t) for t in msg.tools]
    if msg.HasField("tool_choice"):
        out["tool_choice"] = _tool_choice_to_json(msg.tool_choice)
    for key in ("temperature", "top_p", "max_output_tokens", "parallel_tool_calls"):
        if msg.HasField(key):
            out[key] = getattr(msg, key)
    if msg.metadata:
        out["metadata"] = dict(msg.metadata)
    if msg.HasField("reasoning"):
        out["reasoning"] = _reasoning_to_json(msg.reasoning)
    if msg.HasField("text"):
        out["text"] = _text_config_to_json(msg.text)
    return out


def params_to_json(params: r.CreateParams, training: bool = True) -> JSON:
    """A CreateParams as a `responses_create_params` object (see item_to_json for `training`)."""
    out: JSON = {}
    if params.WhichOneof("input") == "input_text":
        out["input"] = params.input_text
    else:
        out["input"] = [item_to_json(i, training) for i in params.input_items.items]
    _echoed_params(params, out)
    if params.model:
        out["model"] = params.model
    out.update(struct_to_dict(params.extra))
    return out


def task_to_row(task: task_pb2.Task) -> JSON:
    """A Task as a task row."""
    return {PARAMS_KEY: params_to_json(task.responses_create_params), **struct_to_dict(task.data)}


def _usage_to_json(usage: r.Usage) -> JSON:
    return {
        "input_tokens": usage.input_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.input_tokens_details.cached_tokens,
            "cache_write_tokens": usage.input_tokens_details.cache_write_tokens,
        },
        "output_tokens": usage.output_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.output_tokens_details.reasoning_tokens},
        "total_tokens": usage.total_tokens,
    }


def response_to_json(resp: r.Response) -> JSON:
    """A Response as a Responses API response object (valid for the openai SDK)."""
    out: JSON = {
        "id": resp.id,
        "object": "response",
        "created_at": resp.created_at,
        "model": resp.model,
        "status": RESPONSE_STATUS_NAMES.get(resp.status, "completed"),
        "output": [item_to_json(i) for i in resp.output],
        "incomplete_details": (
            {"reason": INCOMPLETE_REASON_NAMES[resp.incomplete_details.reason]}
            if resp.incomplete_details.reason
            else None
        ),
        "error": ({"code": resp.error.code, "message": resp.error.message} if resp.HasField("error") else None),
        # Defaults for the echo fields the Responses object requires.
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
    }
    if resp.HasField("usage"):
        out["usage"] = _usage_to_json(resp.usage)
    return _echoed_params(resp, out)


def with_verdict(row: JSON, reward: float, fields: JSON, components: Mapping[str, float]) -> JSON:
    """A copy of `row` with a verification: `reward`, the verifier's fields (named
    in `verifier_fields`) and `reward_components` when there are any."""
    out = {**row, "reward": reward, **fields, "verifier_fields": sorted(fields)}
    if components:
        out["reward_components"] = dict(components)
    return out


def rollout_row(row: JSON, rollout: task_pb2.Rollout) -> JSON:
    """The rollout row: the task row, then `response` and the verification."""
    scored = {**row, "response": response_to_json(rollout.response)}
    return with_verdict(scored, rollout.reward, struct_to_dict(rollout.verifier_fields), rollout.reward_components)
