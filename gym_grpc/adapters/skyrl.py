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
event loop in a daemon thread, shared by every environment of the process
(with one channel per server address). Calling them from that loop's own
thread would deadlock and raises instead. The episode itself is
`gym_grpc.adapters.text_episode.TextEpisode`, which the Gymnasium adapter
(`gymnasium_env`) plays too.

A failure (an unreachable server, a deadline, a verifier that raised, a task
row that does not load) never raises out of `step` and never hangs: the
episode ends (`done`, reward 0.0) with `metadata["error"]` holding the same
`class`/`code`/`reason`/`message`/`field` as a failures sidecar record. Every
call is bounded by `timeout_seconds`.

Configuration (`env_config`, strict: a mistyped key is an error): `registry`
(address of `gym-grpc run`'s registry), `resources_server` (the environment's
server name), or `address` (the server's own HOST:PORT, no registry),
`timeout_seconds`, `max_turns`, `tools_in_prompt`, `observation_role`.
Per trajectory (`extras`): `task`, the task row (a dict or its JSON text;
without `responses_create_params.input` the prompt given to `init` becomes
it), and optionally `resources_server` and `max_turns`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from gym_grpc.adapters import missing_extra
from gym_grpc.adapters.text_episode import EpisodeConfig, TextEpisode

try:
    import skyrl_gym
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput, ConversationType
except ImportError as e:  # pragma: no cover - the extra's own message
    raise missing_extra("skyrl-gym", "skyrl", e) from e

#: The id this module registers in skyrl_gym's registry.
ENV_ID = "gym-grpc"


class GymGrpcEnvConfig(EpisodeConfig):
    """The environment's config (SkyRL's `env_config`); a mistyped key is an error."""


def _plain(value: Any) -> Any:
    """An OmegaConf DictConfig/ListConfig (what skyrl-train passes), or any mapping, as plain data."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return [_plain(v) for v in value]
    return value


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
        if not self.config.resources_server and not self.config.address:
            raise ValueError("gym-grpc SkyRL environment: set resources_server (env_config or extras) or address")
        self.max_turns = self.config.max_turns
        #: The trajectory: its session, task, tools, items and error.
        self.episode = TextEpisode(self.config, extras.get("task", {}))

    # --- SkyRL-Gym's interface ------------------------------------------------

    def init(self, prompt: ConversationType) -> tuple[ConversationType, dict[str, Any]]:
        """Seed the session; the prompt comes back with the tools in its system message."""
        messages = self.episode.start([dict(m) for m in prompt])
        if self.episode.error is not None:
            return prompt, {"error": self.episode.error}
        return messages, {"tools": self.episode.tools, "session_id": self.episode.session_id}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        """Run the action's tool calls (their outputs are the observations), or verify a final answer."""
        step = self.episode.act(action)
        self.turns = self.episode.turns
        return BaseTextEnvStepOutput(
            observations=step.observations, reward=step.reward, done=step.done, metadata=step.metadata
        )

    def close(self) -> None:
        """Close the session (idempotent; a failure to close is logged, the session's idle
        time-out on the server catches it)."""
        self.episode.close()

    def get_metrics(self) -> dict[str, Any]:
        return self.episode.metrics()


def register(env_id: str = ENV_ID) -> None:
    """Register GymGrpcTextEnv in skyrl_gym's registry under `env_id` (once; importing this
    module registers the default id)."""
    if env_id not in skyrl_gym.registry:
        skyrl_gym.register(id=env_id, entry_point=f"{__name__}:GymGrpcTextEnv")


register()
