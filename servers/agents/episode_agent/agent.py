"""The episode agent: episodes with several roles, each played by a model server of its own.

The environment runs the episode (docs/episodes.md): SeedSession answers
with its roles and the first turn, and each EndTurn with the next turn, or
with none when the episode is over. The agent keeps one conversation per
role, opened with the role's own opening (else the task's input), and for the
role whose turn it is: adds what the environment shows it, then runs the
usual tool loop (call the role's model; run the tools it called on the
session, in order, and feed the outputs back) until the model answers without
a tool call, and hands that answer to EndTurn. Then Verify scores the episode,
with a reward per role.

    episode_agent:
      entrypoint: servers/agents/episode_agent/agent.py:EpisodeAgent
      config:
        resources_server: tictactoe
        model_server: policy                        # plays every role (self-play)...
        role_model_servers: {player_1: opponent}    # ...but these
        max_steps: 40                               # model calls in the whole episode
        max_steps_per_turn: 4                       # model calls in one role's turn

The rollout holds every role's items in `response.output` in the order they
happened, and `roles` says which are whose (RolloutRole.items), with each
role's model server, model calls and reward; `collect` writes them as the
row's "roles", and the training samples come out per role.

A model output cut short ends its role's turn like an answer (the
environment judges what it got). Reaching `max_steps_per_turn` ends the
turn with the last response; reaching `max_steps` ends the episode
(stop reason max_steps) and it is verified as it stands. With
`max_rollout_tokens` each role's trajectory has that budget of tokens after
its prompt (the role's own usage: what it generated, its tools' outputs and
what the environment showed it), as a trainer cuts each role's sample: the
role's calls are capped to what is left, and a call cut at that cap, tool
calls past it, or a turn that would begin with nothing left end the episode
(stop reason token_budget), verified as it stands. The agent cannot
resume an episode (Capabilities.resumable_rollouts is false): a durable
run of one starts again from its prompt.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import Field

from gym_grpc import errors
from gym_grpc.agent import AgentConfig, AgentServer, RolloutEvents, add_usage, tool_call_output
from gym_grpc.client import stubs
from gym_grpc.client.stubs import ModelClient, ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import function_calls, input_items
from gym_grpc.token_budget import TokenBudget
from gym_grpc.v1 import model_service_pb2 as model_pb
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2


class EpisodeAgentConfig(AgentConfig):
    model_server: str = Field(description="the model server that plays every role not in role_model_servers")
    role_model_servers: dict[str, str] = Field(
        default_factory=dict, description="role name -> the model server that plays it (the others: model_server)"
    )
    resources_server: str = Field(description="name of the resources server that runs the episodes")
    max_steps: int = Field(40, ge=1, description="most model calls in one episode, over every role")
    max_steps_per_turn: int = Field(4, ge=1, description="most model calls in one role's turn")
    model_call_timeout_seconds: float | None = Field(
        None,
        gt=0,
        description="most seconds one model call may take; null: what is left of the rollout's deadline "
        f"({stubs.DEFAULT_TIMEOUT:g} s when the rollout has none)",
    )
    max_rollout_tokens: int | None = Field(
        None,
        ge=1,
        description="most tokens of each role's trajectory after its prompt (generated and tool outputs and what "
        "the environment showed it, as the model's usage counts them), as a trainer cuts each role's sample: a "
        "role's model calls are capped to what its budget has left, and the episode ends (stop reason "
        "token_budget) when a call is cut at that cap or a role's budget is used up; null: no budget",
    )


@dataclass
class _Role:
    """One role's side of the episode: its model, its conversation (the request it grows) and its record."""

    record: task_pb2.RolloutRole
    model: ModelClient
    request: model_pb.CreateResponseRequest
    #: It opens with the environment's items for it, not the task's input.
    own_opening: bool
    #: What is left of its trajectory's tokens (max_rollout_tokens), None without a budget.
    budget: TokenBudget | None = None


class EpisodeAgent(AgentServer):
    Config = EpisodeAgentConfig
    config: EpisodeAgentConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        timeout = self.config.model_call_timeout_seconds
        self.models = {
            name: ModelClient(self.registry, name, timeout=timeout)
            for name in {self.config.model_server, *self.config.role_model_servers.values()}
        }
        self.resources = ResourcesClient(self.registry, self.config.resources_server)

    def references(self) -> dict[str, str]:
        refs = {"model": self.config.model_server, "resources": self.config.resources_server}
        refs.update({f"model:{role}": server for role, server in self.config.role_model_servers.items()})
        return refs

    async def run(self, task: task_pb2.Task, events: RolloutEvents, *, verify: bool = True) -> task_pb2.Rollout:
        started = time.monotonic()
        session_id = uuid.uuid4().hex
        try:  # a seed cut off by the deadline may still have opened the session: closed either way
            episode = await self.resources.seed_session(session_id, task)
            if episode is None:
                raise errors.FailedPrecondition(
                    f"environment {self.resources.name!r} opened no episode with several roles: "
                    "serve it with the simple agent",
                    reason=errors.Reason.EPISODE_TURN_INVALID,
                )
            rollout = await self._episode(session_id, task, episode, events)
            if verify:
                await self._verify(session_id, task, rollout, events)
            else:
                rollout.verification_skipped = True
        finally:
            await self.close_session(self.resources, session_id)
        rollout.timings.total_seconds = time.monotonic() - started
        return rollout

    def _roles(self, session_id: str, task: task_pb2.Task, episode: res_pb.Episode) -> dict[str, _Role]:
        unknown = set(self.config.role_model_servers) - {role.name for role in episode.roles}
        if unknown:
            raise errors.FailedPrecondition(
                f"config role_model_servers names {', '.join(map(repr, sorted(unknown)))}, not a role of "
                f"{self.resources.name!r}'s episode ({', '.join(role.name for role in episode.roles)})",
                reason=errors.Reason.EPISODE_TURN_INVALID,
            )
        roles = {}
        for spec in episode.roles:
            server = self.config.role_model_servers.get(spec.name, self.config.model_server)
            # Each role's model session is its own: a model server keeps one conversation per session.
            request = model_pb.CreateResponseRequest(session_id=f"{session_id}/{spec.name}")
            request.params.CopyFrom(task.responses_create_params)
            if spec.without_tools:
                request.params.ClearField("tools")
                request.params.ClearField("tool_choice")
            opening = list(spec.opening) or input_items(request.params)
            conversation = request.params.input_items.items  # also replaces a plain-text input
            del conversation[:]
            conversation.extend(opening)
            record = task_pb2.RolloutRole(name=spec.name, model_server=server)
            budget = TokenBudget.of(self.config.max_rollout_tokens, request.params, server)
            roles[spec.name] = _Role(record, self.models[server], request, bool(spec.opening), budget)
        return roles

    async def _episode(
        self, session_id: str, task: task_pb2.Task, episode: res_pb.Episode, events: RolloutEvents
    ) -> task_pb2.Rollout:
        rollout = task_pb2.Rollout(stop_reason=task_pb2.STOP_REASON_EPISODE_OVER)
        rollout.response.status = r.RESPONSE_STATUS_COMPLETED
        roles = self._roles(session_id, task, episode)
        for each in roles.values():  # the openings of their own come first, each its role's
            self._add(rollout, each, list(each.request.params.input_items.items) if each.own_opening else [], False)
        turn: res_pb.EpisodeTurn | None = episode.turn
        while turn is not None:
            role = roles.get(turn.role)
            if role is None:
                raise errors.FailedPrecondition(
                    f"environment {self.resources.name!r} gave the turn to {turn.role!r}, not one of its roles "
                    f"({', '.join(roles)})",
                    reason=errors.Reason.EPISODE_TURN_INVALID,
                )
            self._add(rollout, role, turn.input)
            response, stop = await self._turn(session_id, role, rollout, events)
            if stop is not None:
                rollout.stop_reason = stop
                break
            assert response is not None  # a turn that was not stopped made at least one call
            turn = await self.resources.end_turn(session_id, role.record.name, response)
        rollout.roles.extend(each.record for each in roles.values())
        return rollout

    async def _turn(
        self, session_id: str, role: _Role, rollout: task_pb2.Rollout, events: RolloutEvents
    ) -> tuple[r.Response | None, task_pb2.StopReason.ValueType | None]:
        """One turn of `role`: the tool loop, up to max_steps_per_turn model calls. Its last response, and
        the reason the episode stops when it does here: the episode's max_steps ran out, or the role's
        token budget (then the turn is not handed to the environment)."""
        response = None
        budget = role.budget
        for _ in range(self.config.max_steps_per_turn):
            step = rollout.model_calls
            if step == self.config.max_steps:
                return response, task_pb2.STOP_REASON_MAX_STEPS
            if budget is not None:
                if budget.spent:  # what the environment showed the role since its last call filled it
                    return response, task_pb2.STOP_REASON_TOKEN_BUDGET
                role.request.params.max_output_tokens = budget.limit()
            began = time.monotonic()
            response = await role.model.send(role.request)
            seconds = time.monotonic() - began
            events.model_call(step, response, seconds)
            _take(rollout, response, seconds)
            role.record.model_calls += 1
            self._add(rollout, role, response.output)
            calls = function_calls(response)
            incomplete = response.status == r.RESPONSE_STATUS_INCOMPLETE
            if budget is not None:
                budget.took(response)
                cut = incomplete and budget.cut(response)
                if cut:
                    rollout.response.incomplete_details.CopyFrom(response.incomplete_details)
                if cut or (calls and not incomplete and budget.spent):  # tool calls past the budget are not run
                    return response, task_pb2.STOP_REASON_TOKEN_BUDGET
            if not calls or incomplete:
                break
            for position, call in enumerate(calls):
                began = time.monotonic()
                key = events.attempt.tool_key(step, position)
                result = await self.resources.call_tool(session_id, call, key=key, attempt=events.attempt.number)
                seconds = time.monotonic() - began
                out = tool_call_output(call, result)
                events.tool_call(step, call, out, result.error, seconds)
                rollout.timings.tools_seconds += seconds
                self._add(rollout, role, [r.Item(function_call_output=out)])
        return response, None

    def _add(self, rollout: task_pb2.Rollout, role: _Role, items: Any, conversation: bool = True) -> None:
        """Items of `role`'s trajectory: into the rollout's output (their positions the role's) and, unless
        already there, into its conversation."""
        output = rollout.response.output
        for item in items:
            role.record.items.append(len(output))
            output.append(item)
            if conversation:
                role.request.params.input_items.items.append(item)

    async def _verify(
        self, session_id: str, task: task_pb2.Task, rollout: task_pb2.Rollout, events: RolloutEvents
    ) -> None:
        began = time.monotonic()
        verdict = await self.resources.verify(session_id, task, rollout.response)
        rollout.timings.verify_seconds = time.monotonic() - began
        fields_json = rows.json_text(verdict, "fields")
        events.verification(verdict.reward, fields_json, rollout.timings.verify_seconds, verdict.reward_components)
        rollout.reward = verdict.reward
        rollout.verifier_fields_json = fields_json
        rollout.reward_components.update(verdict.reward_components)
        for role in rollout.roles:
            role.reward = verdict.role_rewards.get(role.name, 0.0)


def _take(rollout: task_pb2.Rollout, response: r.Response, seconds: float) -> None:
    """A model call into the rollout: its count, time and usage; the first one's envelope (id, echoed
    parameters, keys we do not model) becomes the rollout's response's."""
    final = rollout.response
    if rollout.model_calls == 0:
        output = list(final.output)
        final.CopyFrom(response)
        final.ClearField("output")
        final.output.extend(output)
    else:
        final.model, final.status = response.model, response.status
        add_usage(final.usage, response.usage)
    rollout.model_calls += 1
    rollout.timings.model_seconds += seconds
