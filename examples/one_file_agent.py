"""An agent in one file: the tool loop with a system prompt of its own, and a last
step on which the model may not call tools, so that every rollout ends in an answer.

ToolLoopAgent (gym_grpc.agent) runs the loop: model, tools, model, ..., verify.
An agent overrides its hooks: `first_request` edits the first model request,
`call_model` makes each model call, `call_tool` each tool call.

    gym-grpc run examples/one_file.yaml        # with the one-file environment
"""

from __future__ import annotations

from pydantic import Field

from gym_grpc.agent import ToolLoopAgent, ToolLoopConfig
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2


class FirmConfig(ToolLoopConfig):
    system_prompt: str = Field(
        "Use the tools when they help, then answer in one sentence.", description="sent before the task's input"
    )


class FirmAgent(ToolLoopAgent):
    Config = FirmConfig
    config: FirmConfig

    def first_request(self, request: model_pb.CreateResponseRequest, task: task_pb2.Task) -> None:
        system = r.Item(message=r.Message(role=r.ROLE_SYSTEM, text=self.config.system_prompt))
        request.params.input_items.items.insert(0, system)

    async def call_model(self, request: model_pb.CreateResponseRequest, step: int) -> r.Response:
        if step == self.config.max_steps - 1:  # the last call: answer now, no more tools
            request.params.tool_choice.mode = r.TOOL_CHOICE_MODE_NONE
        return await super().call_model(request, step)
