"""Statistics of a task file, kept next to it so that a change to the data shows in review.

`gym-grpc prepare-data` writes `<name>.stats.json` beside `<name>.jsonl` the
first time and, after that, fails when the data no longer matches it: a file
that silently lost rows, a prompt template that doubled in length, a
temperature that changed. Numbers are rounded so the file is stable across
platforms.

Token counts are approximate and tokenizer-free (the runs of letters or
digits and the single punctuation marks of the text); they are meant to show
a change in length, not to predict an engine's count.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gym_grpc.data.rows import params_to_json
from gym_grpc.responses import input_items, message_text
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

#: Sampling parameters whose ranges the statistics report.
SAMPLING_PARAMS = ("temperature", "top_p", "max_output_tokens")
_TOKEN = re.compile(r"\w+|[^\w\s]")


def approx_tokens(text: str) -> int:
    """A tokenizer-free token count: runs of letters or digits, and punctuation marks."""
    return len(_TOKEN.findall(text))


def _spread(values: list[float]) -> dict[str, float]:
    if not values:
        return {"avg": 0.0, "min": 0.0, "max": 0.0}
    return {"avg": round(sum(values) / len(values), 4), "min": min(values), "max": max(values)}


def _item_text(item: r.Item) -> str:
    kind = item.WhichOneof("item")
    if kind == "message":
        return message_text(item.message)
    if kind == "function_call":
        return f"{item.function_call.name} {item.function_call.arguments}"
    if kind == "function_call_output":
        return item.function_call_output.output
    if kind == "reasoning":
        return " ".join(s.text for s in item.reasoning.summary)
    return ""


def statistics(tasks: Iterable[task_pb2.Task]) -> dict[str, Any]:
    """Statistics of the tasks of one file."""
    tools: list[float] = []
    tokens: list[float] = []
    turns: list[float] = []
    create_params: set[str] = set()
    user_messages: set[str] = set()
    sampling: dict[str, list[float]] = {name: [] for name in SAMPLING_PARAMS}
    count = 0
    for task in tasks:
        count += 1
        params = task.responses_create_params
        items = input_items(params)
        settings = params_to_json(params)
        settings.pop("input", None)
        tools.append(len(params.tools))
        tool_schemas = json.dumps(settings["tools"]) if params.tools else ""
        prompt = [_item_text(i) for i in items] + [params.instructions, tool_schemas]
        tokens.append(sum(approx_tokens(text) for text in prompt))
        users = [
            message_text(i.message)
            for i in items
            if i.WhichOneof("item") == "message" and i.message.role == r.ROLE_USER
        ]
        turns.append(len(users))
        user_messages.add("\n".join(users))
        create_params.add(json.dumps(settings, sort_keys=True))
        for name in SAMPLING_PARAMS:
            if name in settings:
                sampling[name].append(settings[name])
    return {
        "rows": count,
        "tools_per_row": _spread(tools),
        "input_tokens_approx": {**_spread(tokens), "total": sum(tokens)},
        "user_turns": _spread(turns),
        "unique_create_params": len(create_params),
        "unique_user_messages": len(user_messages),
        "sampling": {
            name: {"rows": len(values), "min": min(values), "max": max(values)}
            for name, values in sampling.items()
            if values
        },
    }


def write_statistics(path: Path, stats: dict[str, Any]) -> None:
    """Save statistics as stable, reviewable JSON (sorted keys), replacing the file at once."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    temporary.replace(path)


def differences(committed: dict[str, Any], current: dict[str, Any], prefix: str = "") -> list[str]:
    """Where two statistics disagree, as "key: committed X, now Y" lines."""
    lines = []
    for key in sorted(set(committed) | set(current)):
        where = f"{prefix}{key}"
        old, new = committed.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            lines += differences(old, new, f"{where}.")
        elif old != new:
            lines.append(f"{where}: committed {json.dumps(old)}, now {json.dumps(new)}")
    return lines
