"""The task pages (tasks/NAME.html): each holds its instruction (`<div id="instruction">`), its check
(`window.reward()`, 1 when done) and its known solution (a JSON list of tool calls in
`<script type="application/json" id="solution">`, read by the scripted policy only)."""

from __future__ import annotations

import html
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).parent / "tasks"
_INSTRUCTION = re.compile(r'<div id="instruction">(.*?)</div>', re.S)
_SOLUTION = re.compile(r'<script type="application/json" id="solution">(.*?)</script>', re.S)
#: The arguments of each tool, in the order a solution step lists them after the tool's name.
TOOL_ARGUMENTS = {
    "click": ("x", "y"),
    "type_text": ("text",),
    "key": ("name", "times"),
    "scroll": ("dx", "dy"),
    "drag": ("x1", "y1", "x2", "y2"),
}


@dataclass(frozen=True)
class TaskPage:
    name: str
    instruction: str
    #: The known solution: (tool, arguments) calls in order.
    solution: tuple[tuple[str, dict[str, Any]], ...]


def read_page(path: Path) -> TaskPage:
    text = path.read_text()
    instruction, solution = _INSTRUCTION.search(text), _SOLUTION.search(text)
    if instruction is None:
        raise ValueError(f'{path}: no <div id="instruction">')
    steps = json.loads(solution.group(1)) if solution is not None else []
    calls = tuple((step[0], dict(zip(TOOL_ARGUMENTS[step[0]], step[1:], strict=False))) for step in steps)
    return TaskPage(path.stem, html.unescape(instruction.group(1).strip()), calls)


def pages(folder: Path = TASKS_DIR) -> list[TaskPage]:
    return [read_page(path) for path in sorted(folder.glob("*.html"))]


def prompt(page: TaskPage, width: int = 400, height: int = 300) -> str:
    """What the model is asked: the page's instruction, and how it sees and acts."""
    return (
        f"{page.instruction}\n\nYou see a {width}x{height} browser page only through the screenshot tool; act on it "
        "with click, type_text, key, scroll and drag (coordinates in pixels from the top left). When the task is "
        "done, reply with a short message and no tool call."
    )


def task_rows(
    tools: list[dict[str, Any]], folder: Path = TASKS_DIR, width: int = 400, height: int = 300
) -> list[dict[str, Any]]:
    """A row per task page (data/example.jsonl is these), offering `tools`."""
    return [
        {
            "responses_create_params": {
                "input": [{"role": "user", "content": prompt(page, width, height)}],
                "tools": tools,
            },
            "task": page.name,
        }
        for page in pages(folder)
    ]
