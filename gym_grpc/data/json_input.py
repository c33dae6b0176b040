"""JSON from outside (task and rollout rows, tool arguments, a model's text), with bounded nesting.

Deep nesting breaks every recursive reader on the way: Python's json raises
RecursionError, which is not a ValueError, somewhere near 1,000 levels, and
verifiers and other languages' parsers have their own limits. gym.v1 carries
free-form JSON as text (`Task.data_json`), so protobuf's own limit of 100
nested messages no longer applies to it; but a peer built before the `*_json`
fields puts a row's fields in a `google.protobuf.Struct`, where each JSON level
costs three of those, and 32 levels is what that peer can carry. `loads`
refuses text nested deeper than MAX_DEPTH before the parser recurses.
"""

from __future__ import annotations

import json
import re
from typing import Any

from gym_grpc import errors

#: How deep JSON may nest (the outermost object or list is level 1). Every gym.v1
#: peer, old or new, can carry a row this deep.
MAX_DEPTH = 32

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


class TooDeep(errors.FrameworkError, ValueError):
    """JSON nested deeper than MAX_DEPTH levels."""

    reason = errors.Reason.JSON_TOO_DEEP

    def __init__(self) -> None:
        super().__init__(f"nested deeper than {MAX_DEPTH} levels")


def _too_deep(text: str) -> bool:
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    depth = 0
    for bracket in _NOT_BRACKET.sub("", _STRING.sub("", text)):  # brackets inside strings do not count
        if bracket in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        else:
            depth -= 1
    return False


def loads(text: str, **kwargs: Any) -> Any:
    """json.loads that raises TooDeep (a ValueError) for text nested deeper than MAX_DEPTH."""
    if _too_deep(text):
        raise TooDeep()
    return json.loads(text, **kwargs)
