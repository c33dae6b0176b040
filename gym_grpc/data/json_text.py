"""JSON text in gym.v1 messages: the `*_json` fields, the deprecated Struct fields they replaced, and the
error for a JSON value that does not fit (`RowError`, named by its dotted path).

Free-form JSON (tool schemas, task fields, verifier fields) travels as JSON text so that key order,
`1.0` and integers past 2**53 survive; a peer built before the `*_json` fields sent a Struct instead,
which is still read when the text is empty.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from google.protobuf import struct_pb2
from google.protobuf.message import Message as ProtoMessage

from gym_grpc import errors

JSON = dict[str, Any]


class RowError(errors.InvalidArgument, ValueError):
    """A JSON value that does not fit the schema; `field` is its dotted path.

    In a server it is an INVALID_ARGUMENT (JSON text in a request's `*_json`
    field that does not parse, for example)."""

    reason = errors.Reason.ROW_INVALID

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", field=field)
        self.detail = message


def type_name(value: Any) -> str:
    """How an error names a JSON value's type."""
    return "null" if value is None else type(value).__name__


def dumps(value: Any) -> str:
    """Compact JSON text, as the `*_json` fields hold it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def loads(text: str, where: str) -> Any:
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
    fields = struct.fields
    # By key: a map's items() is collections.abc's, in Python; its keys come from C.
    return {k: value_to_python(fields[k]) for k in fields} if fields else {}


def json_field(message: ProtoMessage, name: str) -> JSON:
    """The JSON object in `message.<name>_json`, or in the deprecated Struct `message.<name>` when
    the text is empty (a peer built before the `_json` fields); {} when neither is set.

    For Task.data, Rollout.verifier_fields and the verifiers' `fields`."""
    text = getattr(message, f"{name}_json")
    if text:
        value = loads(text, f"{name}_json")
        if not isinstance(value, dict):
            raise RowError(f"{name}_json", f"expected a JSON object, got {type_name(value)}")
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
