"""MCP tools: the tools of one or several MCP servers, offered to the model through gym-grpc.

    servers:
      mcp_tools:
        entrypoint: server.py:McpToolsEnv
        config:
          mcp_servers:
            facts: {module: gym_grpc.bundled.servers.resources.mcp_tools.example_server}
            files: {command: npx, args: [-y, "@modelcontextprotocol/server-filesystem", /data]}
            search: {url: "http://127.0.0.1:8931/mcp", headers: {Authorization: "Bearer ..."}}

Each MCP server is a program spoken to over stdio (`command` + `args`, or
`module`: a Python module run with gym-grpc's own interpreter, `python -m`)
or a URL spoken to over streamable HTTP. At start the environment connects to
each, lists its tools, and DescribeTools offers them as function tools with
their input schemas unchanged. A tool keeps its MCP name, or gets the
server's `tool_prefix` in front; two servers offering the same name is a
ConfigError (give one a prefix). `tools:` keeps only the named tools.

CallTool checks the arguments against the tool's input schema (a mismatch is
TOOL_ARGUMENTS_INVALID, as for any environment) and calls the MCP tool.
Its text content is the output, its images image parts (gym_grpc/images.py);
other content is described in brackets: `[audio/wav audio, not shown]`. A result
with `isError`, an error the server answers (a JSON-RPC error, a time-out)
and a server that dies go back to the model as an error output; the
resources server goes on.

Sessions. By default (`per_session: false`) one process (or HTTP session) per
MCP server serves every rollout of this resources server: most MCP servers
are services (search, fetch, files, a database) and a process per rollout
would cost a start-up per rollout. If it dies, the call it was running is an
error output and the next call starts it again. `per_session: true` gives
each rollout its own process (or HTTP session), started at SeedSession and
stopped at CloseSession: for servers that keep state (notes, a browser, a
game) that must not leak between rollouts. A per-session server that dies
takes the rollout's state with it, so the call fails the rollout
(UNAVAILABLE, MCP_SERVER_UNAVAILABLE) instead of starting a blank one.

Stopping the resources server stops every process it started. A process
also ends on its own if this server is killed: its stdin closes (MCP servers
exit then; the `mcp` package's do).

The verifier: reward 1.0 when the final answer holds the task's
`expected_answer` (case and spacing aside; `answer_match: exact` wants the
whole answer to be it), 0.0 otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

try:
    import jsonschema
    from mcp.shared.exceptions import MCPError
    from mcp.types import REQUEST_TIMEOUT
except ImportError as e:  # pragma: no cover - the extra's own message
    raise ImportError(
        f"the mcp_tools environment needs the MCP SDK ({e.name}): pip install 'gym-grpc[mcp]'", name=e.name
    ) from e

from gym_grpc import errors
from gym_grpc.data.rows import dumps
from gym_grpc.resources import ResourcesConfig, ResourcesServer, Session, Verification, tool_arguments, unknown_tool
from gym_grpc.responses import final_text, function_calls, parts_text
from gym_grpc.v1 import responses_pb2 as r

from .connection import Connection, Endpoint, McpUnavailable, describe
from .content import result_output

log = logging.getLogger("gym_grpc.mcp_tools")


class McpServerConfig(BaseModel):
    """One MCP server: how to reach it, which of its tools to offer, and under which names."""

    model_config = ConfigDict(extra="forbid")

    command: str | None = Field(None, description="the program to run (looked up on PATH), spoken to over stdio")
    module: str | None = Field(None, description="a Python module to run with this server's interpreter (-m)")
    args: list[str] = Field(default_factory=list, description="the program's (or module's) arguments")
    env: dict[str, str] = Field(
        default_factory=dict, description="environment variables for the process, over HOME, PATH, USER, ..."
    )
    cwd: str | None = Field(None, description="the process's working directory; default: this server's")
    url: str | None = Field(None, description="a streamable HTTP endpoint, such as http://127.0.0.1:8000/mcp")
    headers: dict[str, str] = Field(default_factory=dict, description="HTTP headers sent to url (authorization)")
    tool_prefix: str = Field("", description="put in front of each tool's name, to keep two servers' tools apart")
    tools: list[str] | None = Field(None, description="offer only these tools (their MCP names); default: all")
    per_session: bool = Field(False, description="a process (HTTP session) per rollout, for servers with state")
    start_timeout_seconds: float = Field(60.0, gt=0, description="most time to start and complete the handshake")
    call_timeout_seconds: float = Field(120.0, gt=0, description="a tool call that takes longer is an error output")

    @model_validator(mode="after")
    def _one_way_in(self) -> McpServerConfig:
        given = [key for key in ("command", "module", "url") if getattr(self, key)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of command, module and url (got {', '.join(given) or 'none'})")
        if self.url is not None:
            stdio_only = [key for key in ("args", "env", "cwd") if getattr(self, key)]
            if stdio_only:
                raise ValueError(f"{', '.join(stdio_only)}: only for a command or module (stdio), not a url")
        elif self.headers:
            raise ValueError("headers: only for a url (streamable HTTP)")
        return self

    def endpoint(self, name: str) -> Endpoint:
        if self.url is not None:
            return Endpoint(name, url=self.url, headers=self.headers)
        command = [self.command] if self.command else [sys.executable, "-m", str(self.module)]
        return Endpoint(name, command=[*command, *self.args], env=self.env, cwd=self.cwd)


class McpToolsConfig(ResourcesConfig):
    mcp_servers: dict[str, McpServerConfig] = Field(
        min_length=1, description="the MCP servers whose tools the model gets, by a name of your choosing"
    )
    answer_match: Literal["contains", "exact"] = Field(
        "contains", description="reward when the final answer contains expected_answer, or is exactly it"
    )


class _Offered:
    """A tool as the model sees it, and the MCP server and name it calls."""

    def __init__(self, server: str, mcp_name: str, schema: r.FunctionTool, validator: Any) -> None:
        self.server = server
        self.mcp_name = mcp_name
        self.schema = schema
        self.validator = validator


def _validator(server: str, tool_name: str, schema: dict[str, Any]) -> Any:
    """A JSON-schema validator of a tool's arguments; None (the MCP server checks them) for a schema that
    is not one: liberal in what servers send."""
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        cls.check_schema(schema)
        return cls(schema)
    except Exception as e:
        log.warning(
            "MCP server %r: tool %r has an input schema that is not valid JSON schema (%s)", server, tool_name, e
        )
        return None


def _schema_problems(validator: Any, arguments: dict[str, Any]) -> str:
    problems = []
    for error in sorted(validator.iter_errors(arguments), key=lambda e: list(map(str, e.absolute_path))):
        where = ".".join(str(p) for p in error.absolute_path)
        problems.append(f"argument {where!r}: {error.message}" if where else error.message)
    return "; ".join(problems)


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().casefold()


class McpToolsEnv(ResourcesServer):
    """The tools of MCP servers behind gym-grpc's ResourcesService."""

    Config = McpToolsConfig
    config: McpToolsConfig
    verifier_fields = {
        "tool_calls": "tool calls the model made",
        "answer_found": "the final answer holds expected_answer (or equals it, with answer_match: exact)",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offered: dict[str, _Offered] = {}
        #: The shared connections, by MCP server name, and how many times each was started again.
        self._shared: dict[str, Connection] = {}
        self._reopening: dict[str, asyncio.Lock] = {}
        self.restarts: dict[str, int] = {}
        # Stateful only when a rollout has MCP processes of its own (SeedSession starts them).
        self.stateless = not any(spec.per_session for spec in self.config.mcp_servers.values())

    def _key(self, server: str) -> str:
        return f"server {self.name!r}: config.mcp_servers.{server}"

    async def _connect(self, server: str) -> Connection:
        spec = self.config.mcp_servers[server]
        connection = Connection(spec.endpoint(server), spec.call_timeout_seconds)
        await connection.open(spec.start_timeout_seconds)
        return connection

    async def start(self) -> None:
        try:
            self._offered = await self._catalogue()
        except BaseException:
            await self._close_shared()  # the processes started before the failure
            raise
        await super().start()

    async def _catalogue(self) -> dict[str, _Offered]:
        """Every MCP server's tools, by the name the model calls them."""
        listed = await asyncio.gather(*(self._catalogue_of(n) for n in self.config.mcp_servers), return_exceptions=True)
        for result in listed:
            if isinstance(result, BaseException):
                raise result
        offered: dict[str, _Offered] = {}
        for tools in listed:
            for tool in typing.cast(list[_Offered], tools):
                other = offered.get(tool.schema.name)
                if other is not None:
                    raise errors.ConfigError(
                        f"server {self.name!r}: config.mcp_servers: MCP servers {other.server!r} and {tool.server!r} "
                        f"both offer a tool named {tool.schema.name!r}; give one of them a tool_prefix (or list "
                        "the tools to offer in tools:)"
                    )
                offered[tool.schema.name] = tool
        return offered

    async def _catalogue_of(self, server: str) -> list[_Offered]:
        """Connect to an MCP server and list its tools; a shared server's connection is kept, a per-session
        server's (a probe) is closed."""
        spec = self.config.mcp_servers[server]
        try:
            connection = await self._connect(server)
        except McpUnavailable as e:
            raise errors.ConfigError(f"{self._key(server)}: cannot start or reach the MCP server: {e}") from None
        try:
            tools = await connection.list_tools()
        except Exception as e:
            await connection.close()
            raise errors.ConfigError(f"{self._key(server)}: listing its tools failed: {describe(e)}") from None
        if spec.per_session:
            await connection.close()
        else:
            self._shared[server] = connection
            self._reopening[server] = asyncio.Lock()
            self.restarts[server] = 0
        by_name = {tool.name: tool for tool in tools}
        missing = [name for name in spec.tools or () if name not in by_name]
        if missing:
            raise errors.ConfigError(
                f"{self._key(server)}.tools: {', '.join(map(repr, missing))} not among the MCP server's tools "
                f"({', '.join(sorted(by_name)) or 'none'})"
            )
        out = []
        for tool in tools:
            if spec.tools is not None and tool.name not in spec.tools:
                continue
            name = spec.tool_prefix + tool.name
            schema = r.FunctionTool(
                name=name, description=tool.description or "", parameters_json=dumps(dict(tool.input_schema))
            )
            out.append(_Offered(server, tool.name, schema, _validator(server, tool.name, dict(tool.input_schema))))
        return out

    async def stop(self) -> None:
        try:
            await super().stop()  # closes the sessions, and with them the per-session servers
        finally:
            await self._close_shared()

    async def _close_shared(self) -> None:
        connections, self._shared = list(self._shared.values()), {}
        await asyncio.gather(*(c.close() for c in connections))

    def tool_schemas(self) -> list[r.FunctionTool]:
        return [tool.schema for tool in self._offered.values()]

    # --- sessions -----------------------------------------------------------

    async def seed_session(self, session: Session) -> None:
        own = [name for name, spec in self.config.mcp_servers.items() if spec.per_session]
        connections: dict[str, Connection] = session.state.setdefault("mcp", {})
        opened = await asyncio.gather(*(self._connect(name) for name in own), return_exceptions=True)
        failed = None
        for name, result in zip(own, opened, strict=True):
            if isinstance(result, Connection):
                connections[name] = result
            elif failed is None:
                failed = (name, result)
        if failed is not None:
            await self.close_session(session)
            name, error = failed
            raise errors.Unavailable(
                f"MCP server {name!r} for session {session.id!r} could not be started: {describe(error)}",
                reason=errors.Reason.MCP_SERVER_UNAVAILABLE,
                metadata={"mcp_server": name},
            )

    async def close_session(self, session: Session) -> None:
        connections: dict[str, Connection] = session.state.pop("mcp", {})
        await asyncio.gather(*(c.close() for c in connections.values()))

    # --- tool calls ---------------------------------------------------------

    async def _shared_connection(self, server: str) -> Connection:
        """The shared connection to `server`, started again if it closed (McpUnavailable if that fails)."""
        connection = self._shared.get(server)
        if connection is not None and not connection.closed:
            return connection
        async with self._reopening[server]:
            connection = self._shared.get(server)
            if connection is None or connection.closed:
                if connection is not None:
                    await connection.close()
                again = "connecting again" if self.config.mcp_servers[server].url else "starting it again"
                log.warning("MCP server %r: its connection closed; %s", server, again)
                connection = self._shared[server] = await self._connect(server)
                self.restarts[server] += 1
        return connection

    @staticmethod
    def _own_connection(session: Session, server: str) -> Connection:
        connection = session.state.get("mcp", {}).get(server)
        if connection is None:
            raise McpUnavailable("the session has no connection to it")
        return connection

    async def call_tool(self, session: Session, name: str, arguments: str) -> str | list[r.ContentPart]:
        tool = self._offered.get(name)
        if tool is None:
            raise unknown_tool(name, self._offered)
        parsed = tool_arguments(name, arguments)
        if tool.validator is not None:
            problems = _schema_problems(tool.validator, parsed)
            if problems:
                raise errors.InvalidArgument(
                    f"tool {name!r}: {problems}",
                    field="arguments",
                    reason=errors.Reason.TOOL_ARGUMENTS_INVALID,
                    metadata={"tool": name},
                )
        server = tool.server
        per_session = self.config.mcp_servers[server].per_session
        failed = {"tool": name, "mcp_server": server}
        try:
            connection = self._own_connection(session, server) if per_session else await self._shared_connection(server)
            result = await connection.call(tool.mcp_name, parsed)
        except McpUnavailable as e:
            if per_session:
                raise errors.Unavailable(
                    f"MCP server {server!r} of session {session.id!r} is gone ({e}), and the rollout's tool state "
                    f"with it; tool {name!r} cannot be called",
                    reason=errors.Reason.MCP_SERVER_UNAVAILABLE,
                    metadata=failed,
                ) from None
            again = "connects again" if self.config.mcp_servers[server].url else "starts it again"
            raise errors.ToolFailed(
                f"MCP server {server!r} is unavailable ({e}); the call to {name!r} was lost. The next call {again}.",
                metadata=failed,
            ) from None
        except MCPError as e:  # an error the server answered, or the call timing out
            if e.error.code == REQUEST_TIMEOUT:
                timeout = self.config.mcp_servers[server].call_timeout_seconds
                raise errors.ToolFailed(
                    f"MCP server {server!r}: tool {name!r} did not answer within {timeout:g} s", metadata=failed
                ) from None
            raise errors.ToolFailed(f"MCP server {server!r}: {e.error.message}", metadata=failed) from None
        except ValueError as e:  # an answer that does not fit the protocol (pydantic)
            raise errors.ToolFailed(
                f"MCP server {server!r} answered {name!r} with {describe(e)}", metadata=failed
            ) from None
        output = result_output(result)
        if result.is_error:
            text = output if isinstance(output, str) else parts_text(output)
            raise errors.ToolFailed(text or f"tool {name!r} failed (the MCP server gave no message)", metadata=failed)
        return output

    # --- the verifier ---------------------------------------------------------

    async def verify(self, session: Session, response: r.Response) -> Verification:
        expected = session.data.get("expected_answer")
        if isinstance(expected, bool) or not isinstance(expected, str | int | float) or not str(expected).strip():
            raise errors.TaskDataError("expected_answer", "is required: the text the final answer must hold")
        answer, wanted = _normal(final_text(response)), _normal(str(expected))
        found = answer == wanted if self.config.answer_match == "exact" else wanted in answer
        return Verification(
            reward=1.0 if found else 0.0,
            fields={"tool_calls": len(function_calls(response)), "answer_found": found},
        )
