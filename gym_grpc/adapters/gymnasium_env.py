"""Any gym-grpc environment as a `gymnasium.Env`, registered as "gym_grpc/Env-v0".

    import gymnasium
    import gym_grpc.adapters.gymnasium_env  # registers "gym_grpc/Env-v0"

    env = gymnasium.make("gym_grpc/Env-v0", registry="127.0.0.1:50050", resources_server="weather",
                         tasks="servers/resources/weather/data/example.jsonl")
    observation, info = env.reset(seed=0)     # a task row, SeedSession: the prompt with the tools
    observation, reward, terminated, truncated, info = env.step(model_text)
    env.close()                               # CloseSession

(`gymnasium.make("gym_grpc.adapters.gymnasium_env:gym_grpc/Env-v0", ...)` imports
the module itself.) The server is found by name through the registry of `gym-grpc
run` (`registry` + `resources_server`), or given by `address` (HOST:PORT).

**Episodes.** `reset` picks a task row and seeds a session with it; the
observation is the row's prompt as text (its instructions, the tools in the
Hermes layout, the user's message, joined by blank lines), and
`info["messages"]` holds the same as chat messages (with `info["tools"]`) for a
trainer that applies its own chat template. `step(action)` takes the model's
text: a Hermes `<tool_call>` in it runs the tool (CallTool) and the tool's
output is the next observation, reward 0.0 (several calls: each output in
`<tool_response>` tags, one per line; `info["observations"]` holds them as chat
messages). A turn without a tool call is the final answer: Verify scores the
whole trajectory, `terminated` is true, the reward is the verifier's (its
fields in `info["verifier_fields"]`), the observation is "" and the session
closes. At `max_turns` a turn that still calls a tool ends the episode with
`truncated` (the call is not run; the trajectory is verified as it stands, its
reward the verifier's). This is the SkyRL adapter's episode
(`gym_grpc.adapters.text_episode`).

**Task rows.** A Gymnasium trainer resets with a seed and expects the
environment to pick its start state; so the rows are given when the
environment is made (`tasks`: a JSONL path or a list of rows, gym-grpc / NeMo
Gym task rows), and each `reset` draws one with the environment's `np_random`:
`reset(seed=s)` always starts the same task, and a vector env (seeds s, s+1,
...) spreads over the rows. `reset(options={"task_index": i})` starts row i;
`reset(options={"task": row})` plays a row of the caller's own (no `tasks`
needed). Any other option is an error.

**Failures** (an unreachable server, a deadline, a verifier that raised, a row
that does not load) never raise and never hang: every call is bounded by
`timeout_seconds`; the episode ends with `truncated`, reward 0.0 and
`info["error"]` (the failures sidecar's `class`/`code`/`reason`/`message`/
`field`, and `resources_server`). A failure at `reset` returns the prompt (or
"") with `info["error"]`, and the first `step` ends the episode with it. A
mistake of the caller (an unknown option or config key, no task at all) raises
ValueError naming it.

**Spaces.** Both are `gymnasium.spaces.Text`, min length 0 (the last
observation is ""): `observation_max_length` (default 1,048,576 characters) and
`action_max_length` (65,536) characters of `charset`, by default every
character of Unicode's Basic Multilingual Plane (U+0000-U+FFFF less the
surrogates). A `Text` space needs a finite character list to sample from, so
it cannot hold every Unicode string: an observation with a character beyond
U+FFFF (an emoji) or longer than `observation_max_length` is returned
unchanged and is then outside the space (widen `charset` if your tasks have
such characters). `check_env` passes: `reset(seed=...)` is deterministic; a
step is deterministic as far as the environment's tools and verifier are.

gym-grpc's clients are asyncio and Gymnasium calls synchronously: the calls run
on one event-loop thread shared by the process, so an environment must not be
driven from that thread (nor from an event loop that serves its own server:
call it from a worker thread there). Configuration keys are strict: a mistyped
one is an error naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError

from gym_grpc.adapters import missing_extra
from gym_grpc.adapters.text_episode import ENDED, EpisodeConfig, Step, TextEpisode
from gym_grpc.data import jsonl

try:
    import gymnasium
    from gymnasium import spaces
except ImportError as e:  # pragma: no cover - the extra's own message
    raise missing_extra("gymnasium", "gymnasium", e) from e

#: The id this module registers in Gymnasium's registry.
ENV_ID = "gym_grpc/Env-v0"

#: Every character of Unicode's Basic Multilingual Plane but the surrogates (which no text holds).
BMP = "".join(chr(c) for c in range(0x10000) if not 0xD800 <= c <= 0xDFFF)

_OPTIONS = ("task", "task_index")


class GymnasiumEnvConfig(EpisodeConfig):
    """The environment's keyword arguments (besides `render_mode`); a mistyped key is an error."""

    tasks: list[Any] | Path | None = Field(None, description="the task rows: a JSONL path or a list of rows")
    observation_max_length: int = Field(1 << 20, ge=1, description="characters an observation may have")
    action_max_length: int = Field(1 << 16, ge=1, description="characters an action may have")
    charset: str = Field(BMP, min_length=1, description="the characters of both Text spaces")


def _load_tasks(tasks: list[Any] | Path | None) -> list[Any]:
    """The rows of `tasks`; a file that is missing, or a line that is no JSON object, is an error naming it."""
    if tasks is None:
        return []
    if isinstance(tasks, Path):
        try:
            lines = tasks.read_bytes().splitlines()
        except OSError as e:
            raise ValueError(f"gym-grpc Gymnasium environment: tasks: {e}") from None
        rows = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = jsonl.parse_line(line)
            except ValueError as e:
                raise ValueError(f"gym-grpc Gymnasium environment: tasks: {tasks}:{number}: {e}") from None
            if not isinstance(row, dict):
                raise ValueError(f"gym-grpc Gymnasium environment: tasks: {tasks}:{number}: not a JSON object")
            rows.append(row)
    else:
        rows = list(tasks)
    if not rows:
        raise ValueError(f"gym-grpc Gymnasium environment: tasks: {tasks} has no rows")
    return rows


def _text(messages: list[dict[str, Any]]) -> str:
    return "\n\n".join(str(m.get("content") or "") for m in messages)


class GymGrpcEnv(gymnasium.Env[str, str]):
    """Episodes of a gym-grpc resources server's tasks, text in and text out."""

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, render_mode: str | None = None, **config: Any) -> None:
        if render_mode is not None:
            raise ValueError(f"gym-grpc Gymnasium environment: render_mode {render_mode!r}: it renders nothing")
        try:
            self.config = GymnasiumEnvConfig.model_validate(config)
        except ValidationError as e:
            raise ValueError(f"gym-grpc Gymnasium environment: {e}") from None
        if not self.config.resources_server and not self.config.address:
            raise ValueError("gym-grpc Gymnasium environment: set resources_server (with registry) or address")
        #: The task rows `reset` draws from.
        self.tasks = _load_tasks(self.config.tasks)
        charset = self.config.charset
        self.observation_space = spaces.Text(self.config.observation_max_length, min_length=0, charset=charset)
        self.action_space = spaces.Text(self.config.action_max_length, min_length=0, charset=charset)
        #: The episode under way (its session, task, tools, items, error), or None before the first reset.
        self.episode: TextEpisode | None = None
        self._last: tuple[bool, bool] = (False, False)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Close the episode under way, pick a task row and seed a session with it."""
        super().reset(seed=seed)
        row, index = self._pick(dict(options or {}))
        if self.episode is not None:
            self.episode.close()
        self.episode = TextEpisode(self.config, row)
        self._last = (False, False)
        messages = self.episode.start()
        info: dict[str, Any] = {"task_index": index, "messages": messages}
        if self.episode.error is not None:
            info["error"] = self.episode.error
        else:
            info["tools"] = self.episode.tools
            info["session_id"] = self.episode.session_id
        return _text(messages), info

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Run the action's tool calls (their outputs are the observation), or verify a final answer."""
        if self.episode is None:
            raise gymnasium.error.ResetNeeded("call reset() before step()")
        step = self.episode.act(action)
        info = dict(step.metadata)
        info["turns"] = self.episode.turns
        if not step.done:
            info["observations"] = step.observations
            return self._observation(step), step.reward, False, False, info
        if info.get("stop_reason") != ENDED:
            self._last = (info.get("stop_reason") == "final_answer", info.get("stop_reason") != "final_answer")
        terminated, truncated = self._last
        return "", step.reward, terminated, truncated, info

    def close(self) -> None:
        """Close the session of the episode under way (idempotent)."""
        if self.episode is not None:
            self.episode.close()

    # --- helpers -------------------------------------------------------------------

    def _pick(self, options: dict[str, Any]) -> tuple[Any, int | None]:
        unknown = sorted(set(options) - set(_OPTIONS))
        if unknown:
            raise ValueError(f"gym-grpc Gymnasium environment: reset options {unknown}: known are {list(_OPTIONS)}")
        if "task" in options:
            if "task_index" in options:
                raise ValueError("gym-grpc Gymnasium environment: reset options: give task or task_index, not both")
            return options["task"], None
        if not self.tasks:
            raise ValueError(
                "gym-grpc Gymnasium environment: no task to play: make it with tasks=(a JSONL path or a list of "
                'rows), or reset(options={"task": row})'
            )
        if "task_index" in options:
            index = options["task_index"]
            if not isinstance(index, int) or not 0 <= index < len(self.tasks):
                raise ValueError(
                    f"gym-grpc Gymnasium environment: reset options: task_index {index!r} is not in "
                    f"0..{len(self.tasks) - 1}"
                )
        else:
            index = int(self.np_random.integers(len(self.tasks)))
        return self.tasks[index], index

    @staticmethod
    def _observation(step: Step) -> str:
        contents = [m["content"] for m in step.observations]
        if len(contents) == 1 or any(m["role"] == "user" for m in step.observations):
            return "\n".join(contents)  # one output, or outputs already in <tool_response> tags
        return "\n".join(f"<tool_response>\n{content}\n</tool_response>" for content in contents)


def register(env_id: str = ENV_ID) -> None:
    """Register GymGrpcEnv in Gymnasium's registry under `env_id` (once; importing this module
    registers the default id)."""
    if env_id not in gymnasium.registry:
        gymnasium.register(id=env_id, entry_point=f"{__name__}:GymGrpcEnv")


register()
