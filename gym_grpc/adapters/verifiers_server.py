"""A verifiers 0.4 taskset served as a gym-grpc resources server (the other way round
from `gym_grpc.adapters.verifiers`).

    servers:
      capitals:
        entrypoint: gym_grpc.adapters.verifiers_server:VerifiersTasksetServer
        config:
          taskset: examples.verifiers_taskset:CapitalsTaskset   # module:attribute
          taskset_args: {countries: [France, Japan]}

`taskset` names a `vf.Taskset` subclass (built with its config class from
`taskset_args`), a `vf.Taskset` instance, or a factory called with
`taskset_args` as keyword arguments that returns one. Its tasks become task
rows with `python -m gym_grpc.adapters.verifiers_server --taskset ... --output
tasks.jsonl` (`task_rows` in Python); gym-grpc's own agent plays them, and
this server stands where verifiers' rollout machinery would:

- SeedSession finds the row's task (by `verifiers_task_key`, the task's own
  `key`), makes the rollout's `Trace` with a fresh state of the task's state
  type, runs `Task.setup`, and starts the task's per-rollout toolsets
  (`Task.toolsets`): `setup`, `setup_task`, `register` on an MCP server object;
- CallTool calls the tool through that MCP server object, in this process,
  under the rollout's state (shared toolsets, `Taskset.toolsets`, are started
  once and see the calling rollout's state the same way);
- Verify turns the task's prompt and the response's output into the trace's
  message nodes (the output parsed by verifiers' own Responses dialect), runs
  `Task.finalize` and `Task.score` (the `@vf.reward` and `@vf.metric`
  methods, weights and config-plugged functions included), and answers with
  `trace.reward`, each reward's score as a reward component and each metric
  as a field;
- CloseSession closes the rollout's toolsets.

Why in process: verifiers starts each toolset as its own MCP server program
(`python -m <module>`) and syncs the rollout's state with it over HTTP
through its interception server; per rollout that is a process and two HTTP
hops per tool call, and gym-grpc's agent, not a harness, is the client. Here
the toolset's real `register` fills a real `MCPServer`, and its tools run
with their validation and error handling as MCP runs them; only the state
channel is replaced: a toolset's `_pull_state` hands the tool the rollout's
own state object (so what a tool writes is what the rewards read) and
`_push_state` has nothing to send. Those two are verifiers 0.4 internals;
the tests fail if they change.

Not provided: a runtime (sandbox). Task hooks get `runtime=None`, and a
taskset whose rewards or metrics need one is refused at start, rather than
scored without them as verifiers' offline scoring would.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import importlib
import inspect
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, field_validator

from gym_grpc import errors
from gym_grpc.adapters import missing_extra
from gym_grpc.data.rows import dumps, response_to_json
from gym_grpc.resources import (
    ResourcesConfig,
    ResourcesServer,
    Session,
    Verification,
    tool_arguments,
    unknown_tool,
)
from gym_grpc.v1 import responses_pb2 as r

try:
    import verifiers.v1 as vf
    from mcp.server.mcpserver import MCPServer
    from mcp.types import CallToolResult, TextContent
    from verifiers.v1.dialects.responses import ResponsesDialect
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.state import state_cls
    from verifiers.v1.types import content_text
    from verifiers.v1.utils.decorators import invoke
    from verifiers.v1.utils.generic import concrete_type
except ImportError as e:  # pragma: no cover - the extra's own message
    raise missing_extra("verifiers", "verifiers", e) from e

__all__ = [
    "TASK_KEY",
    "VerifiersTasksetConfig",
    "VerifiersTasksetServer",
    "build_taskset",
    "task_rows",
]

#: The row field that names its verifiers task (the task's `key`).
TASK_KEY = "verifiers_task_key"

#: The state of the rollout whose tool call (or toolset hook) is running.
_rollout_state: contextvars.ContextVar[vf.State | None] = contextvars.ContextVar("gym_grpc_vf_state", default=None)


def _import(ref: str) -> Any:
    module_name, sep, qualname = ref.partition(":")
    if not sep or not module_name or not qualname:
        raise ValueError(f"{ref!r} is not 'module:attribute'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"cannot import {module_name!r}: {e}") from None
    for name in qualname.split("."):
        if not hasattr(obj, name):
            raise ValueError(f"{module_name!r} has no attribute {qualname!r}")
        obj = getattr(obj, name)
    return obj


def _check_kind(obj: Any, ref: str) -> None:
    if isinstance(obj, vf.Taskset) or (isinstance(obj, type) and issubclass(obj, vf.Taskset)):
        return
    if isinstance(obj, type) or not callable(obj):
        raise ValueError(f"{ref!r} is a {type(obj).__name__}, not a verifiers Taskset, Taskset class or factory")


class VerifiersTasksetConfig(ResourcesConfig):
    taskset: str = Field(
        description="'module:attribute': a verifiers Taskset class, a Taskset, or a factory that returns one"
    )
    taskset_args: dict[str, Any] = Field(
        default_factory=dict,
        description="the Taskset class's config fields, or the factory's keyword arguments",
    )

    @field_validator("taskset")
    @classmethod
    def _names_a_taskset(cls, value: str) -> str:
        _check_kind(_import(value), value)
        return value


class _TasksetArgsError(ValueError):
    """`taskset_args` do not fit the taskset's config or the factory's parameters."""


def build_taskset(ref: str, args: dict[str, Any] | None = None) -> vf.Taskset:
    """The taskset `ref` ('module:attribute') names, built with `args`; ValueError saying what is wrong."""
    args = dict(args or {})
    obj = _import(ref)
    _check_kind(obj, ref)
    if isinstance(obj, vf.Taskset):
        if args:
            raise _TasksetArgsError(f"{ref!r} is a Taskset already: it takes no arguments")
        return obj
    if isinstance(obj, type):
        config_type = concrete_type(obj, vf.TasksetConfig, origin=vf.Taskset) or vf.TasksetConfig
        try:
            config = config_type.model_validate(args)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, x['loc'])) or '(all)'}: {x['msg']}" for x in e.errors())
            raise _TasksetArgsError(f"{config_type.__name__} of {ref}: {problems}") from None
        return obj(config)
    try:
        made = obj(**args)
    except TypeError as e:  # a keyword it does not take
        raise _TasksetArgsError(f"{ref}: {e}") from None
    except Exception as e:
        raise ValueError(f"{ref}(**taskset_args) raised {type(e).__name__}: {e}") from None
    if not isinstance(made, vf.Taskset):
        raise ValueError(f"{ref}(**taskset_args) returned a {type(made).__name__}, not a verifiers Taskset")
    return made


def _bind_state(toolset: vf.Toolset) -> vf.Toolset:
    """Make the toolset's tools see the calling rollout's state object (see the module doc)."""

    async def pull() -> vf.State:
        state = _rollout_state.get()
        return state if state is not None else state_cls(type(toolset))()

    async def push(before: bytes) -> None:
        return None  # the tool changed the rollout's own state object: nothing to send

    bound: Any = toolset
    bound._pull_state, bound._push_state = pull, push
    return toolset


@dataclass
class _Served:
    """Toolsets running in this process, and their tools by name."""

    toolsets: list[tuple[vf.Toolset, MCPServer]] = field(default_factory=list)
    tools: dict[str, tuple[MCPServer, r.FunctionTool]] = field(default_factory=dict)

    async def add(self, toolset: vf.Toolset, state: vf.State, task: vf.Task | None) -> None:
        _bind_state(toolset)
        token = _rollout_state.set(state)
        try:
            await toolset.setup()
            if task is not None:
                await toolset.setup_task(task)
            mcp = MCPServer(toolset.server_name or type(toolset).__name__)
            toolset.register(mcp)
            self.toolsets.append((toolset, mcp))
            for described in await mcp.list_tools():
                if described.name in self.tools:
                    raise errors.ConfigError(
                        f"tool {described.name!r} of {type(toolset).__name__} is offered by another toolset too"
                    )
                schema = r.FunctionTool(
                    name=described.name,
                    description=described.description or "",
                    parameters_json=dumps(described.input_schema or {"type": "object", "properties": {}}),
                )
                self.tools[described.name] = (mcp, schema)
        finally:
            _rollout_state.reset(token)

    async def close(self) -> None:
        while self.toolsets:
            toolset, _ = self.toolsets.pop()
            await toolset._exit_stack.aclose()


@dataclass
class _Rollout:
    task: vf.Task
    trace: vf.Trace
    served: _Served


def _trace(task: vf.Task) -> vf.Trace:
    """A fresh trace for `task`, as verifiers' Rollout makes one."""
    return vf.Trace(
        task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
        state=state_cls(type(task))(),
        agent=vf.AgentInfo(config=vf.AgentConfig()),
    )


def _prompt(task: vf.Task) -> list[vf.Message]:
    messages: list[vf.Message] = []
    if task.data.system_prompt:
        messages.append(vf.SystemMessage(content=task.data.system_prompt))
    prompt = task.data.prompt
    if isinstance(prompt, str):
        messages.append(vf.UserMessage(content=prompt))
    else:
        messages.extend(prompt or [])
    return messages


def _input_items(messages: list[vf.Message]) -> list[dict[str, Any]]:
    """A task's prompt as Responses input items (the text of each message)."""
    items: list[dict[str, Any]] = []
    for message in messages:
        if isinstance(message, vf.ToolMessage):
            items.append(
                {
                    "type": "function_call_output",
                    "call_id": message.tool_call_id,
                    "output": content_text(message.content),
                }
            )
            continue
        text = content_text(message.content) if message.content is not None else ""
        if text:
            items.append({"role": message.role, "content": text})
        for call in getattr(message, "tool_calls", None) or []:
            items.append({"type": "function_call", "call_id": call.id, "name": call.name, "arguments": call.arguments})
    return items


def _result_text(result: Any) -> tuple[str, bool]:
    if not isinstance(result, CallToolResult):
        return (result if isinstance(result, str) else json.dumps(result, default=str)), False
    parts = [
        part.text if isinstance(part, TextContent) else json.dumps(part.model_dump(mode="json"))
        for part in result.content
    ]
    if not parts and result.structured_content is not None:
        parts = [json.dumps(result.structured_content)]
    return "\n".join(parts), bool(result.is_error)


def _requires_runtime(fn: Any) -> bool:
    param = inspect.signature(fn).parameters.get("runtime")
    return param is not None and param.default is inspect.Parameter.empty


class VerifiersTasksetServer(ResourcesServer):
    """A verifiers taskset's tasks, tools and rewards behind gym-grpc's ResourcesService."""

    Config = VerifiersTasksetConfig
    config: VerifiersTasksetConfig

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        try:
            self.taskset = build_taskset(self.config.taskset, self.config.taskset_args)
            if not self.taskset.bounded:
                raise ValueError("the taskset is infinite: bound it (take, include) in a factory")
            self.tasks: dict[str, vf.Task] = {task.key: task for task in self.taskset}
        except ValueError as e:
            key = "taskset_args" if isinstance(e, _TasksetArgsError) else "taskset"
            raise errors.ConfigError(f"server {self.name!r}: config.{key}: {e}") from None
        for task in list(self.tasks.values())[:1]:
            needing = [fn.__name__ for kind in ("reward", "metric") for fn in task.hooks(kind) if _requires_runtime(fn)]
            if needing:
                raise errors.ConfigError(
                    f"server {self.name!r}: config.taskset: {type(task).__name__}'s {', '.join(needing)} need a "
                    "runtime (a sandbox), which this server does not provide"
                )
        self._shared = _Served()
        self._catalogue: dict[str, r.FunctionTool] = {}

    async def start(self) -> None:
        await super().start()
        try:
            self._catalogue = await _catalogue(self.taskset, self.tasks, self._shared)
        except errors.ConfigError as e:
            raise errors.ConfigError(f"server {self.name!r}: config.taskset: {e}") from None

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            await self._shared.close()

    def tool_schemas(self) -> list[r.FunctionTool]:
        return list(self._catalogue.values())

    def _task(self, session: Session) -> vf.Task:
        key = session.data.get(TASK_KEY)
        if not isinstance(key, str) or not key:
            raise errors.TaskDataError(TASK_KEY, "is required: the row's verifiers task (write rows with task_rows)")
        task = self.tasks.get(key)
        if task is None:
            raise errors.TaskDataError(TASK_KEY, f"no task of {self.config.taskset} has the key {key!r}")
        return task

    async def seed_session(self, session: Session) -> None:
        task = self._task(session)
        trace = _trace(task)
        served = _Served()
        session.state["rollout"] = _Rollout(task, trace, served)
        token = _rollout_state.set(trace.state)
        try:
            await invoke(task.setup, {"trace": trace, "runtime": None})
        finally:
            _rollout_state.reset(token)
        try:
            for toolset in task.toolsets(task.config):
                await served.add(toolset, trace.state, task)
        except BaseException:
            await served.close()
            raise

    async def close_session(self, session: Session) -> None:
        rollout = session.state.pop("rollout", None)
        if rollout is not None:
            await rollout.served.close()

    async def call_tool(self, session: Session, name: str, arguments: str) -> str:
        rollout: _Rollout | None = session.state.get("rollout")
        found = (rollout.served.tools.get(name) if rollout else None) or self._shared.tools.get(name)
        if found is None:
            raise unknown_tool(name, self._catalogue)
        parsed = tool_arguments(name, arguments)
        mcp, _ = found
        state = rollout.trace.state if rollout else None
        token = _rollout_state.set(state)
        try:
            result = await mcp.call_tool(name, parsed)
        except Exception as e:  # as MCP answers it: the tool's error is the model's to read
            raise errors.ToolFailed(str(e), metadata={"tool": name}) from None
        finally:
            _rollout_state.reset(token)
        text, failed = _result_text(result)
        if failed:
            raise errors.ToolFailed(text, metadata={"tool": name})
        return text

    async def verify(self, session: Session, response: r.Response) -> Verification:
        rollout: _Rollout | None = session.state.get("rollout")
        if rollout is None:  # no open session (reverify): a fresh state, as a new rollout would have
            task = self._task(session)
            trace = _trace(task)
        else:
            task, trace = rollout.task, rollout.trace
        trace.nodes.clear()
        output = response_to_json(response).get("output") or []
        messages = ResponsesDialect().parse_request({"input": output}).messages
        for message in _prompt(task):
            _add(trace, message, sampled=False)
        for message in messages:
            _add(trace, message, sampled=isinstance(message, vf.AssistantMessage))
        token = _rollout_state.set(trace.state)
        try:
            await invoke(task.finalize, {"trace": trace, "runtime": None})
            await task.score(trace, None)
        finally:
            _rollout_state.reset(token)
        return Verification(
            reward=trace.reward,
            fields={name: value for name, value in trace.metrics.items() if value is not None},
            components={name: reward.score for name, reward in trace.rewards.items() if reward is not None},
        )


def _add(trace: vf.Trace, message: vf.Message, sampled: bool) -> None:
    parent = len(trace.nodes) - 1 if trace.nodes else None
    trace.nodes.append(MessageNode(parent=parent, message=message, sampled=sampled))


async def _catalogue(taskset: vf.Taskset, tasks: dict[str, vf.Task], shared: _Served) -> dict[str, r.FunctionTool]:
    """Start the taskset's shared toolsets into `shared`; return every tool a rollout sees:
    theirs and those of the per-rollout toolsets (as the first task builds them)."""
    for toolset in type(taskset).toolsets(taskset.config):
        await shared.add(toolset, state_cls(type(toolset))(), None)
    catalogue = {name: schema for name, (_, schema) in shared.tools.items()}
    first = next(iter(tasks.values()), None)
    if first is not None:
        probe = _Served()
        try:
            for toolset in first.toolsets(first.config):
                await probe.add(toolset, _trace(first).state, first)
        finally:
            await probe.close()
        for name, (_, schema) in probe.tools.items():
            if name in catalogue:
                raise errors.ConfigError(f"tool {name!r} is offered by two toolsets")
            catalogue[name] = schema
    return catalogue


async def task_rows(taskset: vf.Taskset, limit: int | None = None) -> list[dict[str, Any]]:
    """The taskset's tasks as gym-grpc task rows: the prompt as Responses input items, the
    tools its toolsets offer, and the task's key (`verifiers_task_key`) to find it by."""
    tasks = list(taskset.take(limit) if limit is not None else taskset)
    shared = _Served()
    try:
        catalogue = await _catalogue(taskset, {task.key: task for task in tasks}, shared)
    finally:
        await shared.close()
    tools = [
        {"type": "function", "name": t.name, "description": t.description, "parameters": json.loads(t.parameters_json)}
        for t in catalogue.values()
    ]
    rows = []
    for task in tasks:
        params: dict[str, Any] = {"input": _input_items(_prompt(task))}
        if tools:
            params["tools"] = tools
        rows.append({"responses_create_params": params, TASK_KEY: task.key, "verifiers_task_name": task.data.name})
    return rows


def main(argv: list[str] | None = None) -> int:
    """`python -m gym_grpc.adapters.verifiers_server --taskset module:attr --output tasks.jsonl`."""
    parser = argparse.ArgumentParser(
        prog="python -m gym_grpc.adapters.verifiers_server",
        description="Write a verifiers taskset's tasks as a gym-grpc tasks JSONL.",
        allow_abbrev=False,
    )
    parser.add_argument("--taskset", required=True, help="'module:attribute', as the server's config.taskset")
    parser.add_argument("--taskset-args", default="{}", help="a JSON object, as the server's config.taskset_args")
    parser.add_argument("--output", required=True, type=Path, help="the JSONL to write (replaced)")
    parser.add_argument("--limit", type=int, default=None, help="the first N tasks only")
    options = parser.parse_args(argv)
    try:
        args = json.loads(options.taskset_args)
        if not isinstance(args, dict):
            raise ValueError("is not a JSON object")
    except ValueError as e:
        parser.error(f"--taskset-args: {e}")
    if str(Path.cwd()) not in sys.path:  # as `gym-grpc run`'s servers import it: from the current directory
        sys.path.insert(0, str(Path.cwd()))
    try:
        taskset = build_taskset(options.taskset, args)
    except ValueError as e:
        parser.error(f"--taskset: {e}")
    rows = asyncio.run(task_rows(taskset, options.limit))
    options.output.parent.mkdir(parents=True, exist_ok=True)
    options.output.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    print(f"{len(rows)} tasks -> {options.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
