"""tinker-cookbook's RL environments over gym-grpc environments (resources servers).

In tinker-cookbook the trainer's policy samples: an `Env` gives it observations (token ids)
and scores its actions. So a gym-grpc environment plugs in below the agent: `GymMessageEnv`
opens a session on the resources server (SeedSession), runs each tool call the policy makes
(CallTool), and when the policy answers without one, has the answer verified (Verify) for the
reward and closes the session. tinker-cookbook's own `EnvFromMessageEnv` turns it into a
token-level `Env` with a renderer (the chat template as tinker-cookbook writes it).

    builder = GymDatasetBuilder(
        registry="127.0.0.1:50050", resources="weather", train_tasks="train.jsonl",
        eval_tasks="validation.jsonl", renderer_name="qwen3_instruct", tokenizer="Qwen/Qwen3-4B",
        group_size=8, batch_size=16, max_concurrent_rollouts=256,
    )
    train, evaluation = await builder()   # logs "[Concurrency] Set max concurrent rollouts to 256" once

Every rollout, training's and evaluation's, holds a slot of gym-grpc's one process-wide
limit (`gym_grpc.client.set_max_concurrent_rollouts`, which `GymClient` shares) from its
SeedSession to its CloseSession: one `max_concurrent_rollouts` for the whole run, logged once
when the datasets are built.

A rollout the environment cannot finish (a server down, a deadline, a verifier that raised)
raises from the Env, as tinker-cookbook expects of a failed rollout: its rollout strategies
drop it (`MinViableGroup`, recorded in the group's `rollout_errors`), retry it in a fresh env
(`RetryOnFailure`) or fail the group (`FailFast`); it never becomes a reward-0 trajectory.

Needs tinker-cookbook (and so torch): see docs/training.md.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

try:
    import chz
    from tinker_cookbook import renderers
    from tinker_cookbook.rl import types
    from tinker_cookbook.rl.message_env import EnvFromMessageEnv, MessageEnv, MessageStepResult
    from tinker_cookbook.tokenizer_utils import get_tokenizer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"gym_grpc.adapters.tinker needs tinker-cookbook ({e}); see docs/training.md for the install command"
    ) from e

from gym_grpc import responses
from gym_grpc.client import ResourcesClient, RolloutSlot, acquire_rollout_slot, set_max_concurrent_rollouts
from gym_grpc.data import jsonl, rows
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r

__all__ = ["GymDatasetBuilder", "GymEnvGroupBuilder", "GymMessageEnv", "GymRLDataset", "initial_messages"]


def initial_messages(row: dict[str, Any], renderer: Any) -> list[Any]:
    """A task row's conversation as tinker-cookbook messages: its tools (rendered by the
    renderer's own prefix, with the instructions as the system prompt) and its input."""
    params = row["responses_create_params"]
    tools = [
        {"name": t["name"], "description": t.get("description", ""), "parameters": t.get("parameters", {})}
        for t in params.get("tools") or []
        if t.get("type", "function") == "function"
    ]
    system = params.get("instructions") if isinstance(params.get("instructions"), str) else ""
    given = params.get("input")
    items = [{"role": "user", "content": given}] if isinstance(given, str) else list(given or [])
    if tools and items and items[0].get("role") in ("system", "developer"):
        system = "\n\n".join(x for x in (system, _text(items.pop(0).get("content"))) if x)
    messages: list[Any] = renderer.create_conversation_prefix_with_tools(tools, system) if tools else []
    if system and not tools:
        messages.append({"role": "system", "content": system})
    for item in items:
        if not isinstance(item, dict) or "role" not in item:
            raise ValueError(f"responses_create_params.input has an item that is no message: {item!r:.200}")
        messages.append(
            {"role": "system" if item["role"] == "developer" else item["role"], "content": _text(item.get("content"))}
        )
    return messages


def _text(content: Any) -> str:
    """A message's text: a string, or its text parts (tinker's "text", Responses' "input_text"...) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") != "thinking"
        )
    return ""


class GymMessageEnv(MessageEnv):
    """One rollout of a task in a gym-grpc environment's session, at tinker-cookbook's message level."""

    def __init__(self, resources: ResourcesClient, row: dict[str, Any], messages: list[Any], max_turns: int) -> None:
        self.resources = resources
        self.row = row
        self.task = rows.task_from_row(row)
        self.max_turns = max_turns
        self.history = list(messages)
        self.output: list[r.Item] = []
        self.turns = 0
        self.session_id: str | None = None
        self.slot: RolloutSlot | None = None

    async def initial_observation(self) -> list[Any]:
        self.slot = await acquire_rollout_slot()
        session_id = responses.new_id("tinker")
        try:
            await self.resources.seed_session(session_id, self.task)
        except BaseException:
            self.slot.release()
            raise
        self.session_id = session_id
        return list(self.history)

    async def step(self, message: Any) -> Any:
        self.turns += 1
        self.history.append(message)
        text = _text(message.get("content"))
        if text:
            self.output.append(responses.assistant_message(text))
        calls = list(message.get("tool_calls") or [])
        if calls and self.turns < self.max_turns:
            assert self.session_id is not None, "step before initial_observation"
            for number, call in enumerate(calls):
                call_id = call.id or f"call_{self.turns}_{number}"
                function_call = r.FunctionCall(
                    id=responses.new_id("fc"),
                    call_id=call_id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                    status=r.ITEM_STATUS_COMPLETED,
                )
                result = await self.resources.call_tool(self.session_id, function_call)
                self.output.append(r.Item(function_call=function_call))
                self.output.append(
                    r.Item(
                        function_call_output=r.FunctionCallOutput(
                            id=responses.new_id("fco"),
                            call_id=call_id,
                            output=result.output,
                            status=r.ITEM_STATUS_COMPLETED,
                        )
                    )
                )
                self.history.append(
                    {"role": "tool", "content": result.output, "tool_call_id": call_id, "name": call.function.name}
                )
            return MessageStepResult(
                reward=0.0, episode_done=False, next_messages=list(self.history), metrics={"tool_calls": len(calls)}
            )
        reward = await self._verify()
        return MessageStepResult(
            reward=reward,
            episode_done=True,
            next_messages=list(self.history),
            metrics={"gym_reward": reward, "turns": self.turns, "max_turns_reached": float(bool(calls))},
        )

    async def _verify(self) -> float:
        assert self.session_id is not None, "step before initial_observation"
        response = responses.new_response(self.task.responses_create_params, "tinker-policy")
        response.output.extend(self.output)
        response.status = r.RESPONSE_STATUS_COMPLETED
        try:
            reply = await self.resources.verify(self.session_id, self.task, response)
        finally:
            await self.close()
        return float(reply.reward)

    async def close(self) -> None:
        """Close the session and give back the slot (once; again does nothing)."""
        session_id, self.session_id = self.session_id, None
        try:
            if session_id is not None:
                await self.resources.close_session(session_id)
        finally:
            if self.slot is not None:
                self.slot.release()


class _SerialRenderer:
    """A renderer whose calls run one at a time. EnvFromMessageEnv renders in threads
    (asyncio.to_thread), and tinker-cookbook's Qwen3 renderers switch the shared transformers
    tokenizer's `split_special_tokens` back and forth within one render: two renders at once
    fail with the Rust tokenizer's "Already borrowed", or encode with the other's setting."""

    def __init__(self, renderer: Any) -> None:
        self._renderer = renderer
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._renderer, name)
        if not callable(found):
            return found

        def serially(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                return found(*args, **kwargs)

        return serially


@functools.cache
def _renderer(name: str, tokenizer: str) -> Any:
    return _SerialRenderer(renderers.get_renderer(name, get_tokenizer(tokenizer)))


class GymEnvGroupBuilder(types.EnvGroupBuilder):
    """A GRPO group of one task on a gym-grpc resources server. Picklable (it holds addresses and
    names; the client, the renderer and the sessions are made in `make_envs`)."""

    def __init__(
        self,
        *,
        registry: str,
        resources: str,
        row: dict[str, Any],
        group_size: int,
        renderer_name: str,
        tokenizer: str,
        max_turns: int = 8,
        max_generation_tokens: int | None = None,
    ) -> None:
        self.registry = registry
        self.resources = resources
        self.row = row
        self.group_size = group_size
        self.renderer_name = renderer_name
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.max_generation_tokens = max_generation_tokens
        self._open: list[GymMessageEnv] = []
        self._registry: Registry | None = None
        self._client: ResourcesClient | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_open", "_registry", "_client")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _open=[], _registry=None, _client=None)

    async def make_envs(self) -> Sequence[Any]:
        """The group's envs. tinker-cookbook's retrying strategies call this again for fresh
        envs mid-group: they share the client, and cleanup closes them all."""
        renderer = _renderer(self.renderer_name, self.tokenizer)
        if self._registry is None:
            self._registry = Registry(self.registry)
            self._client = ResourcesClient(self._registry, self.resources)
        assert self._client is not None
        messages = initial_messages(self.row, renderer)
        made = [GymMessageEnv(self._client, self.row, messages, self.max_turns) for _ in range(self.group_size)]
        self._open.extend(made)
        return [EnvFromMessageEnv(renderer, env, max_generation_tokens=self.max_generation_tokens) for env in made]

    async def cleanup(self) -> None:
        """Close what a rollout left open (it raised, or was cancelled) and the client."""
        for env in self._open:
            try:
                await env.close()
            except Exception:  # noqa: BLE001 - tinker-cookbook asks cleanup not to raise
                pass
        self._open = []
        if self._registry is not None:
            await self._registry.close()
            self._registry = self._client = None

    def logging_tags(self) -> list[str]:
        return ["gym-grpc", self.resources]


class GymRLDataset(types.RLDataset):
    """Task rows in batches of `batch_size` groups."""

    def __init__(self, builders: list[GymEnvGroupBuilder], batch_size: int) -> None:
        self.builders = builders
        self.batch_size = batch_size

    def get_batch(self, index: int) -> Sequence[GymEnvGroupBuilder]:
        return self.builders[index * self.batch_size : (index + 1) * self.batch_size]

    def __len__(self) -> int:
        return -(-len(self.builders) // self.batch_size)


@chz.chz
class GymDatasetBuilder(types.RLDatasetBuilder):
    """tinker-cookbook's dataset builder for a gym-grpc environment: training tasks in groups of
    `group_size`, evaluation tasks (if any) in groups of `eval_group_size`, and one
    `max_concurrent_rollouts` for both, set (and logged) once when they are built."""

    registry: str
    resources: str
    train_tasks: str
    renderer_name: str
    tokenizer: str
    group_size: int
    batch_size: int
    max_concurrent_rollouts: int
    eval_tasks: str | None = None
    eval_group_size: int = 1
    max_turns: int = 8
    max_generation_tokens: int | None = None

    def _dataset(self, path: str, group_size: int) -> GymRLDataset:
        builders = [
            GymEnvGroupBuilder(
                registry=self.registry,
                resources=self.resources,
                row=row,
                group_size=group_size,
                renderer_name=self.renderer_name,
                tokenizer=self.tokenizer,
                max_turns=self.max_turns,
                max_generation_tokens=self.max_generation_tokens,
            )
            for row in jsonl.iter_rows(Path(path))
        ]
        return GymRLDataset(builders, self.batch_size)

    async def __call__(self) -> tuple[GymRLDataset, GymRLDataset | None]:
        set_max_concurrent_rollouts(self.max_concurrent_rollouts)
        train = self._dataset(self.train_tasks, self.group_size)
        evaluation = self._dataset(self.eval_tasks, self.eval_group_size) if self.eval_tasks else None
        return train, evaluation
