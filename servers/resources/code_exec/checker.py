"""Running a candidate function against its tests, in a fresh child process.

`run_tests` is what a pool worker or a Ray task executes. It never runs the
candidate itself: it starts `python -I` on harness.py in a new session (so the
candidate and anything it starts form one process group), waits at most
`startup_seconds + test_timeout * (tests + 1)` of wall time (and never more than
`wall_seconds`, the caller's own deadline), then kills the whole group. It
therefore returns within a bounded time whatever the candidate does, and the
worker that called it stays healthy for the next check.

The child receives the tests' arguments only; the expected values stay here and
are compared with the JSON the child wrote, so a candidate cannot pass a test by
returning an object whose `__eq__` lies.

This module uses the standard library only: Ray ships it to a cluster by value,
so the cluster's workers need neither gym_grpc nor this repository.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

HARNESS = (Path(__file__).with_name("harness.py")).read_text()

#: The most of the child's results file that is read back.
MAX_RESULTS_BYTES = 16 << 20
MAX_ERROR_CHARS = 200


def same(got: Any, expected: Any) -> bool:
    """Whether a returned value (as JSON data) equals the expected one; floats within 1e-9."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, int | float) and isinstance(got, int | float):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(same(g, e) for g, e in zip(got, expected, strict=True))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(same(got[k], expected[k]) for k in expected)
    return type(got) is type(expected) and got == expected


def _short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _read_results(path: str) -> list[dict[str, Any]]:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RESULTS_BYTES)
    except FileNotFoundError:
        return []
    records = []
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue  # the candidate wrote to the file (maybe nested too deep to parse), or the last line was cut off
        if isinstance(record, dict):
            records.append(record)
    return records


def _how_it_ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"the process was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"the process was killed by signal {-returncode}"
    return f"the process exited with code {returncode}"


@contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Hold back a KeyboardInterrupt until the block has ended, then raise it.

    A Ray task is cancelled with a KeyboardInterrupt in its main thread, and Ray
    may send the cancel again while the first is handled. One that lands inside
    `subprocess.Popen` (the child forked, `Popen` not yet returned) would leave no
    handle to the child; one that lands in the clean-up would leave the child
    unkilled or unreaped. Outside the main thread nothing can interrupt, so
    nothing is held back.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt


def run_tests(
    code: str,
    function_name: str,
    tests: list[dict[str, Any]],
    *,
    test_timeout: float,
    memory_mb: int,
    startup_seconds: float,
    wall_seconds: float | None = None,
) -> dict[str, Any]:
    """Run `function_name` from `code` on each test's args in a child process; compare with `expected`.

    Returns {"compiled": bool, "passed": int, "total": int, "timeout": bool, "error": str},
    where error describes the first thing that went wrong ("" when every test passed).
    """
    total = len(tests)
    workdir = tempfile.mkdtemp(prefix="code_exec_")
    try:
        job_path = os.path.join(workdir, "job.json")
        results_path = os.path.join(workdir, "results.jsonl")
        with open(job_path, "w") as f:
            json.dump(
                {
                    "code": code,
                    "function_name": function_name,
                    "args": [t["args"] for t in tests],
                    "test_timeout": test_timeout,
                    "memory_bytes": memory_mb << 20,
                    "cpu_seconds": math.ceil(test_timeout * (total + 1)) + 1,
                    "file_bytes": MAX_RESULTS_BYTES,
                    "parent_pid": os.getpid(),
                },
                f,
            )
        killed = False
        child: subprocess.Popen[bytes] | None = None
        try:
            with _interrupts_deferred():  # an interrupt raised here still reaches the `finally` below
                child = subprocess.Popen(
                    [sys.executable, "-I", "-c", HARNESS, job_path, results_path],
                    cwd=workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env={"PATH": os.defpath, "LANG": "C.UTF-8"},  # none of the server's secrets
                    start_new_session=True,
                )
            # The caller's deadline bounds the check even when its cancel never arrives
            # (Ray's cancel of a running task is best effort).
            budget = startup_seconds + test_timeout * (total + 1)
            child.wait(timeout=budget if wall_seconds is None else min(budget, wall_seconds))
        except subprocess.TimeoutExpired:
            killed = True
        finally:
            # The whole group: whatever the candidate started goes too (unless it left the group).
            # Ray may repeat its cancel: a second interrupt must not stop the kill or the reaping.
            with _interrupts_deferred():
                if child is not None:
                    try:
                        os.killpg(child.pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
                    child.wait()
        records = _read_results(results_path)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    assert child is not None  # a Popen that raised has left by now
    return _verdict(records, tests, child.returncode, killed, test_timeout)


def _verdict(
    records: list[dict[str, Any]], tests: list[dict[str, Any]], returncode: int, killed: bool, test_timeout: float
) -> dict[str, Any]:
    total = len(tests)
    verdict: dict[str, Any] = {"compiled": False, "passed": 0, "total": total, "timeout": False, "error": ""}
    errors: list[str] = []
    outcomes: dict[int, dict[str, Any]] = {}
    stopped = False  # the code did not compile or the function could not be defined: no test ran
    for record in records:
        if "compiled" in record:
            verdict["compiled"] = record["compiled"] is True
            if record["compiled"] is not True:
                stopped = True
                errors.append(str(record.get("error", "the code does not compile")))
        elif "loaded" in record:
            stopped = True
            errors.append(str(record.get("error", "the function could not be defined")))
        elif isinstance(record.get("i"), int) and 0 <= record["i"] < total:
            outcomes.setdefault(record["i"], record)
    for i, test in enumerate(tests):
        outcome = outcomes.get(i)
        if outcome is None:
            continue
        if outcome.get("timeout"):
            verdict["timeout"] = True
            errors.append(f"test {i + 1}: timed out after {test_timeout:g} s")
        elif "error" in outcome:
            errors.append(f"test {i + 1}: {outcome['error']}")
        elif same(outcome.get("value"), test["expected"]):
            verdict["passed"] += 1
        else:
            errors.append(f"test {i + 1}: expected {_short(test['expected'])}, got {_short(outcome.get('value'))}")
    if not stopped and len(outcomes) < total:
        # The child ended before answering every test: killed at the deadline, out of CPU time, or it died.
        out_of_time = killed or returncode == -signal.SIGXCPU
        verdict["timeout"] = verdict["timeout"] or out_of_time
        if not verdict["compiled"]:
            ended = "killed after the time limit" if killed else _how_it_ended(returncode)
            errors.append(f"the check did not start: {ended}")
        else:
            missing = min(set(range(total)) - set(outcomes)) + 1
            errors.append(
                f"test {missing}: " + ("killed after the time limit" if out_of_time else _how_it_ended(returncode))
            )
    verdict["error"] = errors[0][:MAX_ERROR_CHARS] if errors else ""
    return verdict
