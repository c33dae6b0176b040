"""Tool-call formats: how a chat template has the model write its tool calls.

On the token-in-token-out path the engine returns generated text and ids, not
parsed messages, so the model server reads the calls itself, as vLLM does on
the chat path with `--tool-call-parser`. A format also gives the structural
tag (vLLM's `response_format: {"type": "structural_tag"}`, run by xgrammar)
that makes the engine write calls the tools' schemas accept: every call once
the model opens one, and at least one call for `tool_choice: required`, or
exactly the named function.

Formats are chosen by name in the model server's config (`tool_call_parser`),
like vLLM's parsers; add one to FORMATS for a template that writes calls
another way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

JSON = dict[str, Any]


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


class ToolCallFormat(Protocol):
    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        """(the text outside the calls, the calls) of a generated text; a call that
        does not parse stays in the text, as the model wrote it."""
        ...

    def structural_tag(self, tools: list[JSON], choice: str, parallel: bool) -> JSON:
        """The response_format that constrains calls to `tools` (Chat Completions
        tool objects) under a tool choice of "auto", "required" or a function's name."""
        ...


def utf8(text: str) -> bool:
    """Whether `text` is valid Unicode: JSON can decode an escaped lone surrogate
    that no protobuf string can carry."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def for_template(arguments: str) -> str:
    """A call's arguments as they can go to a chat template: "{}" when their JSON holds half a
    character (the escape of a lone surrogate, "\\ud8ca", which a model may write at a high
    temperature), else as they are. A template gets the arguments decoded into an object (vLLM
    decodes them so), and no tokenizer encodes that character: vLLM answers 400 ("TextEncodeInput
    must be Union[...]", seen on the local CPU vLLM), a tokenizer here raises TypeError. The token
    path needs a turn's render only around its words, which stay the ids the model sampled; on the
    chat path the engine sees the call without its arguments rather than the rollout failing."""
    if "\\u" not in arguments:  # the only way such a character gets into JSON text
        return arguments
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments
    return arguments if utf8(json.dumps(parsed, ensure_ascii=False)) else "{}"


def _past_space(text: str, i: int) -> int:
    """The index of the first character at or after `i` that is not white space."""
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class Hermes:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, as Hermes-2-Pro,
    Qwen2.5 and Qwen3 write calls (vLLM's `hermes` parser), any number per turn."""

    _OPEN, _CLOSE = "<tool_call>", "</tool_call>"
    _JSON = json.JSONDecoder()

    def parse(self, text: str) -> tuple[str, list[ParsedCall]]:
        calls: list[ParsedCall] = []
        kept: list[str] = []
        position = search = 0
        while (start := text.find(self._OPEN, search)) != -1:
            span = self._span(text, start)
            if span is None:
                break  # no closing tag after this one: no call can follow
            body, end = span
            search = end
            call = self._call(body)
            if call is None:
                continue  # not a call after all: it stays in the text
            calls.append(call)
            kept.append(text[position:start])
            position = end
        kept.append(text[position:])
        return "".join(kept).strip(), calls

    def _span(self, text: str, start: int) -> tuple[str, int] | None:
        """The body of the call opened at `start`, and where its closing tag ends: the JSON
        object that follows, read as JSON (a string in it may hold "</tool_call>", and a
        sampling model does write that), else the text up to the first closing tag."""
        after = start + len(self._OPEN)
        begin = _past_space(text, after)
        try:
            _, end = self._JSON.raw_decode(text, begin)
        except ValueError:
            pass
        else:
            close = _past_space(text, end)
            if text.startswith(self._CLOSE, close):
                return text[begin:end], close + len(self._CLOSE)
        close = text.find(self._CLOSE, after)
        return None if close == -1 else (text[after:close].strip(), close + len(self._CLOSE))

    @staticmethod
    def _call(body: str) -> ParsedCall | None:
        try:
            value = json.loads(body)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not utf8(value["name"]):
            return None
        arguments = value.get("arguments", {})
        if not isinstance(arguments, str):  # as vLLM's hermes parser serialises them
            arguments = json.dumps(arguments, ensure_ascii=False)
            if not utf8(arguments):  # a "\\ud8ca" escape of half a character: kept escaped
                arguments = json.dumps(value.get("arguments"))
        elif not utf8(arguments):
            return None
        return ParsedCall(value["name"], arguments)

    def structural_tag(self, tools: list[JSON], choice: str, parallel: bool) -> JSON:
        def tag(function: JSON) -> JSON:
            return {
                "type": "tag",
                "begin": '<tool_call>\n{"name": ' + json.dumps(function["name"]) + ', "arguments": ',
                "content": {"type": "json_schema", "json_schema": function.get("parameters") or {"type": "object"}},
                "end": "}\n</tool_call>",
            }

        functions = [tool["function"] for tool in tools]
        if choice not in ("auto", "required"):
            named = [f for f in functions if f["name"] == choice]
            if not named:
                raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")
            return {"type": "structural_tag", "format": tag(named[0])}
        return {
            "type": "structural_tag",
            "format": {
                "type": "triggered_tags",
                "triggers": ["<tool_call>"],
                "tags": [tag(f) for f in functions],
                "at_least_one": choice == "required",
                "stop_after_first": not parallel,
            },
        }


FORMATS: dict[str, ToolCallFormat] = {"hermes": Hermes()}
