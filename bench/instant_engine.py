"""An OpenAI-compatible engine that answers at once (or after a fixed latency),
for benchmarking model servers.

    python bench/instant_engine.py PORT_FILE [LATENCY_SECONDS]

It serves `/v1/chat/completions` in vLLM's wire format, token fields included
(byte-level ids, one log-prob per generated token; `required_prefix_token_ids`
honoured as NeMo RL's vLLM does), and `/v1/responses` in
the Responses format: with tools and no tool output yet it calls the first
tool with the capitalised words of the last user message as its first
argument; after a tool output it answers with it. A user message that asks
for "[N tool calls]" gets the tool called again until N tool outputs are in
the conversation (N + 1 model calls per rollout, deterministically). A
question "What is A + B?" with no tools is answered as \\boxed{\\frac{2(A+B)}{2}},
so that checking it is real work for math-verify. With a latency, every
answer waits that long, as a busy engine would.

For the token path it also serves, as vLLM does, `/tokenize` (messages and
tools rendered by a ChatML-like template whose tokenizer is one id per byte,
`<|im_start|>` 256 and `<|im_end|>` 257; the tools as JSON in a system block,
as tool-calling templates write them) and `/v1/completions` with a prompt of
token ids (the text, `token_ids`, `prompt_token_ids`, log-probs as
"token_id:N"). Its generation reads the same things from the prompt ids that
the chat path reads from the messages, and writes a tool call as hermes does
(`<tool_call>{"name": ..., "arguments": ...}</tool_call>`).

`GET /bench/stats` tells how many model calls it answered since the last
`POST /bench/reset` (and /tokenize calls apart) and the wall-clock time
(time.time()) of each: a benchmark times two stacks the same way from outside
them, their steady rate included.
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
from gym_grpc.testing.fake_engine import IM_END, IM_START, encode, hermes_call


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
STATS: dict = {"calls": 0, "tokenize": 0, "prefixed": 0, "first": None, "last": None, "times": []}


def _count() -> None:
    now = time.time()
    STATS["calls"] += 1
    STATS["first"] = STATS["first"] or now
    STATS["last"] = now
    STATS["times"].append(now)


def _usage(prompt: list[int], generated: list[int]) -> dict[str, int]:
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(generated),
        "total_tokens": len(prompt) + len(generated),
    }


def _json(answer: dict) -> web.Response:
    return web.Response(body=orjson.dumps(answer), content_type="application/json")


async def stats(request: web.Request) -> web.Response:
    return web.json_response(STATS)


async def reset(request: web.Request) -> web.Response:
    STATS.update(calls=0, tokenize=0, prefixed=0, first=None, last=None, times=[])
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


def _turn(user: object, outputs: int, last_output: str | None, tool: dict | None) -> tuple[str, str | None]:
    """The engine's turn, whatever the wire: (the answer, None) once the tool outputs asked for are
    in (`last_output`: the last message's, if it is a tool output), or (the tool's name, its
    arguments) to call the first tool, or (the plain answer, None) without tools."""
    if last_output is not None and outputs >= _tool_calls_wanted(user):
        return f"According to the tool: {last_output}", None
    if tool:
        return tool["name"], _tool_arguments(tool, user)
    return _plain_answer(user), None


async def chat(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    _count()
    await asyncio.sleep(LATENCY)
    messages = body["messages"]
    last = messages[-1]
    user = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
    outputs = sum(1 for m in messages if m["role"] == "tool")
    tool = body["tools"][0]["function"] if body.get("tools") else None
    content, arguments = _turn(user, outputs, last["content"] if last["role"] == "tool" else None, tool)
    calls = []
    if arguments is not None:
        function = {"name": content, "arguments": arguments}
        calls, content = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": function}], ""
    generated = _ids(content + "".join(c["function"]["arguments"] for c in calls)) + [257]
    prompt = _prompt(messages)
    prefix = body.get("required_prefix_token_ids")
    if prefix:  # as NeMo RL's vLLM: the prompt begins with these ids, the rest rendered
        STATS["prefixed"] += 1
        prompt = [*prefix, *prompt[len(prefix) :]]
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
        "usage": _usage(prompt, generated),
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
    last_output = last["output"] if last.get("type") == "function_call_output" else None
    text, arguments = _turn(user, outputs, last_output, body["tools"][0] if body.get("tools") else None)
    if arguments is None:
        output = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }
    else:
        output = {
            "type": "function_call",
            "id": f"fc_{uuid.uuid4().hex}",
            "call_id": f"call_{uuid.uuid4().hex[:12]}",
            "name": text,
            "arguments": arguments,
            "status": "completed",
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


# --- the token path: /tokenize and /v1/completions ----------------------------


def _render(messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool) -> list[int]:
    """The conversation's ids as this engine's chat template renders it (ChatML, one id per byte, the
    tools as JSON in a system block, as tool-calling templates write them): every message closed by
    `<|im_end|>` and a newline (what vllm_model's token path finds as the turn's closing)."""
    ids: list[int] = []
    if tools:  # each as vLLM's request model dumps it
        functions = [tool.get("function", tool) for tool in tools]
        dumped = [
            {"name": f["name"], "description": f.get("description"), "parameters": f.get("parameters")}
            | ({"strict": f["strict"]} if f.get("strict") is not None else {})
            for f in functions
        ]
        listed = json.dumps(dumped)
        ids += [IM_START, *encode(f"system\n<tools>{listed}</tools>"), IM_END, *encode("\n")]
    for message in messages:
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "\n".join(part.get("text", "") for part in content)
        for call in message.get("tool_calls") or []:
            name, arguments = call["function"]["name"], call["function"].get("arguments") or "{}"
            content += f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'
        ids += [IM_START, *encode(f"{message['role']}\n{content}"), IM_END, *encode("\n")]
    if add_generation_prompt:
        ids += [IM_START, *encode("assistant\n")]
    return ids


async def tokenize(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    STATS["tokenize"] += 1
    tokens = _render(body["messages"], body.get("tools"), body.get("add_generation_prompt", False))
    return _json({"count": len(tokens), "max_model_len": 1 << 20, "tokens": tokens, "token_strs": None})


TOOLS_BLOCK = re.compile(r"<tools>(.*?)</tools>", re.DOTALL)


def _generate(prompt: list[int]) -> str:
    """What the chat path would answer, read from a prompt of ids: its messages are the blocks
    between `<|im_start|>` and `<|im_end|>`, each beginning with its role."""
    messages = [block.split("\n", 1) for block in _blocks(prompt)]
    user = next((text for role, text in reversed(messages) if role == "user"), "")
    outputs = sum(1 for role, _ in messages if role == "tool")
    last_output = messages[-1][1] if messages and messages[-1][0] == "tool" else None
    tools = TOOLS_BLOCK.search(messages[0][1]) if messages and messages[0][0] == "system" else None
    text, arguments = _turn(user, outputs, last_output, json.loads(tools.group(1))[0] if tools else None)
    return text if arguments is None else hermes_call(text, arguments)


def _blocks(prompt: list[int]) -> list[str]:
    """The text of every closed message of a prompt (`<|im_start|>ROLE\nTEXT<|im_end|>`)."""
    blocks, current = [], None
    for token in prompt:
        if token == IM_START:
            current = []
        elif token == IM_END and current is not None:
            blocks.append(bytes(current).decode("utf-8", "replace"))
            current = None
        elif current is not None and token < 256:
            current.append(token)
    return [b if "\n" in b else b + "\n" for b in blocks]


async def completions(request: web.Request) -> web.Response:
    body = orjson.loads(await request.read())
    _count()
    await asyncio.sleep(LATENCY)
    prompt = body["prompt"]
    text = _generate(prompt)
    generated = [*encode(text), IM_END]
    choice: dict = {"index": 0, "text": text, "finish_reason": "stop", "stop_reason": None}
    if body.get("logprobs") is not None:
        choice["logprobs"] = {
            "tokens": [f"token_id:{t}" for t in generated],
            "token_logprobs": [-0.1] * len(generated),
            "top_logprobs": None,
            "text_offset": list(range(len(generated))),
        }
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = prompt
        choice["token_ids"] = generated
    return _json(
        {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": body.get("model"),
            "choices": [choice],
            "usage": _usage(prompt, generated),
        }
    )


async def main(port_file: str) -> None:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/responses", responses)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/tokenize", tokenize)
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
