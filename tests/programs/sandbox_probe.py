"""An agent program that checks where it runs (the external agent's `in_sandbox` test), then works.

It exits 3 unless its host is the sandbox, 4 if it can reach a listener the test
opened on the host's loopback (PROBE_PORT), 5 if it can read a host file the test
wrote (PROBE_SECRET). Then it runs a plain tool loop with the openai SDK at its
OPENAI_BASE_URL, each tool call POSTed to GYM_GRPC_TOOLS_URL, until the model answers.
"""

import json
import os
import socket
import urllib.request

from openai import OpenAI


def main() -> int:
    if socket.gethostname() != "sandbox":
        return 3
    try:
        socket.create_connection(("127.0.0.1", int(os.environ["PROBE_PORT"])), timeout=5).close()
        return 4
    except OSError:
        pass
    if os.path.exists(os.environ["PROBE_SECRET"]):
        return 5
    with open(os.environ["GYM_GRPC_TASK_FILE"]) as f:
        params = json.load(f)["responses_create_params"]
    messages = [{"role": m["role"], "content": m["content"]} for m in params["input"]]
    tools = [
        {"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
        for t in params["tools"]
    ]
    client = OpenAI()
    for _ in range(4):
        message = client.chat.completions.create(model="gym-grpc", messages=messages, tools=tools).choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return 0
        for call in message.tool_calls:
            url = f"{os.environ['GYM_GRPC_TOOLS_URL']}/{call.function.name}?call_id={call.id}"
            request = urllib.request.Request(url, data=call.function.arguments.encode(), method="POST")
            with urllib.request.urlopen(request, timeout=120) as answer:
                output = json.load(answer)["output"]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": output})
    return 0
