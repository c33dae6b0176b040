"""Any gym-grpc environment as a SkyRL-Gym text environment, registered as "gym-grpc".

    import gym_grpc.adapters.skyrl  # registers "gym-grpc" in skyrl_gym's registry
    env = skyrl_gym.make("gym-grpc", env_config={"registry": "127.0.0.1:50050",
                                                 "resources_server": "weather"},
                         extras={"task": row})     # a gym-grpc / NeMo Gym task row
    prompt, info = env.init(row_prompt)            # SeedSession; the tools in the system prompt
    out = env.step(model_text)                     # a <tool_call> runs the tool: its output is
                                                   # the next observation; a final answer verifies
    env.close()                                    # CloseSession (done episodes close by themselves)

Why this shape: SkyRL-Gym's unit is `BaseTextEnv` — text in, text out, one
instance per trajectory, built by `skyrl_gym.make(id, env_config=...,
extras=...)` (skyrl-train passes the environment's config section and the
dataset row's other fields). The model's output reaches `step` as raw text, so
the tool calls are read from it here, in the Hermes `<tool_call>` format that
Qwen2.5/Qwen3 and the vLLM model server use (the parser is that server's own,
`servers/models/vllm_model/tool_calls.py`); SkyRL's bundled environments parse
their own tags the same way (`<search>`, `<sql>`). A tool's output comes back
as a `{"role": "tool"}` observation (what those chat templates render as
`<tool_response>`; `observation_role: user` wraps it in the tags instead). A
turn without a tool call is the final answer: the session's Verify scores the
whole trajectory, `done` is true and the reward is the verifier's.

SkyRL calls `init`/`step`/`close` synchronously (skyrl-train runs them in a
thread pool), while gym-grpc's clients are asyncio: the calls run on one
event loop in a daemon thread of this module, shared by every environment of
the process (with one channel per registry address). Calling them from that
loop's own thread would deadlock and raises instead.

A failure (an unreachable server, a deadline, a verifier that raised, a task
row that does not load) never raises out of `step` and never hangs: the
episode ends (`done`, reward 0.0) with `metadata["error"]` holding the same
`class`/`code`/`reason`/`message`/`field` as a failures sidecar record. Every
call is bounded by `timeout_seconds`.

Configuration (`env_config`, strict: a mistyped key is an error): `registry`
(address of `gym-grpc run`'s registry), `resources_server` (the environment's
server name), `timeout_seconds`, `max_turns`, `tools_in_prompt`,
`observation_role`. Per trajectory (`extras`): `task`, the task row (a dict or
its JSON text; without `responses_create_params.input` the prompt given to
`init` becomes it), and optionally `resources_server` and `max_turns`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import uuid
from collections.abc import Coroutine, Mapping
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gym_grpc import errors
from gym_grpc.adapters import missing_extra
from gym_grpc.client.stubs import ResourcesClient
from gym_grpc.data import rows
from gym_grpc.responses import assistant_message, new_id
from gym_grpc.rpc.registry import Registry
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

try:
    import skyrl_gym
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
except ImportError as e:  # pragma: no cover - the extra's own message
    raise missing_extra("skyrl-gym", "skyrl", e) from e

from gym_grpc.bundled.servers.models.vllm_model.tool_calls import Hermes

log = logging.getLogger("gym_grpc.adapters.skyrl")

#: The id this module registers in skyrl_gym's registry.
ENV_ID = "gym-grpc"

T = TypeVar("T")


class GymGrpcEnvConfig(BaseModel):
    """The environment's config (SkyRL's `env_config`); a mistyped key is an error."""

    model_config = ConfigDict(extra="forbid")

    registry: str = Field("127.0.0.1:50050", description="address of the registry `gym-grpc run` serves")
    resources_server: str = Field("", description="the resources server's name in the registry")
    timeout_seconds: float = Field(600.0, gt=0, description="the longest any one call (seed, tool, verify) may take")
    max_turns: int = Field(8, ge=1, description="model turns before the episode ends and is verified as it stands")
    tools_in_prompt: bool = Field(True, description="describe the tools in the system prompt (Hermes layout)")
    observation_role: Literal["tool", "user"] = Field(
        "tool", description='"tool" observations, or "user" ones wrapped in <tool_response> tags'
    )


class _Loop:
    """One event loop in a daemon thread for every environment of the process, with one
    Registry per address: gym-grpc's clients are asyncio, SkyRL's environments are not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._registries: dict[str, Registry] = {}

    def _running(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="gym-grpc-skyrl", daemon=True).start()
                self._loop = loop
            return self._loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run `coro` on the loop and wait for it, at most `timeout` seconds (then it is
        cancelled and DeadlineExceeded raised)."""
        loop = self._running()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            coro.close()
            raise RuntimeError("a gym-grpc SkyRL environment was called from its own event loop's thread")
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), loop)
        try:
            return future.result()
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise errors.DeadlineExceeded(f"no answer within {timeout:g} s (env_config timeout_seconds)") from None

    def registry(self, address: str) -> Registry:
        """The Registry of an address (used on the loop's thread only)."""
        registry = self._registries.get(address)
        if registry is None:
            registry = self._registries[address] = Registry(address)
        return registry


_LOOP = _Loop()


def _plain(value: Any) -> Any:
    """An OmegaConf DictConfig/ListConfig (what skyrl-train passes), or any mapping, as plain data."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


def _tool_block(tools: list[dict[str, Any]]) -> str:
    """The tools as Hermes chat templates (Qwen2.5, Hermes-2-Pro) describe them in the system prompt."""
    listed = "\n".join(json.dumps(tool, sort_keys=True) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


class GymGrpcTextEnv(BaseTextEnv):
    """One trajectory on a gym-grpc resources server, as a SkyRL-Gym text environment."""

    def __init__(self, env_config: Mapping[str, Any] | None = None, extras: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        extras = _plain(extras or {})
        settings = _plain(env_config or {})
        for key in ("resources_server", "max_turns"):  # a dataset may mix environments
            if key in extras:
                settings[key] = extras[key]
        try:
            self.config = GymGrpcEnvConfig.model_validate(settings)
        except ValidationError as e:
            raise ValueError(f"gym-grpc SkyRL environment: env_config: {e}") from None
        if not self.config.resources_server:
            raise ValueError("gym-grpc SkyRL environment: set resources_server (env_config or extras)")
        self.max_turns = self.config.max_turns
        self.row: Any = extras.get("task", {})
        self.session_id = f"skyrl-{uuid.uuid4().hex}"
        self.task = task_pb2.Task()
        self.tools: list[dict[str, Any]] = []
        #: The trajectory as Responses output items: what Verify scores.
        self.items: list[r.Item] = []
        self.tool_calls = 0
        self.error: dict[str, Any] | None = None
        self._open = False
        self._done = False

    # --- SkyRL-Gym's interface ------------------------------------------------

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Seed the session; the prompt comes back with the tools in its system message."""
        try:
            self.task = self._task(prompt)
            self.tools = self._run(self._seed())
        except Exception as e:
            self._fail(e)
            return prompt, {"error": self.error}
        messages = [dict(m) for m in prompt]
        if self.tools and self.config.tools_in_prompt:
            block = _tool_block(self.tools)
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
            else:
                messages.insert(0, {"role": "system", "content": block})
        return messages, {"tools": self.tools, "session_id": self.session_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Run the action's tool calls (their outputs are the observations), or verify a final answer."""
        if self.error is not None or self._done:
            return self._ended("the episode has ended" if self.error is None else None)
        self.turns += 1
        text, calls = Hermes().parse(action)
        if text:
            self.items.append(assistant_message(text))
        called = [r.FunctionCall(name=c.name, arguments=c.arguments, call_id=new_id("call")) for c in calls]
        self.items.extend(r.Item(function_call=call) for call in called)
        if called and self.turns < self.max_turns:
            try:
                outputs = self._run(self._call_tools(called))
            except Exception as e:
                self._fail(e)
                return self._ended()
            return BaseTextEnvStepOutput(
                observations=[self._observation(output) for output in outputs],
                reward=0.0,
                done=False,
                metadata={"tool_calls": [c.name for c in called]},
            )
        try:
            verdict = self._run(self._verify())
        except Exception as e:
            self._fail(e)
            return self._ended()
        self._done = True
        self.close()
        stop = "tool_call_at_max_turns" if called else "final_answer"
        metadata = {
            "stop_reason": stop,
            "verifier_fields": rows.json_field(verdict, "fields"),
            "reward_components": dict(verdict.reward_components),
        }
        return BaseTextEnvStepOutput(observations=[], reward=float(verdict.reward), done=True, metadata=metadata)

    def close(self) -> None:
        """Close the session (idempotent; a failure to close is logged, the session's idle
        time-out on the server catches it)."""
        if not self._open:
            return
        self._open = False
        try:
            self._run(self._client().close_session(self.session_id))
        except Exception as e:
            log.warning("closing session %s on %r failed: %s", self.session_id, self.config.resources_server, e)

    def get_metrics(self) -> dict[str, Any]:
        return {"turns": self.turns, "tool_calls": self.tool_calls, "failed": float(self.error is not None)}

    # --- gym-grpc calls (on the shared loop) -------------------------------------

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return _LOOP.run(coro, self.config.timeout_seconds)

    def _client(self) -> ResourcesClient:
        """A client of the environment (cheap: the channel belongs to the shared Registry)."""
        registry = _LOOP.registry(self.config.registry)
        return ResourcesClient(registry, self.config.resources_server, timeout=self.config.timeout_seconds)

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

    def _task(self, prompt: ConversationType) -> task_pb2.Task:
        row = json.loads(self.row) if isinstance(self.row, str) else dict(self.row)
        params = dict(row.get("responses_create_params") or {})
        if not params.get("input"):
            params["input"] = [dict(m) for m in prompt]
        row["responses_create_params"] = params
        return rows.task_from_row(row)

    def _observation(self, output: str) -> dict[str, str]:
        if self.config.observation_role == "user":
            return {"role": "user", "content": f"<tool_response>\n{output}\n</tool_response>"}
        return {"role": "tool", "content": output}

    def _fail(self, error: Exception) -> None:
        self.error = errors.Failure.of(error).to_json()
        self.error["resources_server"] = self.config.resources_server
        log.warning("gym-grpc episode on %r failed: %s", self.config.resources_server, self.error["message"])
        self.close()

    def _ended(self, message: str | None = None) -> BaseTextEnvStepOutput:
        metadata: dict[str, Any] = {"error": self.error} if self.error is not None else {"stop_reason": message}
        return BaseTextEnvStepOutput(observations=[], reward=0.0, done=True, metadata=metadata)


def register(env_id: str = ENV_ID) -> None:
    """Register GymGrpcTextEnv in skyrl_gym's registry under `env_id` (once; importing this
    module registers the default id)."""
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{__name__}:GymGrpcTextEnv")


register()
