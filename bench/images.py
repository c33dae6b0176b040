"""Bytes on the wire for a screenshot rollout: `python bench/run.py --only images`.

The rollout: the browser environment's enter-text page in Debian's headless Chromium, with
`screenshot_after_action` (each action's output ends with a screenshot of the page after it); a
policy that clicks the text box, then types one character a turn: `turns` actions, `turns`
screenshots, all different, then its final message.

gym-grpc: the rollout through real gRPC servers (the simple agent, the policy as a model server, the
browser environment) with a counting TCP relay in front of each: every byte each way on each link
(HTTP/2 frames and headers included), for the collector <-> agent, agent <-> model server and
agent <-> environment links.

NeMo Gym: the same rollout as NeMo Gym 0.7.0's simple agent sends it (responses_api_agents/
simple_agent/app.py, `run` and `_create_episode`), in its JSON, built from this rollout's own items:
/run with the task row; /seed_session with the row; the agent's /v1/responses to itself; at every
turn POST /v1/responses to the model server with the whole conversation so far (every earlier
screenshot as a base64 data URL) and its answer; each tool call's arguments and output; /verify with
the row and the whole response, answered with both and the reward; the run's answer, that again.
Bodies only: NeMo Gym's HTTP headers are not counted (in its favour), gym-grpc's are.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from typing import Any

from gym_grpc import images
from gym_grpc.bundled.servers.agents.simple_agent.agent import SimpleAgent
from gym_grpc.bundled.servers.resources.browser import tasks
from gym_grpc.bundled.servers.resources.browser.server import BrowserEnv
from gym_grpc.client.stubs import AgentClient
from gym_grpc.data import rows
from gym_grpc.model import ModelServer
from gym_grpc.responses import assistant_message, input_items, new_id, new_response
from gym_grpc.rpc.registry import Registry
from gym_grpc.testing.servers import Servers
from gym_grpc.v1 import responses_pb2 as r

TEXT = "screenshots"


class _Relay:
    """A TCP relay to `target` on a free loopback port, counting the bytes each way."""

    def __init__(self, target: str) -> None:
        self.host, port = target.rsplit(":", 1)
        self.port = int(port)
        self.up = self.down = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(self.host, self.port)

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, up: bool) -> None:
            try:
                while data := await source.read(65536):
                    if up:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                    sink.write(data)
                    await sink.drain()
            finally:
                sink.close()

        await asyncio.gather(pipe(reader, upstream_writer, True), pipe(upstream_reader, writer, False))

    @property
    def total(self) -> int:
        return self.up + self.down


class _TypingPolicy(ModelServer):
    """Clicks the text box, then types one character of TEXT a turn, `turns` actions in all; then says done."""

    def __init__(self, turns: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.turns = turns

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        response = new_response(params, "typing-policy")
        response.status = r.RESPONSE_STATUS_COMPLETED
        done = sum(1 for i in input_items(params) if i.WhichOneof("item") == "function_call_output")
        if done >= self.turns:
            response.output.append(assistant_message("Done."))
            return response
        name, arguments = ("click", {"x": 120, "y": 74}) if done == 0 else ("type_text", {"text": TEXT[done - 1]})
        call = r.FunctionCall(id=new_id("fc"), call_id=new_id("call"), name=name, arguments=json.dumps(arguments))
        response.output.append(r.Item(function_call=call))
        return response


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def nemo_gym_bytes(row: dict[str, Any], rollout_row: dict[str, Any], turns: list[dict[str, Any]]) -> dict[str, int]:
    """The body bytes NeMo Gym's simple agent sends and receives for this rollout, by link (see the module)."""
    params = row["responses_create_params"]
    response = rollout_row["response"]
    verify_request = {**row, "response": response}
    verify_response = {**verify_request, "reward": rollout_row["reward"]}
    model = tools = 0
    conversation = list(params["input"])
    for turn in turns:  # each: the model's answer, then the outputs of its tool calls
        model += _json_size({**params, "input": conversation}) + _json_size(turn["response"])
        conversation += turn["response"]["output"]
        for call, output in zip(turn["calls"], turn["outputs"], strict=True):
            tools += len(call["arguments"].encode()) + _json_size(output["output"])
            conversation.append(output)
    environment = _json_size(row) + tools + _json_size(verify_request) + _json_size(verify_response)
    # The run: its request and answer, and the agent's /v1/responses to itself (the parameters, the whole response).
    collector = _json_size(row) + _json_size(verify_response) + _json_size(params) + _json_size(response)
    return {"collector_agent": collector, "agent_model": model, "agent_environment": environment}


def _turns(rollout_row: dict[str, Any]) -> list[dict[str, Any]]:
    """The rollout's model turns, each with its calls and their outputs (as JSON items)."""
    found: list[dict[str, Any]] = []
    for item in rollout_row["response"]["output"]:
        if item["type"] == "function_call_output":
            found[-1]["outputs"].append(item)
            continue
        if not found or found[-1]["outputs"]:
            found.append({"response": {"output": []}, "calls": [], "outputs": []})
        found[-1]["response"]["output"].append(item)
        if item["type"] == "function_call":
            found[-1]["calls"].append(item)
    return found


async def _one(turns: int) -> dict[str, Any]:
    async with Servers() as servers:
        policy = await servers.start(_TypingPolicy(turns, name="policy"))
        browser = await servers.start(BrowserEnv({"screenshot_after_action": True}, name="browser"))
        relays = {"agent_model": _Relay(policy.address), "agent_environment": _Relay(browser.address)}
        static = {"policy": await relays["agent_model"].start(), "browser": await relays["agent_environment"].start()}
        config = {"model_server": "policy", "resources_server": "browser", "max_steps": turns + 2}
        agent = await servers.start(SimpleAgent(config, name="agent", registry=Registry(static=static)))
        relays["collector_agent"] = _Relay(agent.address)
        client = AgentClient(Registry(static={"agent": await relays["collector_agent"].start()}), "agent")
        page = next(p for p in tasks.pages() if p.name == "enter-text")
        row = tasks.task_rows(BrowserEnv.tool_definitions())[tasks.pages().index(page)]
        rollout = await client.run(rows.task_from_row(row))
        await client.close()  # its last word to the agent says it has the result: the session closes
        await client.registry.close()
        await agent.app.registry.close()
        for relay in relays.values():
            assert relay.server is not None
            relay.server.close()
    shots = [image for _, image in images.images_in(rollout.response.output)]
    assert len(shots) == turns and all(image.data for image in shots), "every screenshot by value, each a new one"
    response_json = rows.response_to_json(rollout.response)
    rollout_row = {"response": response_json, "reward": rollout.reward}
    return {
        "screenshots": len(shots),
        "screenshot_bytes_mean": round(statistics.mean(len(image.data) for image in shots)),
        "gym_grpc": {name: relay.total for name, relay in relays.items()},
        "nemo_gym": nemo_gym_bytes(row, rollout_row, _turns(rollout_row)),
        "image_bytes": sum(len(image.data) for image in shots),
    }


def bench_images(turns: int = 10) -> dict[str, Any]:
    result = asyncio.run(_one(turns))
    ours, theirs = result["gym_grpc"], result["nemo_gym"]
    ours["total"], theirs["total"] = sum(ours.values()), sum(theirs.values())
    result["ratio"] = {link: round(theirs[link] / ours[link], 2) for link in ours}
    # What any design that shows the model each picture once and writes it in the row once must move:
    # each screenshot environment -> agent, agent -> model server, agent -> collector.
    result["floor_bytes"] = 3 * result["image_bytes"]
    result["turns"] = turns
    return result
