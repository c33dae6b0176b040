"""Two policies for the browser environment that need no model, as model servers: the scripted one
takes the task's known solution (from its page, found by the instruction in the conversation),
looking at a screenshot before each action; the idle one (`act: false`) does nothing and says so.
The scripted one must score 1 on every task and the idle one 0 (servers/resources/browser/tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import Field

from gym_grpc.model import ModelServer
from gym_grpc.responses import assistant_message, input_items, message_text, new_id, new_response
from gym_grpc.server.serving import ServerConfig
from gym_grpc.v1 import responses_pb2 as r

from .tasks import TASKS_DIR, TaskPage, pages


class ScriptedPolicyConfig(ServerConfig):
    act: bool = Field(True, description="false: the idle policy, which ends every rollout without acting")
    tasks_dir: str = Field(str(TASKS_DIR), description="the browser environment's task pages")


class ScriptedBrowserPolicy(ModelServer):
    Config = ScriptedPolicyConfig
    config: ScriptedPolicyConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pages = pages(Path(self.config.tasks_dir))

    def _page(self, params: r.CreateParams) -> TaskPage:
        items = input_items(params)
        asked = next((message_text(i.message) for i in items if i.WhichOneof("item") == "message"), "")
        for page in self.pages:
            if asked.startswith(page.instruction):
                return page
        raise ValueError(f"no task page has the instruction {asked[:80]!r}")

    async def create_response(self, params: r.CreateParams, session_id: str) -> r.Response:
        response = new_response(params, "scripted-browser-policy")
        response.status = r.RESPONSE_STATUS_COMPLETED
        done = sum(1 for i in input_items(params) if i.WhichOneof("item") == "function_call_output")
        # The plan: a screenshot, then an action, for each step of the solution; then the final message.
        plan = [call for step in self._page(params).solution for call in (("screenshot", {}), step)]
        if not self.config.act or done >= len(plan):
            response.output.append(assistant_message("Done." if self.config.act else "I will not do anything."))
            return response
        name, arguments = plan[done]
        call = r.FunctionCall(id=new_id("fc"), call_id=new_id("call"), name=name, arguments=json.dumps(arguments))
        call.status = r.ITEM_STATUS_COMPLETED
        response.output.append(r.Item(function_call=call))
        return response
