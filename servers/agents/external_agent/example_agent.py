"""An agent gym-grpc did not write: the openai SDK in a tool-calling loop, as anyone would write one.

It knows nothing of gym-grpc but what the external agent server puts in its
environment: `OpenAI()` reads OPENAI_BASE_URL and OPENAI_API_KEY by itself;
the task (its prompt and tools) is the JSON row in GYM_GRPC_TASK_FILE; the
environment's tools run by POSTing their arguments to GYM_GRPC_TOOLS_URL/NAME.

    python example_agent.py [--api chat|responses] [--max-turns N]

`--api` (or EXAMPLE_AGENT_API) picks Chat Completions (the default) or the
Responses API. Needs the openai package (`pip install 'gym-grpc[external-agent]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from openai import OpenAI

MODEL = "gym-grpc"  # any name: the model server behind the endpoint decides


def call_tool(name: str, arguments: str, call_id: str) -> str:
    """Run a tool of the environment through gym-grpc's tools URL."""
    url = f"{os.environ['GYM_GRPC_TOOLS_URL']}/{urllib.parse.quote(name)}?call_id={urllib.parse.quote(call_id)}"
    request = urllib.request.Request(url, data=arguments.encode(), method="POST")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=600) as answer:
        return str(json.load(answer)["output"])


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content or [])


def chat_loop(client: OpenAI, params: dict[str, Any], max_turns: int) -> str:
    given = params["input"]
    if isinstance(given, str):
        messages: list[Any] = [{"role": "user", "content": given}]
    else:
        messages = [{"role": m["role"], "content": _text(m.get("content"))} for m in given if "role" in m]
    tools = [
        {
            "type": "function",
            "function": {k: t[k] for k in ("name", "description", "parameters") if k in t},
        }
        for t in params.get("tools", [])
        if t.get("type") == "function"
    ]
    options: dict[str, Any] = {"tools": tools} if tools else {}
    if "temperature" in params:
        options["temperature"] = params["temperature"]
    if "max_output_tokens" in params:  # the task's limit on each answer, in Chat Completions' name
        options["max_completion_tokens"] = params["max_output_tokens"]
    for _ in range(max_turns):
        completion = client.chat.completions.create(model=MODEL, messages=messages, **options)
        message = completion.choices[0].message
        messages.append(message.model_dump())  # sent back as the SDK gave it
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            output = call_tool(call.function.name, call.function.arguments, call.id)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return ""


def responses_loop(client: OpenAI, params: dict[str, Any], max_turns: int) -> str:
    conversation: list[Any] = params["input"]
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    options: dict[str, Any] = {"tools": params["tools"]} if params.get("tools") else {}
    for key in ("temperature", "max_output_tokens"):
        if key in params:
            options[key] = params[key]
    for _ in range(max_turns):
        response = client.responses.create(model=MODEL, input=conversation, **options)
        conversation += response.output  # the SDK's own output items, sent back as they are
        calls = [item for item in response.output if item.type == "function_call"]
        if not calls:
            return response.output_text
        for call in calls:
            output = call_tool(call.name, call.arguments, call.call_id)
            conversation.append({"type": "function_call_output", "call_id": call.call_id, "output": output})
    return ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The openai SDK in a tool-calling loop.")
    parser.add_argument("--api", choices=["chat", "responses"], default=os.environ.get("EXAMPLE_AGENT_API", "chat"))
    parser.add_argument("--max-turns", type=int, default=8)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    row = json.loads(Path(os.environ["GYM_GRPC_TASK_FILE"]).read_text())
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY, from the environment
    loop = responses_loop if args.api == "responses" else chat_loop
    print(loop(client, row["responses_create_params"], args.max_turns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
