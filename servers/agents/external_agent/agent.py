"""An agent we did not write: any program that talks to an OpenAI-compatible `base_url`.

For each rollout (AgentService.Run) the server opens the environment's
session, starts the configured program (`command`, or `python`: a module of
this server's Python) with the rollout's addresses in its environment, and
serves it an OpenAI endpoint over HTTP (endpoint.py):

    OPENAI_BASE_URL      http://127.0.0.1:PORT/s/SESSION/v1   (the openai SDK reads it by itself)
    OPENAI_API_KEY       the session id (also accepted as the bearer token on /v1/...)
    GYM_GRPC_SESSION_ID  the session id
    GYM_GRPC_TASK_FILE   the task row as JSON: responses_create_params (input, tools) and the task's fields
    GYM_GRPC_TOOLS_URL   POST {url}/{tool name} with the arguments as the JSON body runs a tool of the environment

Every Chat Completions or Responses call under that session goes to the
configured model server and is recorded with its token ids (recording.py).
When the program exits, the recorded conversation becomes the rollout, which
the resources server verifies like any other; then the session closes.

The rollout fails, with the reason AGENT_PROCESS_FAILED and the end of the
program's stderr, when the program cannot start, exits with a non-zero code
or exits without calling the model; it fails with a server's own error when
the model server or the environment failed under it; and it is stopped with
DEADLINE_EXCEEDED after `timeout_seconds` (or the Run call's deadline, if
sooner). In every case the program and everything it started are stopped.
At `max_steps` model calls the program is stopped and the rollout verified
as it stands (stop reason max_steps).

With `in_sandbox`, the program runs inside the rollout's own sandbox instead
(an environment with sandboxes, gym_grpc/sandboxes: SandboxService.Exec on the
session's replica): the task file goes to /tmp/gym-agent (with a `python`
program's module, whose imports come from the server's Python, shown read-only
when the environment sets `sandbox.python_packages`), and the endpoint's port
inside the sandbox is forwarded to the endpoint, the one address the program
can reach. A `command` must name a program the sandbox has. The program's
environment is then only `env` and the variables above, none of the server's.

The tool loop's hooks apply: `call_model` makes every model call and
`call_tool` every tool call of the endpoint (this class is a ToolLoopAgent
whose loop runs in another program).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from gym_grpc import errors, policy_version
from gym_grpc.agent import RolloutEvents, ToolLoopAgent, ToolLoopConfig
from gym_grpc.data import rows
from gym_grpc.rpc import transport
from gym_grpc.v1 import sandbox_service_pb2 as sb_pb
from gym_grpc.v1 import task_pb2

from .endpoint import Endpoint
from .process import TAIL_BYTES, AgentProcess, describe_exit
from .recording import Recording

#: Where the program's files (the task, a python program's module) go in a sandbox (`in_sandbox`).
SANDBOX_DIR = "/tmp/gym-agent"
#: Bytes of the program's output a sandbox returns (the message of a failure quotes its end).
SANDBOX_OUTPUT_BYTES = 1 << 16
#: Seconds past the program's limit its Exec may take to answer (the sandbox kills it at the limit).
SANDBOX_GRACE_SECONDS = 30.0

#: Runs "module:function" in the child: its return value (awaited if it is a coroutine) is the exit status.
_CALL_FUNCTION = (
    "import asyncio, importlib, inspect, sys; "
    "f = getattr(importlib.import_module(sys.argv[1]), sys.argv[2]); sys.argv[1:] = sys.argv[3:]; "
    "r = f(); sys.exit(asyncio.run(r) if inspect.iscoroutine(r) else r)"
)


class ExternalAgentConfig(ToolLoopConfig):
    command: list[str] | None = Field(
        None, min_length=1, description="the agent program and its arguments, started once per rollout"
    )
    python: str | None = Field(
        None,
        description='"package.module" (run as python -m) or "package.module:function", run by this '
        'server\'s Python with its import path; a leading "." names a module beside this server',
    )
    cwd: str | None = Field(None, description="the program's working directory; default: the server's")
    env: dict[str, str] = Field(default_factory=dict, description="more environment variables for the program")
    timeout_seconds: float = Field(600.0, gt=0, description="most seconds one rollout's program may run")
    max_programs: int = Field(
        32, ge=1, description="programs running at once (per worker process); more rollouts wait for a slot"
    )
    max_steps: int = Field(
        32, ge=1, description="most model calls in one rollout: the program is stopped there and the rollout verified"
    )
    http_host: str = Field("127.0.0.1", description="where the OpenAI endpoint listens")
    http_port: int = Field(0, ge=0, le=65535, description="its port; 0 picks a free one (each worker its own)")
    served_model_name: str = Field("gym-grpc", description="the model /v1/models lists")
    in_sandbox: bool = Field(
        False,
        description="run the program inside the rollout's sandbox (an environment with sandboxes, such as "
        "terminal, with sandbox.python_packages for a python program): the endpoint is then all it can reach",
    )

    @model_validator(mode="after")
    def _one_program(self) -> ExternalAgentConfig:
        if (self.command is None) == (self.python is None):
            raise ValueError("give the agent program as command (a list) or python (a module), one of them")
        return self


class ExternalAgent(ToolLoopAgent):
    Config = ExternalAgentConfig
    config: ExternalAgentConfig
    #: The program runs the loop and keeps its own state: a rollout cannot go on from a turn boundary.
    resumable = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: The rollouts running now, by session id: what the endpoint serves.
        self.recordings: dict[str, Recording] = {}
        self.endpoint = Endpoint(self.recordings, self.call_model, self.call_tool, self.config.served_model_name)
        self.argv = self._argv()
        self._slots = asyncio.Semaphore(self.config.max_programs)

    def _target(self) -> tuple[str, str]:
        """The python program's module (resolved) and function ("" to run it as -m)."""
        assert self.config.python is not None
        target, _, function = self.config.python.partition(":")
        if target.startswith("."):
            target = importlib.util.resolve_name(target, type(self).__module__.rpartition(".")[0])
        return target, function

    def _argv(self) -> list[str]:
        if self.config.command is not None:
            return list(self.config.command)
        return _python_argv(*self._target())

    def _environment(self, session_id: str, task_file: Path) -> dict[str, str]:
        env = dict(os.environ)
        if self.config.python is not None:  # the child imports what this server imports
            paths = [p for p in sys.path if p]
            env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env.update(self.config.env)
        env.update(
            OPENAI_BASE_URL=self.endpoint.base_url(session_id),
            OPENAI_API_KEY=session_id,
            GYM_GRPC_SESSION_ID=session_id,
            GYM_GRPC_TASK_FILE=str(task_file),
            GYM_GRPC_TOOLS_URL=self.endpoint.tools_url(session_id),
        )
        return env

    async def start(self) -> None:
        await super().start()
        await self.endpoint.start(self.config.http_host, self.config.http_port)

    async def stop(self) -> None:
        await self.endpoint.stop()
        await super().stop()

    def _program(self) -> str:
        """The program as the config names it, for messages."""
        if self.config.python is not None:
            return f"the agent program (python {self.config.python})"
        return f"the agent program ({' '.join(self.argv)[:200]})"

    async def _rollout(
        self, session_id: str, task: task_pb2.Task, events: RolloutEvents, verify: bool
    ) -> task_pb2.Rollout:
        """ToolLoopAgent.run's rollout, the session already open: here the program runs the loop."""
        async with self._slots:  # a rollout in flight is a process: at most max_programs of them
            rollout = await self._program_rollout(session_id, task, events)
        return await self.verified(session_id, task, rollout, events, verify)

    async def _program_rollout(self, session_id: str, task: task_pb2.Task, events: RolloutEvents) -> task_pb2.Rollout:
        """The program's rollout, unverified."""
        left = transport.timeout_for(self.config.timeout_seconds)
        limit = self.config.timeout_seconds if left is None else left
        recording = Recording(
            session_id,
            task,
            events,
            max_steps=self.config.max_steps,
            policy_version=policy_version.requested.get(),
            deadline=time.monotonic() + limit,
        )
        self.recordings[session_id] = recording
        try:
            if self.config.in_sandbox:
                code, tail = await self._run_in_sandbox(session_id, task, recording, limit)
            else:
                with tempfile.TemporaryDirectory(prefix="gym-grpc-agent-") as workdir:
                    task_file = Path(workdir) / "task.json"
                    task_file.write_text(rows.dumps(rows.task_to_row(task)))
                    env = self._environment(session_id, task_file)
                    code, tail = await self._run_program(recording, env, Path(workdir), limit)
        finally:
            await recording.close()
            self.recordings.pop(session_id, None)
        if recording.failure is not None:
            raise recording.failure
        tail = f"; it wrote: {tail[-2000:]}" if tail else ""
        if code is not None and code != 0:
            calls = len(recording.turns)
            raise errors.AgentProcessFailed(f"{self._program()} {describe_exit(code)} after {calls} model calls{tail}")
        if not recording.turns:
            raise errors.AgentProcessFailed(
                f"{self._program()} exited without calling the model at its OPENAI_BASE_URL "
                f"({self.endpoint.base_url(session_id)}){tail}"
            )
        rollout = recording.rollout()
        if code is None:  # stopped at max_steps
            rollout.stop_reason = task_pb2.STOP_REASON_MAX_STEPS
        return rollout

    async def _run_in_sandbox(
        self, session_id: str, task: task_pb2.Task, recording: Recording, limit: float
    ) -> tuple[int | None, str]:
        """_run_program in the rollout's own sandbox (SandboxService.Exec on the environment): the task
        file (and a python program's module) are written there, and the endpoint's port inside the
        sandbox is joined to the endpoint outside, the one address the program can reach."""
        files = {"task.json": rows.dumps(rows.task_to_row(task)).encode()}
        env = dict(self.config.env)
        argv = self.argv
        if self.config.python is not None:  # the module's file goes in; its imports come from the server's Python
            target, function = self._target()
            spec = importlib.util.find_spec(target)
            if spec is None or spec.origin is None:
                raise errors.ConfigError(f"{self._program()}: no module {target!r} to copy into the sandbox")
            leaf = target.rpartition(".")[2]
            files[f"{leaf}.py"] = Path(spec.origin).read_bytes()
            env["PYTHONPATH"] = SANDBOX_DIR
            argv = _python_argv(leaf, function)
        for name, data in files.items():
            await self.resources.sandbox_write(session_id, f"{SANDBOX_DIR}/{name}", data)
        outside = urllib.parse.urlsplit(self.endpoint.base_url(session_id)).netloc
        inside = f"http://127.0.0.1:{self.endpoint.port}/s/{session_id}"
        env.update(
            OPENAI_BASE_URL=f"{inside}/v1",
            OPENAI_API_KEY=session_id,
            GYM_GRPC_SESSION_ID=session_id,
            GYM_GRPC_TASK_FILE=f"{SANDBOX_DIR}/task.json",
            GYM_GRPC_TOOLS_URL=f"{inside}/tools",
        )
        request = sb_pb.ExecRequest(
            session_id=session_id,
            argv=argv,
            env=env,
            cwd=self.config.cwd or "",
            timeout_seconds=limit,
            max_output_bytes=SANDBOX_OUTPUT_BYTES,
            forwards=[sb_pb.PortForward(port=self.endpoint.port, target=outside)],
        )
        ran = asyncio.ensure_future(self.resources.sandbox_exec(request, timeout=limit + SANDBOX_GRACE_SECONDS))
        try:
            ended = await self._until_over(ran, recording, limit)
        finally:
            if not ran.done():
                ran.cancel()  # the environment ends the program when its Exec is cancelled
                with contextlib.suppress(asyncio.CancelledError, errors.GymError):
                    await ran
        if not ended:
            return None, ""
        reply = ran.result()
        if reply.timed_out:  # the sandbox ended it at the limit, a moment before our own clock did
            raise self._outlived(recording, limit)
        return reply.exit_code, (reply.stderr or reply.stdout).decode("utf-8", "replace").strip()[-TAIL_BYTES:]

    async def _run_program(
        self, recording: Recording, env: dict[str, str], logs: Path, limit: float
    ) -> tuple[int | None, str]:
        """Run the program to its end: its exit code (None when the rollout ended first: max_steps, a
        failed server) and the end of its output. DeadlineExceeded when it outlives `limit` seconds.
        It is stopped in every case."""
        try:
            process = await AgentProcess.start(self.argv, env, self.config.cwd, logs)
        except OSError as e:
            raise errors.AgentProcessFailed(f"cannot start {self._program()}: {e.strerror or e}") from None
        exited = asyncio.ensure_future(process.wait())
        try:
            ended = await self._until_over(exited, recording, limit)
        finally:
            await process.stop()
        return (exited.result() if ended else None), process.output_tail()

    async def _until_over(self, running: asyncio.Future[Any], recording: Recording, limit: float) -> bool:
        """Wait for the program's run to end (True) or the rollout to end first (False: max_steps, a failed
        server); DeadlineExceeded when neither happens within `limit` seconds. The caller stops the program."""
        over = asyncio.ensure_future(recording.over.wait())
        try:
            done, _ = await asyncio.wait({running, over}, timeout=limit, return_when=asyncio.FIRST_COMPLETED)
        finally:
            over.cancel()
        if running in done:
            return True
        if over in done:
            return False
        raise self._outlived(recording, limit)

    def _outlived(self, recording: Recording, limit: float) -> errors.DeadlineExceeded:
        return errors.DeadlineExceeded(
            f"{self._program()} was still running after {limit:g} s (timeout_seconds or the call's deadline); "
            f"stopped after {len(recording.turns)} model calls"
        )


def _python_argv(module: str, function: str) -> list[str]:
    """This server's Python running `module` (-m), or its `function` (its return value the exit status)."""
    if function:
        return [sys.executable, "-c", _CALL_FUNCTION, module, function]
    return [sys.executable, "-m", module]
