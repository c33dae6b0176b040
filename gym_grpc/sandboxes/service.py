"""SandboxService: the session's sandbox over gRPC, for what works in it beside the model's tools."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import grpc

from gym_grpc import errors
from gym_grpc.resources import Session
from gym_grpc.server.serving import rpc_method
from gym_grpc.v1 import sandbox_service_pb2 as sb_pb
from gym_grpc.v1 import sandbox_service_pb2_grpc as sb_grpc

from .provider import CommandResult

if TYPE_CHECKING:
    from .environment import SandboxEnvironment


def add_sandbox_service(app: SandboxEnvironment, server: grpc.aio.Server) -> str:
    sb_grpc.add_SandboxServiceServicer_to_server(_SandboxServicer(app), server)
    return sb_pb.DESCRIPTOR.services_by_name["SandboxService"].full_name


def _exec_reply(result: CommandResult) -> sb_pb.ExecResponse:
    return sb_pb.ExecResponse(
        exit_code=result.exit_code,
        stdout=result.stdout,
        stderr=result.stderr,
        stdout_bytes=result.stdout_bytes,
        stderr_bytes=result.stderr_bytes,
        timed_out=result.timed_out,
        seconds=result.seconds,
    )


def _path(path: str) -> str:
    if not path.startswith("/"):
        raise errors.InvalidArgument(f"path must be absolute inside the sandbox, not {path!r}", field="path")
    return path


class _SandboxServicer(sb_grpc.SandboxServiceServicer):
    def __init__(self, app: SandboxEnvironment) -> None:
        self.app = app

    @asynccontextmanager
    async def _session(self, session_id: str) -> AsyncIterator[Session]:
        session = self.app.open_session(session_id)
        session.in_flight += 1  # the idle time-out never closes a session under a running call
        try:
            yield session
        finally:
            session.in_flight -= 1
            session.last_used = time.monotonic()

    @rpc_method
    async def Exec(self, request: sb_pb.ExecRequest, context: Any) -> sb_pb.ExecResponse:
        if bool(request.argv) == bool(request.shell):
            raise errors.InvalidArgument("give the command as argv or as shell, one of them", field="argv")
        if request.cwd:
            _path(request.cwd)
        async with self._session(request.session_id) as session:
            sandbox = await self.app.sandbox(session)
            for forward in request.forwards:
                await sandbox.forward(forward.port, forward.target)
            result = await self.app.run_in_sandbox(
                session,
                list(request.argv) or request.shell,
                stdin=request.stdin,
                cwd=request.cwd,
                env=dict(request.env),
                timeout=request.timeout_seconds or None,
                max_output=request.max_output_bytes or None,
            )
        return _exec_reply(result)

    @rpc_method
    async def ReadFile(self, request: sb_pb.ReadFileRequest, context: Any) -> sb_pb.ReadFileResponse:
        async with self._session(request.session_id) as session:
            sandbox = await self.app.sandbox(session)
            limit = request.max_bytes or self.app.config.sandbox.max_output_bytes
            data, size = await sandbox.read_file(_path(request.path), limit)
        return sb_pb.ReadFileResponse(data=data, size=size)

    @rpc_method
    async def WriteFile(self, request: sb_pb.WriteFileRequest, context: Any) -> sb_pb.WriteFileResponse:
        async with self._session(request.session_id) as session:
            sandbox = await self.app.sandbox(session)
            await sandbox.write_file(_path(request.path), request.data, request.mode or 0o644)
        return sb_pb.WriteFileResponse()

    @rpc_method
    async def ListFiles(self, request: sb_pb.ListFilesRequest, context: Any) -> sb_pb.ListFilesResponse:
        async with self._session(request.session_id) as session:
            sandbox = await self.app.sandbox(session)
            entries = await sandbox.list_files(_path(request.path))
        return sb_pb.ListFilesResponse(
            entries=[sb_pb.FileEntry(name=e.name, type=e.type, size=e.size) for e in entries]
        )
