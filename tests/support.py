"""Parts shared by the tests: a scripted model server, a small calculator
environment, and builders for items and tasks."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path

from gym_grpc.model import ModelServer
from gym_grpc.resources import ResourcesServer, Session, Verification, tool
from gym_grpc.responses import assistant_message, final_text, input_items, message_text, new_id
from gym_grpc.rpc.registry import Registry
from gym_grpc.server.serving import Running
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

REPO = Path(__file__).resolve().parent.parent


def call(name: str, arguments: str) -> r.Item:
    """A function_call item as a model would emit it."""
    return r.Item(
        function_call=r.FunctionCall(
            id=new_id("fc"), call_id=new_id("call"), name=name, arguments=arguments, status=r.ITEM_STATUS_COMPLETED
        )
    )


Turn = Sequence[r.Item] | Callable[[r.CreateParams], r.Response]


class ScriptedModel(ModelServer):
    """Answers the n-th call with the n-th turn (the last one repeats); records every request."""

    def __init__(self, turns: Sequence[Turn], **kwargs) -> None:
        super().__init__(name="model", **kwargs)
        self.turns = list(turns)
        self.requests: list[r.CreateParams] = []

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        copy = r.CreateParams()
        copy.CopyFrom(params)
        self.requests.append(copy)
        turn = self.turns[min(len(self.requests), len(self.turns)) - 1]
        if callable(turn):
            return turn(params)
        return r.Response(
            id=new_id("resp"),
            model="scripted",
            status=r.RESPONSE_STATUS_COMPLETED,
            output=list(turn),
            usage=r.Usage(input_tokens=10, output_tokens=5, total_tokens=15),
        )


class Calculator(ResourcesServer):
    """Tools that add, count calls in the session, and fail in the two ways tools fail."""

    async def seed_session(self, session: Session) -> None:
        session.state["calls"] = 0

    @tool
    async def add(self, a: int, b: int, session: Session) -> int:
        """Add two integers."""
        session.state["calls"] += 1
        return a + b

    @tool
    async def explode(self) -> str:
        """Always fails."""
        raise ValueError("the calculator caught fire")

    async def verify(self, session: Session, response: r.Response) -> Verification:
        expected = str(session.data.get("expected_answer"))
        return Verification(
            reward=1.0 if expected in final_text(response) else 0.0,
            fields={"tool_calls_seen": session.state.get("calls", -1)},
        )


def task(text: str, **data) -> task_pb2.Task:
    """A task with one user message, the calculator's tools and `data`."""
    t = task_pb2.Task()
    params = t.responses_create_params
    params.input_items.items.add().message.CopyFrom(r.Message(role=r.ROLE_USER, text=text))
    for spec in Calculator.tools.values():
        params.tools.add().function.CopyFrom(spec.schema)
    t.data.update(data)
    return t


def nested_json(levels: int) -> str:
    """JSON text of `levels` objects, each inside the one before: the most a Struct pays per level."""
    return '{"a": ' * levels + "1" + "}" * levels


def say(text: str) -> list[r.Item]:
    """A turn that is one assistant message."""
    return [assistant_message(text)]


def static_registry(**servers: Running) -> Registry:
    """A Registry that knows the given servers by keyword name."""
    return Registry(static={name: s.address for name, s in servers.items()})


class EchoModel(ScriptedModel):
    """Answers with the prompt after `delay` s; fails on prompts containing "fail";
    counts concurrent and cancelled calls."""

    def __init__(self, delay: float = 0.01):
        super().__init__([])
        self.delay = delay
        self.active = self.peak = self.cancelled = 0

    async def create_response(self, params, session_id):
        self.requests.append(params)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay)
            text = message_text(input_items(params)[-1].message)
            if "fail" in text:
                raise RuntimeError("engine exploded")
            return r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=say(text))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1
