"""One text episode on a gym-grpc resources server: the core the text-environment adapters share.

A model writes text; the environment answers with text. `TextEpisode` plays one
trajectory of a task row that way, whatever framework calls it (SkyRL-Gym's
`BaseTextEnv` in `skyrl`, Gymnasium's `Env` in `gymnasium_env`):

    episode = TextEpisode(EpisodeConfig(resources_server="weather"), row)
    messages = episode.start()          # SeedSession; the prompt, the tools in its system message
    step = episode.act(model_text)      # a <tool_call> runs the tool: its output is the observation;
                                        # a turn without one is the final answer: Verify, done
    episode.close()                     # CloseSession (an ended episode closes by itself)

The tool calls are read from the text in the Hermes `<tool_call>` format that
Qwen2.5/Qwen3 and the vLLM model server use (the parser is that server's own,
`servers/models/vllm_model/tool_calls.py`), and the tools are described in the
system prompt in the same layout. A tool's output comes back as a
`{"role": "tool"}` message (what those chat templates render as
`<tool_response>`; `observation_role: user` wraps it in the tags instead).
At `max_turns` the episode ends and is verified as it stands (a tool call of
the last turn is not run).

The frameworks call synchronously, gym-grpc's clients are asyncio: every call
runs on one event loop in a daemon thread (`LOOP`), shared by every episode of
the process, with one channel per server address. Calling from that loop's own
thread would deadlock and raises instead.

A failure (an unreachable server, a deadline, a verifier that raised, a task
row that does not load) never raises out of `start`/`act` and never hangs: the
episode ends (reward 0.0) with `error` holding the same
`class`/`code`/`reason`/`message`/`field` as a failures sidecar record. Every
call is bounded by `timeout_seconds`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import json
import logging
import os
import threading
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from gym_grpc import errors
from gym_grpc.bundled.servers.models.vllm_model.tool_calls import Hermes
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message, input_items, message_text, new_id
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

log = logging.getLogger("gym_grpc.adapters")

T = TypeVar("T")

#: The stop_reason of a step taken after the episode ended.
ENDED = "the episode has ended"

#: How much longer than a call's timeout a caller waits for the loop to end the call.
_STUCK_LOOP_SECONDS = 10.0

#: The chat role of each Responses message role.
_CHAT_ROLES = {r.ROLE_SYSTEM: "system", r.ROLE_DEVELOPER: "system", r.ROLE_USER: "user", r.ROLE_ASSISTANT: "assistant"}


class EpisodeConfig(BaseModel):
    """Where the environment is and how an episode plays; a mistyped key is an error."""

    model_config = ConfigDict(extra="forbid")

    registry: str = Field("127.0.0.1:50050", description="address of the registry `gym-grpc run` serves")
    address: str = Field("", description="the resources server's own address (HOST:PORT), instead of a registry")
    resources_server: str = Field("", description="the resources server's name in the registry")
    timeout_seconds: float = Field(600.0, gt=0, description="the longest any one call (seed, tool, verify) may take")
    max_turns: int = Field(8, ge=1, description="model turns before the episode ends and is verified as it stands")
    tools_in_prompt: bool = Field(True, description="describe the tools in the system prompt (Hermes layout)")
    observation_role: Literal["tool", "user"] = Field(
        "tool", description='"tool" observations, or "user" ones wrapped in <tool_response> tags'
    )

    @model_validator(mode="after")
    def _one_way_to_the_server(self) -> EpisodeConfig:
        if self.address and "registry" in self.model_fields_set:
            raise ValueError("give the resources server's address or a registry to find it in, not both")
        return self

    @property
    def server_name(self) -> str:
        """The name calls use: the registry's name, or "resources" for a server given by address."""
        return self.resources_server or "resources"


class SyncLoop:
    """One event loop in a daemon thread for every episode of the process, with one Registry
    per address: gym-grpc's clients are asyncio, the frameworks' environments are not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pid = 0
        self._registries: dict[tuple[str, str, str], Registry] = {}

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None and self._pid != os.getpid():
                # A forked child (a vector env's worker) has the parent's loop without its thread, and
                # gRPC, started in the parent, does not work in it: every call would wait out its deadline.
                raise errors.FailedPrecondition(
                    "gym-grpc's calls cannot run in a process forked from one that made them (gRPC is not "
                    "fork-safe): start the workers with the spawn or forkserver method "
                    '(gymnasium.vector.AsyncVectorEnv(..., context="spawn"))'
                )
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="gym-grpc-adapters", daemon=True).start()
                self._loop, self._pid = loop, os.getpid()
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop and wait for it, at most `timeout` seconds (then it is
        cancelled and DeadlineExceeded raised)."""
        try:
            loop = self._running()
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                raise RuntimeError("a gym-grpc environment was called from its own event loop's thread")
        except BaseException:
            coro.close()
            raise
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), loop)
        try:
            # The loop cancels the call at `timeout`; the wait here is bounded too, should the loop be stuck.
            return future.result(timeout + _STUCK_LOOP_SECONDS)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise errors.DeadlineExceeded(f"no answer within {timeout:g} s (timeout_seconds)") from None

    def registry(self, config: EpisodeConfig) -> Registry:
        """The Registry that finds the configured server (used on the loop's thread only)."""
        key = ("address", config.address, config.server_name) if config.address else ("registry", config.registry, "")
        registry = self._registries.get(key)
        if registry is None:
            if config.address:
                registry = Registry(static={config.server_name: config.address})
            else:
                registry = Registry(config.registry)
            self._registries[key] = registry
        return registry


#: The loop every episode of the process runs its calls on.
LOOP = SyncLoop()


def tool_block(tools: list[dict[str, Any]]) -> str:
    """The tools as Hermes chat templates (Qwen2.5, Hermes-2-Pro) describe them in the system prompt."""
    listed = "\n".join(json.dumps(tool, sort_keys=True) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def task_messages(task: task_pb2.Task) -> list[dict[str, str]]:
    """A task's prompt as chat messages: its instructions as the system message, then its input
    messages (text parts joined; a developer message becomes a system one)."""
    params = task.responses_create_params
    messages = []
    if params.HasField("instructions") and params.instructions:
        messages.append({"role": "system", "content": params.instructions})
    for index, item in enumerate(input_items(params)):
        if item.WhichOneof("item") != "message" or item.message.role not in _CHAT_ROLES:
            raise errors.InvalidArgument(
                f"responses_create_params.input[{index}] is not a system, developer, user or assistant message",
                field=f"responses_create_params.input[{index}]",
            )
        messages.append({"role": _CHAT_ROLES[item.message.role], "content": message_text(item.message)})
    return messages


@dataclass
class Step:
    """What one action did: the observations (chat messages) the model reads next, the reward,
    whether the episode is over, and what happened (`stop_reason`, `verifier_fields`,
    `reward_components`, `tool_calls`, or `error`)."""

    observations: list[dict[str, str]]
    reward: float
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)


class TextEpisode:
    """One trajectory of a task row on a gym-grpc resources server, text in and text out."""

    def __init__(self, config: EpisodeConfig, row: Any, *, loop: SyncLoop = LOOP) -> None:
        if not config.resources_server and not config.address:
            raise ValueError("set resources_server (its name in the registry) or address")
        self.config = config
        #: The task row: a dict or its JSON text.
        self.row = row
        self.loop = loop
        self.session_id = f"episode-{uuid.uuid4().hex}"
        self.task = task_pb2.Task()
        #: The environment's tools, as Chat Completions' tool objects (what chat templates take).
        self.tools: list[dict[str, Any]] = []
        #: The trajectory as Responses output items: what Verify scores.
        self.items: list[r.Item] = []
        self.turns = 0
        self.tool_calls = 0
        #: Why the episode failed (a failures sidecar record), or None.
        self.error: dict[str, Any] | None = None
        #: The last step, once the episode has ended.
        self.ended: Step | None = None
        self._open = False

    def start(self, prompt: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        """Seed the session. The prompt is `prompt` (which becomes the row's input when the row
        has none) or the row's own input; it comes back with the tools in its system message.
        On a failure the prompt comes back as it was (without tools; empty when the row does not
        load) and `error` is set."""
        messages = [dict(m) for m in prompt or []]
        try:
            self.task = self._task(prompt)
            if prompt is None:
                messages = task_messages(self.task)
                if not messages:
                    raise errors.InvalidArgument(
                        "the task row has no prompt (responses_create_params.input)",
                        field="responses_create_params.input",
                    )
            self.tools = self._run(self._seed())
        except Exception as e:
            self._fail(e)
            return messages
        if self.tools and self.config.tools_in_prompt:
            block = tool_block(self.tools)
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
            else:
                messages.insert(0, {"role": "system", "content": block})
        return messages

    def act(self, action: str) -> Step:
        """Run the action's tool calls (their outputs are the observations), or verify a final answer."""
        if self.ended is not None:
            if self.error is not None:
                return copy.deepcopy(self.ended)
            return Step([], 0.0, True, {"stop_reason": ENDED})
        self.turns += 1
        text, calls = Hermes().parse(action)
        if text:
            self.items.append(assistant_message(text))
        called = [r.FunctionCall(name=c.name, arguments=c.arguments, call_id=new_id("call")) for c in calls]
        self.items.extend(r.Item(function_call=call) for call in called)
        if called and self.turns < self.config.max_turns:
            try:
                outputs = self._run(self._call_tools(called))
            except Exception as e:
                return self._fail(e)
            return Step(
                observations=[self._observation(output) for output in outputs],
                reward=0.0,
                done=False,
                metadata={"tool_calls": [c.name for c in called]},
            )
        try:
            verdict = self._run(self._verify())
        except Exception as e:
            return self._fail(e)
        stop = "tool_call_at_max_turns" if called else "final_answer"
        metadata = {
            "stop_reason": stop,
            "verifier_fields": rows.json_field(verdict, "fields"),
            "reward_components": dict(verdict.reward_components),
        }
        self.ended = Step(observations=[], reward=float(verdict.reward), done=True, metadata=metadata)
        self.close()
        return copy.deepcopy(self.ended)

    def close(self) -> None:
        """Close the session (idempotent; a failure to close is logged, the session's idle
        time-out on the server catches it)."""
        if not self._open:
            return
        self._open = False
        try:
            self._run(self._client().close_session(self.session_id))
        except Exception as e:
            log.warning("closing session %s on %r failed: %s", self.session_id, self.config.server_name, e)

    def metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": self.tool_calls, "failed": float(self.error is not None)}

    # --- gym-grpc calls (on the shared loop) -------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return self.loop.run(coro, self.config.timeout_seconds)

    def _client(self) -> ResourcesClient:
        """A client of the environment (cheap: the channel belongs to the shared Registry)."""
        registry = self.loop.registry(self.config)
        return ResourcesClient(registry, self.config.server_name, timeout=self.config.timeout_seconds)

    async def _seed(self) -> list[dict[str, Any]]:
        client = self._client()
        described = await client.describe_tools()
        if not described.stateless:
            await client.seed_session(self.session_id, self.task)
            self._open = True
        params = r.CreateParams(tools=[r.Tool(function=t) for t in described.tools])
        tools = rows.params_to_json(params).get("tools", []) if described.tools else []
        # Chat Completions' tool objects, as chat templates take them.
        return [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]

    async def _call_tools(self, calls: list[r.FunctionCall]) -> list[str]:
        client = self._client()
        outputs = []
        for call in calls:
            result = await client.call_tool(self.session_id, call)
            self.tool_calls += 1
            output = r.FunctionCallOutput(call_id=call.call_id, output=result.output)
            self.items.append(r.Item(function_call_output=output))
            outputs.append(result.output)
        return outputs

    async def _verify(self) -> Any:
        return await self._client().verify(self.session_id, self.task, r.Response(output=self.items))

    # --- helpers -------------------------------------------------------------------

    def _task(self, prompt: list[dict[str, Any]] | None) -> task_pb2.Task:
        row = json.loads(self.row) if isinstance(self.row, str) else dict(self.row)
        params = dict(row.get("responses_create_params") or {})
        if prompt is not None and not params.get("input"):
            params["input"] = [dict(m) for m in prompt]
        row["responses_create_params"] = params
        return rows.task_from_row(row)

    def _observation(self, output: str) -> dict[str, str]:
        if self.config.observation_role == "user":
            return {"role": "user", "content": f"<tool_response>\n{output}\n</tool_response>"}
        return {"role": "tool", "content": output}

    def _fail(self, error: Exception) -> Step:
        """End the episode on `error` (closing its session); the step that says so."""
        self.error = errors.Failure.of(error).to_json()
        self.error["resources_server"] = self.config.server_name
        self.ended = Step(observations=[], reward=0.0, done=True, metadata={"error": self.error})
        log.warning("gym-grpc episode on %r failed: %s", self.config.server_name, self.error["message"])
        self.close()
        return copy.deepcopy(self.ended)
