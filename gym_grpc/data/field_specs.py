"""The generic mapping between JSON objects and gym.v1 messages, by field specs.

rows.py describes each object of the Responses schema as a list of field specs (a JSON key,
the proto field that holds it, its kind); `read_into` fills a message from a JSON object by
them and keeps what they do not take in the message's `extra_json`, and `write_from` writes
the message back, typed fields first, then the kept keys, so that a row comes back equal.
Loading is liberal about what it does not know and strict about what it does: a known key
whose value has the wrong type raises `RowError` naming its dotted path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf.message import Message as ProtoMessage

from gym_grpc.data.json_text import JSON, RowError, dumps, loads, type_name


def as_object(value: Any, path: str) -> JSON:
    if not isinstance(value, dict):
        raise RowError(path, f"expected an object, got {type_name(value)}")
    return value


def as_list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise RowError(path, f"expected a list, got {type_name(value)}")
    return value


def as_str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise RowError(path, f"expected a string, got {type_name(value)}")
    return value


def as_bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise RowError(path, f"expected true or false, got {type_name(value)}")
    return value


def as_number(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RowError(path, f"expected a number, got {value!r}")
    return float(value)


def as_count(value: Any, path: str) -> int:
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
_SCALARS: dict[str, Callable[[Any, str], Any]] = {"str": as_str, "bool": as_bool, "count": as_count}


def field(key: str, kind: Any = "str", attr: str | None = None, required: bool = False) -> Spec:
    return (key, attr or key, kind, required)


def read_into(message: ProtoMessage, obj: JSON, path: str, specs: list[Spec], exact: bool, skip: tuple = ()) -> None:
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
            number = as_number(value, where)
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
            values = as_list(value, where)
            if not values:
                continue
            getattr(message, attr).extend(kind[1](v, f"{where}[{i}]", exact) for i, v in enumerate(values))
        elif tag in ("ids", "floats"):
            values = as_list(value, where)
            if not values:
                continue
            check = as_count if tag == "ids" else as_number
            getattr(message, attr).extend(check(v, f"{where}[{i}]") for i, v in enumerate(values))
        taken.add(key)
    extra = {k: v for k, v in obj.items() if k not in taken}
    if extra:
        message.extra_json = dumps(extra)  # type: ignore[attr-defined]


#: What `write_from` reads of each spec, per (message type, spec list): looked up once, not per row.
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


def write_from(message: ProtoMessage, specs: list[Spec], out: JSON) -> JSON:
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
            out[key] = loads(value, attr)
        elif tag == "enum":
            names = _names_of(kind[1])
            if value in names:
                out[key] = names[value]
        elif tag == "msg":
            out[key] = kind[2](value)
        else:
            out[key] = value
    return with_extra(out, message.extra_json)  # type: ignore[attr-defined]


def with_extra(out: JSON, extra_json: str) -> JSON:
    if extra_json:
        for key, value in loads(extra_json, "extra_json").items():
            out.setdefault(key, value)
    return out


def reader(cls: type, specs: list[Spec]) -> Callable[[Any, str, bool], Any]:
    def read(value: Any, path: str, exact: bool = True) -> Any:
        message = cls()
        read_into(message, as_object(value, path), path, specs, exact)
        return message

    return read


def writer(specs: list[Spec]) -> Callable[[Any], JSON]:
    return lambda message: write_from(message, specs, {})


def read_union(container: Any, specs: dict[str, list[Spec]], value: Any, path: str, exact: bool) -> Any:
    """A tagged union (a content part, a tool): the oneof member its "type" names (members are
    named as the JSON types), or, for a type the schema does not model, the whole object as opaque."""
    obj = as_object(value, path)
    kind = obj.get("type")
    if kind not in specs:
        container.opaque.type = kind if isinstance(kind, str) else ""
        container.opaque.json = dumps(obj)
        return container
    inner = getattr(container, kind)
    inner.SetInParent()
    read_into(inner, obj, path, specs[kind], exact, skip=("type",))
    return container


def write_union(container: Any, oneof: str, specs: dict[str, list[Spec]]) -> JSON:
    kind = container.WhichOneof(oneof)
    if kind == "opaque":
        return loads(container.opaque.json, f"{oneof}.opaque.json")
    if kind is None:
        raise ValueError(f"{oneof} with nothing set")
    return write_from(getattr(container, kind), specs[kind], {"type": kind})


#: Each enum table's names by value, for the writer (built once per table, not per value written).
_NAMES_OF: dict[int, tuple[Mapping[str, int], dict[int, str]]] = {}


def _names_of(table: Mapping[str, int]) -> dict[int, str]:
    cached = _NAMES_OF.get(id(table))
    if cached is None or cached[0] is not table:
        cached = _NAMES_OF[id(table)] = (table, {v: k for k, v in table.items()})
    return cached[1]
