"""The resources role: an environment is a class with typed async tools and a verify.

    class WeatherEnv(ResourcesServer):
        @tool
        async def get_weather(self, city: str) -> str:
            \"\"\"Current weather in a city.\"\"\"
            return f"18 C and sunny in {city}"

        async def verify(self, session: Session, response: Response) -> float:
            return 1.0 if "18 C" in final_text(response) else 0.0

A tool's JSON schema comes from its signature (pydantic types; describe an
argument with `Annotated[str, Field(description=...)]`) and its description
from the docstring's first paragraph. A tool may also take a `Session`
parameter to reach the rollout's state; it is not part of the schema.

Tools live in their own namespace (`ResourcesServer.tools`): a tool may be
named `stop` or `verify` or after any other method of the base class without
replacing that method (the class keeps the base's; the model gets the tool).
A tool that raises is the model's problem, not the call's: CallTool answers
with its error as the output and `is_error` set.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import math
import time
import typing
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

import grpc
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.json_schema import GenerateJsonSchema

from gym_grpc import errors, images
from gym_grpc.data import json_input, rollout_stats
from gym_grpc.data.rows import dumps, json_field, params_to_json, task_data
from gym_grpc.images import Image
from gym_grpc.responses import input_text_part, parts_text
from gym_grpc.server import validation
from gym_grpc.server.serving import GymServer, ServerConfig, rpc_method
from gym_grpc.v1 import admin_service_pb2 as admin_pb
from gym_grpc.v1 import registry_service_pb2 as reg
from gym_grpc.v1 import resources_service_pb2 as res_pb
from gym_grpc.v1 import resources_service_pb2_grpc as res_grpc
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

log = logging.getLogger("gym_grpc.resources")

_NO_TASK = task_pb2.Task()

_TOOL_MARK = "__gym_tool__"


@dataclass
class Session:
    """One rollout's life on a resources server: its task and its state."""

    id: str
    task: task_pb2.Task
    #: Free for the environment to use between seed, tool calls and verify.
    state: dict[str, Any] = field(default_factory=dict)
    #: time.monotonic() when a call last used the session, and the calls using it now (for the idle time-out).
    last_used: float = field(default_factory=time.monotonic)
    in_flight: int = 0
    #: The latest attempt at the rollout that used the session: calls of older ones are refused.
    attempt: int = 0
    #: The tool calls made with an idempotency key, by key: each runs once (see CallToolRequest).
    calls: dict[str, asyncio.Future[res_pb.CallToolResponse]] = field(default_factory=dict)
    #: The images its tools returned, by hash: a Verify that names them by reference gets their bytes.
    images: dict[str, bytes] = field(default_factory=dict)
    #: In an episode with several roles, the role whose turn it is (None: not an episode, or over).
    turn: str | None = None

    def fence(self, attempt: int) -> None:
        """Refuse a call of an attempt older than the latest one seen (0: not checked); note a newer one."""
        if attempt and attempt < self.attempt:
            raise errors.StaleAttempt(
                f"session {self.id!r} was taken over by attempt {self.attempt} of its rollout; "
                f"this call comes from attempt {attempt}",
                field="attempt",
            )
        self.attempt = max(self.attempt, attempt)

    @cached_property
    def data(self) -> dict[str, Any]:
        """The task's free-form fields (expected_answer, ...) as a dict."""
        return task_data(self.task)


@dataclass
class Verification:
    """What verify returns: the reward, extra fields for the rollout row, and
    named parts of the reward for trainers that weigh several objectives."""

    reward: float
    fields: dict[str, Any] = field(default_factory=dict)
    components: dict[str, float] = field(default_factory=dict)
    #: Each role's reward in an episode with several roles (VerifyResponse.role_rewards).
    role_rewards: dict[str, float] = field(default_factory=dict)


def user_message(text: str) -> r.Item:
    """A user message item: what an environment usually shows a role (EpisodeTurn.input)."""
    return r.Item(message=r.Message(role=r.ROLE_USER, text=text))


@dataclass
class Role:
    """A role of an episode with several (EpisodeRole): its name, the messages its conversation
    opens with (None: the task's input), and whether its model is offered the task's tools."""

    name: str
    opening: list[r.Item] | None = None
    tools: bool = True


@dataclass
class Turn:
    """Whose turn it is in an episode, and what that role is shown (EpisodeTurn): `shown` is text
    for a user message, or items."""

    role: str
    shown: str | list[r.Item] = ""

    def message(self) -> res_pb.EpisodeTurn:
        if isinstance(self.shown, str):
            return res_pb.EpisodeTurn(role=self.role, input=[user_message(self.shown)] if self.shown else [])
        return res_pb.EpisodeTurn(role=self.role, input=self.shown)


@dataclass
class Episode:
    """What `seed_session` returns to run an episode with several roles: the roles, and the first turn.
    The environment then answers each role's end of turn (`end_turn`) with the next turn, or None when
    the episode is over."""

    roles: list[Role]
    first: Turn

    def message(self) -> res_pb.Episode:
        names = [role.name for role in self.roles]
        if not names or len(set(names)) != len(names) or not all(names):
            raise ValueError(f"an episode whose role names are not unique: {names}")
        if self.first.role not in names:
            raise ValueError(f"an episode's first turn is {self.first.role!r}'s, not one of the roles {names}")
        return res_pb.Episode(
            roles=[
                res_pb.EpisodeRole(name=role.name, opening=role.opening or [], without_tools=not role.tools)
                for role in self.roles
            ],
            turn=self.first.message(),
        )


def tool(fn: Callable | None = None, *, name: str | None = None) -> Any:
    """Mark an `async def` method of a ResourcesServer as a tool the model may call."""

    def mark(f: Callable) -> Callable:
        if not inspect.iscoroutinefunction(f):
            raise TypeError(f"tool {f.__qualname__} must be an async def")
        setattr(f, _TOOL_MARK, name or f.__name__)
        return f

    return mark(fn) if fn is not None else mark


class _ToolSchema(GenerateJsonSchema):
    """JSON schema without pydantic's generated titles, as tool schemas are written."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def generate(self, schema: Any, mode: Any = "validation") -> dict[str, Any]:
        out = super().generate(schema, mode)
        out.pop("title", None)
        return out


@dataclass(frozen=True)
class _Tool:
    name: str
    method: Callable
    arguments: type[BaseModel]
    session_param: str | None
    schema: r.FunctionTool
    #: The names of the arguments' fields, read once (pydantic's model_fields costs a lookup per call).
    fields: tuple[str, ...] = ()


def _describe(method: Callable) -> str:
    doc = inspect.getdoc(method) or ""
    return doc.split("\n\n", 1)[0].replace("\n", " ").strip()


def _build_tool(name: str, method: Callable) -> _Tool:
    hints = typing.get_type_hints(method, include_extras=True)
    fields: dict[str, Any] = {}
    session_param = None
    for pname, param in list(inspect.signature(method).parameters.items())[1:]:
        annotation = hints.get(pname, Any)
        if annotation is Session:
            session_param = pname
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool {name}: *args and **kwargs cannot be described to a model")
        default = ... if param.default is param.empty else param.default
        fields[pname] = (annotation, default)
    arguments = create_model(f"{name}_arguments", __config__=ConfigDict(extra="forbid"), **fields)
    parameters = dumps(arguments.model_json_schema(schema_generator=_ToolSchema))
    schema = r.FunctionTool(name=name, description=_describe(method), parameters_json=parameters)
    return _Tool(name, method, arguments, session_param, schema, tuple(arguments.model_fields))


def _argument_error(tool_name: str, error: ValidationError) -> errors.InvalidArgument:
    problems = []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"])
        problems.append(f"argument {where!r}: {e['msg']}" if where else e["msg"])
    return _bad_arguments(tool_name, "; ".join(problems))


def unknown_tool(name: str, known: Iterable[str]) -> errors.NotFound:
    """The error of a call to a tool the environment does not have, listing those it has."""
    return errors.NotFound(
        f"unknown tool {name!r} (tools: {', '.join(sorted(known)) or 'none'})",
        field="name",
        reason=errors.Reason.TOOL_NOT_FOUND,
        metadata={"tool": name},
    )


def tool_arguments(name: str, arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the model wrote them (JSON text, bounded in depth) as an object;
    INVALID_ARGUMENT (TOOL_ARGUMENTS_INVALID) naming the tool otherwise. Empty text is no arguments."""
    try:
        parsed = json_input.loads(arguments) if arguments.strip() else {}
    except json_input.TooDeep as e:
        raise _bad_arguments(name, f"arguments are {e}") from None
    except json.JSONDecodeError as e:
        raise _bad_arguments(name, f"arguments are not valid JSON ({e}): {arguments[:200]!r}") from None
    if not isinstance(parsed, dict):
        raise _bad_arguments(name, f"arguments must be a JSON object, got {type(parsed).__name__}")
    return parsed


def _bad_arguments(tool_name: str, problem: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(
        f"tool {tool_name!r}: {problem}",
        field="arguments",
        reason=errors.Reason.TOOL_ARGUMENTS_INVALID,
        metadata={"tool": tool_name},
    )


#: ResourcesServer.session_recovery's values, and what each is on the wire.
_RECOVERY = {"none": res_pb.SESSION_RECOVERY_UNSPECIFIED, "replay": res_pb.SESSION_RECOVERY_REPLAY}


class ResourcesConfig(ServerConfig):
    """Settings every environment has; an environment's own Config extends it."""

    verify_timeout_seconds: float = Field(
        300.0, gt=0, description="a verify that takes longer fails its rollout (the server goes on)"
    )
    session_idle_timeout_seconds: float | None = Field(
        1800.0,
        gt=0,
        description="a session no call used for this long is closed (its agent died or gave up); null: never",
    )
    # Far above the in-flight rollouts of one server process (16,000 is routine),
    # so only a leak reaches it: agents that seed sessions and never close them
    # would otherwise grow the process until the idle time-out catches up.
    max_sessions: int | None = Field(
        50_000,
        ge=1,
        description="most sessions open at once; SeedSession beyond it is RESOURCE_EXHAUSTED; null: no cap",
    )


class ResourcesServer(GymServer):
    """Base of an environment. Declare tools with @tool; implement verify."""

    role = reg.SERVER_ROLE_RESOURCES
    Config: ClassVar[type[ServerConfig]] = ResourcesConfig
    #: The tools by name: their own namespace, apart from the class's methods.
    tools: ClassVar[dict[str, _Tool]] = {}
    _own_tools: ClassVar[dict[str, _Tool]] = {}
    #: No per-rollout state: no seed_session or close_session, no tool takes the Session.
    #: Agents then skip SeedSession and CloseSession (two calls fewer per rollout). Set per
    #: class from its hooks; an environment whose state depends on its config (one that
    #: overrides the hooks but needs them only for some configs) may set it on the instance.
    stateless: bool = True
    #: The `fields` verify returns (they become columns of the rollout row), each with what it
    #: means: `gym-grpc envs` shows them, and the conformance kit checks that verify returns
    #: no other. Empty: not declared (an environment whose fields depend on its data).
    verifier_fields: ClassVar[dict[str, str]] = {}
    #: What a resumed rollout can do when its session is lost (SessionRecovery in the .proto):
    #: "none", or "replay" for an environment whose session state is a function of its task and
    #: the tool calls made in it (deterministic, nothing touched outside the session): a new
    #: session is seeded and the recorded calls run again, in order.
    session_recovery: ClassVar[str] = "none"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        found: dict[str, _Tool] = {}
        for klass in reversed(cls.__mro__[1:]):
            found.update(vars(klass).get("_own_tools", {}))
        own: dict[str, _Tool] = {}
        for attr_name, attr in list(vars(cls).items()):
            name = getattr(attr, _TOOL_MARK, None)
            if name is None:
                continue
            own[name] = _build_tool(name, attr)
            # Tools live in their own namespace (`tools`): a tool named like a method of the
            # base class (stop, verify, start, seed_session...) must not replace that method.
            if hasattr(ResourcesServer, attr_name):
                delattr(cls, attr_name)
        if cls.session_recovery not in _RECOVERY:
            raise TypeError(
                f"{cls.__name__}.session_recovery must be one of {', '.join(map(repr, _RECOVERY))}, "
                f"not {cls.session_recovery!r}"
            )
        cls._own_tools = own
        found.update(own)
        cls.tools = found
        cls.stateless = (
            cls.seed_session is ResourcesServer.seed_session
            and cls.close_session is ResourcesServer.close_session
            and all(t.session_param is None for t in found.values())
        )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sessions: dict[str, Session] = {}
        self.counters.sessions_open = lambda: len(self.sessions)
        self._sweeper: asyncio.Task | None = None

    def capabilities(self) -> admin_pb.Capabilities:
        capabilities = super().capabilities()
        capabilities.max_sessions = getattr(self.config, "max_sessions", None) or 0
        return capabilities

    @classmethod
    def tool_definitions(cls) -> list[dict[str, Any]]:
        """The tools as a task row offers them (`responses_create_params.tools`), for writing data."""
        if not cls.tools:
            return []
        return params_to_json(r.CreateParams(tools=[r.Tool(function=t.schema) for t in cls.tools.values()]))["tools"]

    def task_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Hook of an environment that makes its own tasks from its configuration (a procedural
        generator, seeded games): its task rows, the first `limit` of them. `gym-grpc
        prepare-data --generate` writes them for a dataset `generated_by` this server."""
        raise NotImplementedError(f"{type(self).__name__} does not write task rows")

    def tool_schemas(self) -> list[r.FunctionTool]:
        """The tools DescribeTools lists; an environment whose tools are not @tool methods
        (a wrapped framework's) overrides it, with call_tool."""
        return [t.schema for t in self.tools.values()]

    # --- what an environment implements ------------------------------------

    async def seed_session(self, session: Session) -> Episode | None:
        """Hook: set up `session.state` from `session.task` before any tool call. Return an Episode to
        run an episode with several roles (docs/episodes.md); None: one agent plays the task."""
        return None

    async def end_turn(self, session: Session, role: str, response: r.Response) -> Turn | None:
        """Hook of an episode with several roles: `role`'s turn ended with `response` (its model's
        answer without a tool call: `final_text(response)` is its move or message). Return the next
        turn, or None when the episode is over. Called only for the role whose turn it was."""
        raise errors.FailedPrecondition(
            f"environment {self.name!r} runs no episodes with several roles",
            reason=errors.Reason.EPISODE_TURN_INVALID,
        )

    async def verify(self, session: Session, response: r.Response) -> Verification | float:
        """Score the rollout's final response. Return a reward or a Verification.

        The session is the rollout's open one when there is one. Verify also
        runs without: `gym-grpc reverify` scores old rollouts, and a session
        may have been closed by the idle time-out. Then `session.task` is the
        task sent with the request and `session.state` is empty; a stateful
        environment should score from the response (or replay its tool calls).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement verify")

    async def close_session(self, session: Session) -> None:
        """Hook: release what seed_session or the tools acquired."""

    async def aggregate_metrics(self, results: list[task_pb2.VerificationResult]) -> dict[str, Any]:
        """Metrics over many verified rollouts; by default the mean of every numeric field (the reward, the
        verifier's fields, each reward component: `rollout_stats.numeric_means`). `collect` adds them to
        its summary beside its own numbers, which win for a name both have."""
        rows = [
            {
                "reward": x.reward,
                **json_field(x, "fields"),
                **{f"reward_components.{k}": v for k, v in x.reward_components.items()},
            }
            for x in results
        ]
        return {"num_rollouts": len(rows), **rollout_stats.numeric_means(rows)}

    # --- plumbing -----------------------------------------------------------

    def add_services(self, server: grpc.aio.Server) -> list[str]:
        res_grpc.add_ResourcesServiceServicer_to_server(_ResourcesServicer(self), server)
        return [res_pb.DESCRIPTOR.services_by_name["ResourcesService"].full_name]

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        try:
            for session_id in list(self.sessions):
                await self._end_quietly(session_id)
        finally:
            await super().stop()

    def open_session(self, session_id: str) -> Session:
        """The open session `session_id`; FAILED_PRECONDITION (SESSION_NOT_OPEN) when there is none."""
        session = self.sessions.get(session_id)
        if session is None:
            raise errors.FailedPrecondition(
                f"session {session_id!r} is not open: call SeedSession first (idle sessions are closed)",
                field="session_id",
                reason=errors.Reason.SESSION_NOT_OPEN,
            )
        return session

    async def end_session(self, session_id: str) -> bool:
        """Forget a session and run close_session on it; False if it was not open."""
        session = self.sessions.pop(session_id, None)
        if session is None:
            return False
        with _hook("close_session"):
            await self.close_session(session)
        return True

    async def _end_quietly(self, session_id: str) -> None:
        """end_session where nobody waits for an answer (idle time-out, stop): a failure is only logged."""
        try:
            await self.end_session(session_id)
        except errors.GymError:
            pass  # _hook logged it; the session is gone either way

    def _watch_idle_sessions(self) -> None:
        limit = getattr(self.config, "session_idle_timeout_seconds", None)
        if limit is not None and (self._sweeper is None or self._sweeper.done()):
            self._sweeper = asyncio.create_task(self._close_idle_sessions(limit))

    async def _close_idle_sessions(self, limit: float) -> None:
        """Close the sessions of rollouts that stopped calling, so a dead agent leaks nothing."""
        while True:
            await asyncio.sleep(min(limit / 4, 60.0))
            cutoff = time.monotonic() - limit
            for session_id in [s.id for s in self.sessions.values() if s.last_used < cutoff and not s.in_flight]:
                log.warning("closing session %r: no call for %g s", session_id, limit)
                await self._end_quietly(session_id)

    async def call_tool(self, session: Session, name: str, arguments: str) -> str | list[r.ContentPart]:
        """Run one tool call: parse and check the arguments, run the tool, render its output:
        text (a string as it is, anything else as JSON), or content parts when the tool returned an
        `Image` or a list holding images (its strings text parts, anything else JSON text parts).

        A tool that raises (anything but a GymError other than ToolFailed) raises ToolFailed,
        with the tool's error as the message, for the model."""
        spec = self.tools.get(name)
        if spec is None:
            raise unknown_tool(name, self.tools)
        parsed = tool_arguments(name, arguments)
        try:
            args = spec.arguments.model_validate(parsed)
        except ValidationError as e:
            raise _argument_error(name, e) from None
        kwargs = {k: getattr(args, k) for k in spec.fields}
        if spec.session_param is not None:
            kwargs[spec.session_param] = session
        try:
            result = await spec.method(self, **kwargs)
        except errors.GymError:
            raise
        except Exception as e:
            log.debug("tool %s raised", name, exc_info=True)
            raise errors.ToolFailed(
                f"tool {name!r} raised {type(e).__name__}: {e}", metadata={"tool": name}, detail=repr(e)
            ) from None
        return rendered(result)


def rendered(result: Any) -> str | list[r.ContentPart]:
    """A tool's return value as its output (see ResourcesServer.call_tool)."""
    if isinstance(result, str):
        return result
    if isinstance(result, Image):
        return [result.part()]
    if isinstance(result, list) and any(isinstance(x, Image) for x in result):
        return [
            x.part() if isinstance(x, Image) else input_text_part(x if isinstance(x, str) else json.dumps(x))
            for x in result
        ]
    return json.dumps(result)


@contextlib.contextmanager
def _hook(name: str, failure: type[errors.GymError] = errors.GymError) -> Iterator[None]:
    """Run an environment's hook: its own GymErrors pass; any other exception is
    logged with its traceback and becomes `failure` (HOOK_FAILED unless `failure`
    has a reason of its own), naming the hook and the error."""
    try:
        yield
    except errors.GymError:
        raise
    except Exception as e:
        log.exception("%s failed", name)
        reason = errors.Reason.HOOK_FAILED if failure is errors.GymError else None
        raise failure(f"{name} raised {type(e).__name__}: {e}", reason=reason, metadata={"hook": name}) from None


def _verification(result: Any) -> res_pb.VerifyResponse:
    roles: dict[str, float] = {}
    if isinstance(result, Verification):
        reward, fields, components, roles = result.reward, result.fields, result.components, result.role_rewards
    else:
        reward, fields, components = result, {}, {}
    if isinstance(reward, bool):
        reward = float(reward)
    if not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise errors.VerifierFailed(f"verify returned reward {reward!r}; expected a finite number")
    reply = res_pb.VerifyResponse(reward=float(reward))
    try:
        reply.fields_json = dumps(dict(fields)) if fields else ""
    except (TypeError, ValueError) as e:
        raise errors.VerifierFailed(f"verify returned fields that are not JSON data: {e}") from None
    for name, value in components.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise errors.VerifierFailed(f"verify returned reward component {name!r} = {value!r}; expected a number")
        reply.reward_components[name] = float(value)
    for name, value in roles.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise errors.VerifierFailed(f"verify returned role reward {name!r} = {value!r}; expected a number")
        reply.role_rewards[name] = float(value)
    return reply


class _ResourcesServicer(res_grpc.ResourcesServiceServicer):
    """The gRPC face of a ResourcesServer: checks requests, calls its hooks."""

    def __init__(self, app: ResourcesServer) -> None:
        self.app = app

    def _session(self, session_id: str) -> Session:
        session = self.app.sessions.get(session_id)
        if session is None and self.app.stateless:
            return Session(id=session_id, task=_NO_TASK)
        return session if session is not None else self.app.open_session(session_id)

    @rpc_method
    async def SeedSession(self, request: res_pb.SeedSessionRequest, context: Any) -> res_pb.SeedSessionResponse:
        if not request.session_id:
            raise errors.InvalidArgument("session_id is required", field="session_id")
        validation.check_items(
            request.task.responses_create_params.input_items.items, "task.responses_create_params.input_items.items"
        )
        if request.session_id in self.app.sessions:
            raise errors.FailedPrecondition(
                f"session {request.session_id!r} is already open",
                field="session_id",
                reason=errors.Reason.SESSION_ALREADY_OPEN,
            )
        cap = getattr(self.app.config, "max_sessions", None)
        if cap is not None and len(self.app.sessions) >= cap:
            raise errors.ResourceExhausted(
                f"{len(self.app.sessions)} sessions are open, this server's cap (config max_sessions: {cap}); "
                "close finished sessions, or raise max_sessions or lower session_idle_timeout_seconds",
                reason=errors.Reason.SESSIONS_EXHAUSTED,
                metadata={"max_sessions": str(cap)},
            )
        # Held from the start, so a second SeedSession with the same id is refused, not raced.
        session = self.app.sessions[request.session_id] = Session(id=request.session_id, task=request.task)
        session.in_flight += 1
        try:
            with _hook("seed_session"):
                episode = await self.app.seed_session(session)
                reply = res_pb.SeedSessionResponse(replica=self.app.replica)
                if episode is not None:
                    reply.episode.CopyFrom(episode.message())
                    session.turn = episode.first.role
        except BaseException:
            del self.app.sessions[session.id]
            raise
        finally:
            session.in_flight -= 1
        self.app._watch_idle_sessions()
        return reply

    @rpc_method
    async def EndTurn(self, request: res_pb.EndTurnRequest, context: Any) -> res_pb.EndTurnResponse:
        validation.check_response(request.response, "response")
        session = self._session(request.session_id)
        if session.id not in self.app.sessions or session.turn is None or session.turn != request.role:
            whose = "over or not an episode" if session.turn is None else f"{session.turn!r}'s turn"
            raise errors.FailedPrecondition(
                f"role {request.role!r} cannot end a turn in session {session.id!r}: it is {whose}",
                field="role",
                reason=errors.Reason.EPISODE_TURN_INVALID,
            )
        session.in_flight += 1
        try:
            with _hook("end_turn"):
                turn = await self.app.end_turn(session, request.role, request.response)
                reply = res_pb.EndTurnResponse()
                if turn is not None:
                    reply.next.CopyFrom(turn.message())
        finally:
            session.in_flight -= 1
            session.last_used = time.monotonic()
        session.turn = turn.role if turn is not None else None
        return reply

    @rpc_method
    async def CallTool(self, request: res_pb.CallToolRequest, context: Any) -> res_pb.CallToolResponse:
        if not request.name:
            raise errors.InvalidArgument("name: is required", field="name")
        session = self._session(request.session_id)
        session.fence(request.attempt)
        session.in_flight += 1  # the idle time-out never closes a session under a running call
        try:
            key = request.idempotency_key
            if not key or session.id not in self.app.sessions:  # no record, or no session to keep it in
                return await self._call_tool(session, request)
            recorded = session.calls.get(key)
            if recorded is None:
                # Its own task: the call runs to its end, and is recorded, even when its caller goes away.
                recorded = session.calls[key] = asyncio.ensure_future(self._call_tool(session, request))
                recorded.add_done_callback(functools.partial(_forget_failed, session.calls, key))
            return await asyncio.shield(recorded)
        finally:
            session.in_flight -= 1
            session.last_used = time.monotonic()

    async def _call_tool(self, session: Session, request: res_pb.CallToolRequest) -> res_pb.CallToolResponse:
        try:
            output = await self.app.call_tool(session, request.name, request.arguments)
        except errors.ToolFailed as e:
            # The model's problem, not the call's: its error goes back to the model as the tool's output.
            return res_pb.CallToolResponse(output=e.message, is_error=True)
        if isinstance(output, str):
            return res_pb.CallToolResponse(output=output)
        reply = res_pb.CallToolResponse(output=parts_text(output), parts=output)
        if session.id in self.app.sessions:
            session.images.update(
                (images.sha256_of(p.input_image), p.input_image.data) for p in reply.parts if p.input_image.data
            )
        return reply

    @rpc_method
    async def ResumeSession(self, request: res_pb.ResumeSessionRequest, context: Any) -> res_pb.ResumeSessionResponse:
        session = self.app.sessions.get(request.session_id)
        if session is None:
            raise errors.FailedPrecondition(
                f"session {request.session_id!r} is not open here: it was closed, timed out, or its replica restarted",
                field="session_id",
                reason=errors.Reason.SESSION_NOT_OPEN,
            )
        session.fence(request.attempt)
        session.last_used = time.monotonic()
        return res_pb.ResumeSessionResponse()

    @rpc_method
    async def Verify(self, request: res_pb.VerifyRequest, context: Any) -> res_pb.VerifyResponse:
        validation.check_response(request.response, "response")
        # Verification needs no open session (re-scoring old rollouts has none).
        session = self.app.sessions.get(request.session_id) or Session(id=request.session_id, task=request.task)
        images.fill(request.response.output, session.images)  # what its tools returned, named by hash
        limit = getattr(self.app.config, "verify_timeout_seconds", None)
        session.in_flight += 1
        try:
            with _hook("verify", errors.VerifierFailed):
                began = time.monotonic()
                try:
                    async with asyncio.timeout(limit):  # no task of its own, as wait_for makes
                        result = await self.app.verify(session, request.response)
                    # A verify that ends past its limit fails too, whichever of its end and the
                    # time-out the event loop saw first (a busy loop sees both at once).
                    if limit is not None and time.monotonic() - began > limit:
                        raise TimeoutError
                except TimeoutError:
                    raise errors.VerifierFailed(
                        f"verify did not finish within {limit:g} s (config verify_timeout_seconds)",
                        reason=errors.Reason.VERIFIER_TIMED_OUT,
                    ) from None
        finally:
            session.in_flight -= 1
            session.last_used = time.monotonic()
        return _verification(result)

    @rpc_method
    async def CloseSession(self, request: res_pb.CloseSessionRequest, context: Any) -> res_pb.CloseSessionResponse:
        await self.app.end_session(request.session_id)
        return res_pb.CloseSessionResponse()

    @rpc_method
    async def AggregateMetrics(
        self, request: res_pb.AggregateMetricsRequest, context: Any
    ) -> res_pb.AggregateMetricsResponse:
        reply = res_pb.AggregateMetricsResponse()
        reply.metrics.update(await self.app.aggregate_metrics(list(request.results)))
        return reply

    @rpc_method
    async def DescribeTools(self, request: res_pb.DescribeToolsRequest, context: Any) -> res_pb.DescribeToolsResponse:
        return res_pb.DescribeToolsResponse(
            tools=self.app.tool_schemas(),
            stateless=self.app.stateless,
            session_recovery=_RECOVERY[self.app.session_recovery],
        )


def _forget_failed(calls: dict[str, asyncio.Future[Any]], key: str, call: asyncio.Future[Any]) -> None:
    """A keyed call that failed (the model's bad call, a server it needs down) is not recorded:
    it changed nothing, and its next try runs it."""
    if call.cancelled() or call.exception() is not None:
        calls.pop(key, None)
