"""Terminal: an agent works in a sandbox of its own (a shell, files), and the task's own tests score it.

Tasks are Harbor task folders (harbor_task.py) under `tasks_dir`; a row names
one with its `task` field. SeedSession starts the session's sandbox (the
`sandbox:` settings: gym_grpc/sandboxes), lays the task's environment files
into its working directory and runs the task's setup.sh there. The model works
with three tools, each in that sandbox: run_command (a bash command line), read_file
and write_file. Verify ends what the agent left running, copies the task's
tests/ to /tests (the agent never saw them), runs `bash /tests/test.sh` in the
working directory and reads the reward it wrote to /logs/verifier/reward.txt
(or reward.json); a test that writes none scores 0.

The same sandbox is served over SandboxService, so an agent program can run
inside it (the external agent's `in_sandbox`), and a person can look at a live
rollout's files with grpcurl.
"""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field

from gym_grpc import errors
from gym_grpc.resources import Session, Verification, tool
from gym_grpc.sandboxes import Sandbox, SandboxEnvironment
from gym_grpc.sandboxes.environment import SandboxConfig
from gym_grpc.v1 import responses_pb2 as r

from . import harbor_task

HERE = Path(__file__).resolve().parent
#: Bytes of a file read_file returns at most, and of a command's output shown to the model.
MAX_READ_BYTES = 64 << 10
MAX_SHOWN_BYTES = 16 << 10

SYSTEM_PROMPT = (
    "You are working in a Linux terminal sandbox (no network). Use the tools to run shell commands and "
    "read and write files. When the task is done, reply with a short summary and no tool call."
)


class TerminalConfig(SandboxConfig):
    tasks_dir: str = Field(str(HERE / "tasks"), description="the folder of Harbor task folders rows name")
    default_command_timeout_seconds: float = Field(
        60.0, gt=0, description="run_command's time-out if the model gives none"
    )
    max_command_timeout_seconds: float = Field(600.0, gt=0, description="the longest time-out run_command accepts")


def _shown(data: bytes, size: int) -> str:
    text = data[:MAX_SHOWN_BYTES].decode("utf-8", "replace")
    return text + (f"\n[... {size - MAX_SHOWN_BYTES} more bytes]" if size > MAX_SHOWN_BYTES else "")


class TerminalEnv(SandboxEnvironment):
    Config = TerminalConfig
    config: TerminalConfig
    sandbox_dirs = ("/app", "/tmp", "/logs", "/tests", "/solution")
    verifier_fields = {
        "tests_exit_code": "test.sh's exit code (negative: killed by that signal)",
        "tests_timed_out": "whether test.sh ran past the task's verifier timeout",
        "reward_file": "where the reward came from: reward.txt, reward.json, or none (scored 0)",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tasks_dir = Path(self.config.tasks_dir)
        if not self.tasks_dir.is_dir():
            raise errors.ConfigError(f"tasks_dir {self.tasks_dir} is not a folder")
        self.task = cache(self._load)

    def _load(self, name: str) -> harbor_task.HarborTask:
        folder = (self.tasks_dir / name).resolve()
        if folder.parent != self.tasks_dir.resolve():
            raise errors.InvalidArgument(f"task {name!r} is not a folder name under tasks_dir", field="task.data.task")
        try:
            return harbor_task.load(folder, self.sandbox_dirs)
        except errors.ConfigError as e:
            raise errors.InvalidArgument(
                str(e), field="task.data.task", reason=errors.Reason.TASK_DATA_INVALID
            ) from None

    def _session_task(self, session: Session) -> harbor_task.HarborTask:
        name = session.data.get("task")
        if not isinstance(name, str) or not name:
            raise errors.InvalidArgument("the row has no `task` (a task folder's name)", field="task.data.task")
        return self.task(name)

    def task_rows(self, limit: int | None = None) -> list[dict[str, Any]]:
        rows = []
        for folder in sorted(p for p in self.tasks_dir.iterdir() if (p / "task.toml").is_file())[:limit]:
            task = self.task(folder.name)
            rows.append(
                {
                    "responses_create_params": {
                        "input": [
                            {"role": "system", "content": SYSTEM_PROMPT},
                            {"role": "user", "content": task.instruction.strip()},
                        ],
                        "tools": self.tool_definitions(),
                    },
                    "task": folder.name,
                }
            )
        return rows

    async def seed_session(self, session: Session) -> None:
        try:
            await self._lay_out(session)
        except BaseException:
            await self.close_session(session)  # a session that failed to seed is never closed: release it here
            raise

    async def _lay_out(self, session: Session) -> None:
        """Put the task's files in the session's sandbox and run its setup.sh."""
        task = self._session_task(session)
        sandbox = await self.sandbox(session)
        for path, (data, mode) in task.files.items():
            await sandbox.write_file(f"{task.workdir}/{path}", data, mode)
        if task.setup is not None:
            setup = await self.run_in_sandbox(
                session,
                ["/bin/bash", "-c", task.setup.decode()],
                cwd=task.workdir,
                env=task.environment_env,
                timeout=task.verifier_timeout,
            )
            if setup.exit_code != 0:
                ended = "timed out" if setup.timed_out else f"exited with {setup.exit_code}"
                raise errors.FailedPrecondition(
                    f"task {task.name!r}: its setup.sh {ended}: " + _shown(setup.stderr, setup.stderr_bytes)[-500:]
                )

    # --- the model's tools -------------------------------------------------

    @tool
    async def run_command(
        self,
        session: Session,
        command: Annotated[str, Field(description="A command line, run by bash in the task's working directory.")],
        timeout_seconds: Annotated[
            float | None, Field(description="Seconds before the command is killed (default 60).")
        ] = None,
    ) -> str:
        """Run a bash command line in the sandbox; returns its exit code, stdout and stderr."""
        timeout = min(
            timeout_seconds or self.config.default_command_timeout_seconds, self.config.max_command_timeout_seconds
        )
        task = self._session_task(session)
        result = await self.run_in_sandbox(
            session, ["/bin/bash", "-c", command], cwd=task.workdir, env=task.environment_env, timeout=timeout
        )
        status = f"killed after {timeout:g} s" if result.timed_out else f"exit code {result.exit_code}"
        out = f"[{status}]\n{_shown(result.stdout, result.stdout_bytes)}"
        if result.stderr_bytes:
            out += f"\n[stderr]\n{_shown(result.stderr, result.stderr_bytes)}"
        return out

    @tool
    async def read_file(
        self,
        session: Session,
        path: Annotated[str, Field(description="The file's path (relative: to the working directory).")],
    ) -> str:
        """Read a text file of the sandbox."""
        sandbox = await self.sandbox(session)
        data, size = await sandbox.read_file(self._absolute(session, path), MAX_READ_BYTES)
        return _shown(data, size)

    @tool
    async def write_file(
        self,
        session: Session,
        path: Annotated[str, Field(description="The file's path (relative: to the working directory).")],
        content: Annotated[str, Field(description="The file's whole new content.")],
    ) -> str:
        """Write a text file of the sandbox (replacing it; its folders are made)."""
        sandbox = await self.sandbox(session)
        absolute = self._absolute(session, path)
        await sandbox.write_file(absolute, content.encode())
        return f"wrote {len(content.encode())} bytes to {absolute}"

    def _absolute(self, session: Session, path: str) -> str:
        return path if path.startswith("/") else f"{self._session_task(session).workdir}/{path}"

    # --- the reward --------------------------------------------------------

    async def verify(self, session: Session, response: r.Response) -> Verification:
        sandbox = self.started_sandbox(session)
        if sandbox is None:
            raise errors.FailedPrecondition(
                "the terminal environment scores a rollout in its own sandbox, which is gone "
                "(the session was closed): it cannot re-score it"
            )
        task = self._session_task(session)
        await sandbox.kill_processes()  # nothing the agent left running touches the tests
        await self.run_in_sandbox(session, "rm -rf /tests/* /logs/verifier && mkdir -p /logs/verifier", timeout=60)
        for path, (data, mode) in task.tests.items():
            await sandbox.write_file(f"/tests/{path}", data, mode)
        result = await self.run_in_sandbox(
            session,
            ["/bin/bash", "/tests/test.sh"],
            cwd=task.workdir,
            env={**task.environment_env, **task.verifier_env},
            timeout=task.verifier_timeout,
        )
        reward, components, source = await self._reward(sandbox)
        return Verification(
            reward=reward,
            fields={"tests_exit_code": result.exit_code, "tests_timed_out": result.timed_out, "reward_file": source},
            components=components,
        )

    async def _reward(self, sandbox: Sandbox) -> tuple[float, dict[str, float], str]:
        """The reward test.sh wrote: reward.json's `reward` (its other numbers become components) or
        reward.txt's number; 0 when it wrote neither or something that is not a number."""
        for name in ("reward.json", "reward.txt"):
            try:
                data, _ = await sandbox.read_file(f"/logs/verifier/{name}", 1 << 16)
            except errors.SandboxError:  # not written
                continue
            try:
                value = json.loads(data)
            except ValueError:
                return 0.0, {}, name
            if isinstance(value, dict):
                numbers = {k: float(v) for k, v in value.items() if isinstance(v, int | float) and math.isfinite(v)}
                reward = numbers.pop("reward", next(iter(numbers.values()), 0.0)) if numbers else 0.0
                return reward, numbers, name
            if isinstance(value, int | float) and math.isfinite(value):
                return float(value), {}, name
            return 0.0, {}, name
        return 0.0, {}, "none"
