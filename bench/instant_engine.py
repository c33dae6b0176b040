"""An OpenAI-compatible engine that answers at once (or after a fixed latency),
for benchmarking model servers.

    python bench/instant_engine.py PORT_FILE [LATENCY_SECONDS]

It serves `/v1/chat/completions` in vLLM's wire format, token fields included
(byte-level ids, one log-prob per generated token), and `/v1/responses` in
the Responses format: with tools and no tool output yet it calls the first
tool with the capitalised words of the last user message as its first
argument; after a tool output it answers with it. A user message that asks
for "[N tool calls]" gets the tool called again until N tool outputs are in
the conversation (N + 1 model calls per rollout, deterministically). A
question "What is A + B?" with no tools is answered as \\boxed{\\frac{2(A+B)}{2}},
so that checking it is real work for math-verify. With a latency, every
answer waits that long, as a busy engine would.

`GET /bench/stats` tells how many model calls it answered since the last
`POST /bench/reset`, and the wall-clock time (time.time()) of the first and the
last: a benchmark times two stacks the same way from outside them.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
import uuid

import orjson
from aiohttp import web

from gym_grpc.rpc import event_loop


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _prompt(messages: list[dict]) -> list[int]:
    """ChatML-like; an assistant turn renders as it was generated, so prompts extend earlier turns."""
    ids: list[int] = []
    for message in messages:
        text = message.get("content") or ""
        text += "".join(c["function"]["arguments"] for c in message.get("tool_calls") or [])
        ids += [256, *_ids(f"{message['role']}\n{text}"), 257]
    return ids + [256, *_ids("assistant\n")]


LATENCY = 0.0
STATS: dict = {"calls": 0, "first": None, "last": None}


def _count() -> None:
    now = time.time()
    STATS["calls"] += 1
    STATS["first"] = STATS["first"] or now
    STATS["last"] = now


def _json(answer: dict) -> web.Response:
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def stats(request: web.Request) -> web.Response:
    return web.json_response(STATS)


async def reset(request: web.Request) -> web.Response:
    STATS.update(calls=0, first=None, last=None)
    return web.json_response(STATS)


TOOL_CALLS = re.compile(r"\[(\d+) tool calls?\]")
SUM = re.compile(r"(\d+) \+ (\d+)")


def _tool_calls_wanted(user: object) -> int:
    """How many tool outputs the conversation needs before the answer: "[N tool calls]", else 1."""
    match = TOOL_CALLS.search(str(user))
    return int(match.group(1)) if match else 1


def _plain_answer(user: object) -> str:
    """The answer to a question without tools: a sum in LaTeX that math-verify must simplify."""
    match = SUM.search(str(user))
    if match is None:
        return "I do not know."
    total = int(match.group(1)) + int(match.group(2))
    return f"Adding them up gives \\boxed{{\\frac{{{2 * total}}}{{2}}}}."


def _tool_arguments(tool: dict, user: object) -> str:
    """The capitalised words of the user's message as the tool's first argument."""
    words = re.findall(r"\b[A-Z][a-z]+(?:\s+[A-Z][a-z]+)*", str(user)[1:])
    argument = next(iter(tool.get("parameters", {}).get("properties", {})), "query")
    return json.dumps({argument: words[-1] if words else ""})


async def chat(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    _count()
    await asyncio.sleep(LATENCY)
    messages = body["messages"]
    last = messages[-1]
    user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    outputs = sum(1 for m in messages if m["role"] == "tool")
    calls = []
    if last["role"] == "tool" and outputs >= _tool_calls_wanted(user):
        content = f"According to the tool: {last['content']}"
    elif body.get("tools"):
        tool = body["tools"][0]["function"]
        calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:12]}",
                "type": "function",
                "function": {"name": tool["name"], "arguments": _tool_arguments(tool, user)},
            }
        ]
        content = ""
    else:
        content = _plain_answer(user)
    generated = _ids(content + "".join(c["function"]["arguments"] for c in calls)) + [257]
    prompt = _prompt(messages)
    choice: dict = {
        "index": 0,
        "finish_reason": "tool_calls" if calls else "stop",
        "message": {"role": "assistant", "content": content or None, "tool_calls": calls},
    }
    answer: dict = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": body.get("model"),
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(generated),
            "total_tokens": len(prompt) + len(generated),
        },
    }
    if body.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": f"token_id:{t}", "logprob": -0.1} for t in generated]}
    if body.get("return_token_ids"):
        answer["prompt_token_ids"] = prompt
        choice["token_ids"] = generated
    return _json(answer)


async def responses(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    _count()
    await asyncio.sleep(LATENCY)
    items = body["input"] if isinstance(body["input"], list) else [{"role": "user", "content": body["input"]}]
    last = items[-1]
    user = next((i.get("content") for i in reversed(items) if i.get("role") == "user"), "")
    outputs = sum(1 for i in items if i.get("type") == "function_call_output")
    if last.get("type") == "function_call_output" and outputs >= _tool_calls_wanted(user):
        output = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": f"According to the tool: {last['output']}", "annotations": []}],
        }
    elif body.get("tools"):
        tool = body["tools"][0]
        output = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": f"call_{uuid.uuid4().hex[:12]}",
            "name": tool["name"],
            "arguments": _tool_arguments(tool, user),
            "status": "completed",
        }
    else:
        output = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": _plain_answer(user), "annotations": []}],
        }
    return _json(
        {
            "id": f"resp_{uuid.uuid4().hex}",
            "object": "response",
            "created_at": int(time.time()),
            "model": body.get("model"),
            "status": "completed",
            "output": [output],
            "usage": {"input_tokens": 50, "output_tokens": 10, "total_tokens": 60},
        }
    )


async def main(port_file: str) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/bench/stats", stats)
    app.router.add_post("/bench/reset", reset)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=8192)
    await site.start()
    with open(port_file, "w") as f:
        f.write(str(site._server.sockets[0].getsockname()[1]))  # type: ignore[union-attr]
    await asyncio.Event().wait()


if __name__ == "__main__":
    if len(sys.argv) > 2:
        LATENCY = float(sys.argv[2])
    event_loop.run(main(sys.argv[1]))
