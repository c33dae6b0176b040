"""The simple agent: the multi-turn tool loop.

Call the model; run every function call it made against the resources
server, in order, and feed the outputs back; repeat until the model answers
without calling a tool, its output is cut short, or `max_steps` model calls
were made. Then verify and close the session. (A stateless environment,
as DescribeTools says, gets no SeedSession and CloseSession.) A tool's failure (unknown tool,
arguments that are not JSON, an exception in the tool) goes back to the
model as the tool's output; only a failing server fails the rollout.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from pydantic import Field

from gym_grpc import errors
from gym_grpc.agent import AgentServer, RolloutEvents
from gym_grpc.client.stubs import ModelClient, ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import function_calls, input_items, new_id, tool_error_output
from gym_grpc.server.serving import ServerConfig
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

log = logging.getLogger("gym_grpc.simple_agent")

#: Seconds a session close may take; it runs even when the rollout failed.
CLOSE_TIMEOUT = 5.0


class SimpleAgentConfig(ServerConfig):
    model_server: str = Field(description="name of the model server to call")
    resources_server: str = Field(description="name of the resources server (environment)")
    max_steps: int = Field(10, ge=1, description="most model calls in one rollout")


def _add_usage(total: r.Usage, usage: r.Usage) -> None:
    total.input_tokens += usage.input_tokens
    total.output_tokens += usage.output_tokens
    total.total_tokens += usage.total_tokens
    total.input_tokens_details.cached_tokens += usage.input_tokens_details.cached_tokens
    total.input_tokens_details.cache_write_tokens += usage.input_tokens_details.cache_write_tokens
    total.output_tokens_details.reasoning_tokens += usage.output_tokens_details.reasoning_tokens


class SimpleAgent(AgentServer):
    Config = SimpleAgentConfig
    config: SimpleAgentConfig

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.model = ModelClient(self.registry, self.config.model_server)
        self.resources = ResourcesClient(self.registry, self.config.resources_server)
        self._stateless: bool | None = None
        self._describing = asyncio.Lock()

    async def _environment_is_stateless(self) -> bool:
        """Asked once: a stateless environment needs no SeedSession and CloseSession."""
        if self._stateless is None:
            async with self._describing:
                if self._stateless is None:
                    self._stateless = (await self.resources.describe_tools()).stateless
        return self._stateless

    def references(self) -> dict[str, str]:
        return {"model": self.config.model_server, "resources": self.config.resources_server}

    async def run(self, task: task_pb2.Task, events: RolloutEvents, *, verify: bool = True) -> task_pb2.Rollout:
        started = time.monotonic()
        session_id = uuid.uuid4().hex
        stateful = not await self._environment_is_stateless()
        if stateful:
            await self.resources.seed_session(session_id, task)
        try:
            rollout = await self._rollout(session_id, task, events, verify)
        finally:
            if stateful:
                try:
                    await self.resources.close_session(session_id, timeout=CLOSE_TIMEOUT)
                except errors.GymError as e:
                    log.warning("could not close session %s: %s", session_id, e.message)
        rollout.timings.total_seconds = time.monotonic() - started
        return rollout

    async def _rollout(
        self, session_id: str, task: task_pb2.Task, events: RolloutEvents, verify: bool
    ) -> task_pb2.Rollout:
        # Built in place: the request is sent every turn and grows, and copying it,
        # the final response or the timings again would cost per turn and per rollout.
        request = model_pb.CreateResponseRequest(session_id=session_id)
        params = request.params
        params.CopyFrom(task.responses_create_params)
        if params.WhichOneof("input") == "input_text":
            params.input_items.items.extend(input_items(params))  # replaces the text
        conversation = params.input_items.items
        rollout = task_pb2.Rollout(stop_reason=task_pb2.STOP_REASON_MAX_STEPS)
        final, timings = rollout.response, rollout.timings
        final.status = r.RESPONSE_STATUS_COMPLETED
        step = 0
        for step in range(self.config.max_steps):
            began = time.monotonic()
            response = await self.model.send(request)
            seconds = time.monotonic() - began
            timings.model_seconds += seconds
            events.model_call(step, response, seconds)
            if step == 0:
                final.CopyFrom(response)  # the model's envelope: id, echoed parameters, keys we do not model
            else:
                final.model, final.status = response.model, response.status
                _add_usage(final.usage, response.usage)
                final.output.extend(response.output)
            conversation.extend(response.output)
            if response.status == r.RESPONSE_STATUS_INCOMPLETE:
                final.incomplete_details.CopyFrom(response.incomplete_details)
                rollout.stop_reason = task_pb2.STOP_REASON_INCOMPLETE
                break
            calls = function_calls(response)
            if not calls:
                rollout.stop_reason = task_pb2.STOP_REASON_FINAL_MESSAGE
                break
            for call in calls:
                began = time.monotonic()
                result = await self.resources.call_tool(session_id, call)
                seconds = time.monotonic() - began
                timings.tools_seconds += seconds
                output = r.FunctionCallOutput(
                    id=new_id("fco"),
                    call_id=call.call_id,
                    output=tool_error_output(result.output) if result.error else result.output,
                    status=r.ITEM_STATUS_COMPLETED,
                )
                events.tool_call(step, call, output, result.error, seconds)
                item = r.Item(function_call_output=output)
                final.output.append(item)
                conversation.append(item)
        rollout.model_calls = step + 1
        if not verify:
            rollout.verification_skipped = True
            return rollout
        began = time.monotonic()
        verdict = await self.resources.verify(session_id, task, final)
        timings.verify_seconds = time.monotonic() - began
        fields_json = rows.json_text(verdict, "fields")  # passed on as text, never parsed here
        events.verification(verdict.reward, fields_json, timings.verify_seconds, verdict.reward_components)
        rollout.reward = verdict.reward
        rollout.verifier_fields_json = fields_json
        rollout.reward_components.update(verdict.reward_components)
        return rollout
