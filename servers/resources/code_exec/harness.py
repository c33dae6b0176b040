"""The child process of a code_exec check: runs one candidate on the tests' arguments.

Not imported: checker.py runs this file's text with `python -I -c HARNESS JOB RESULTS`
in a fresh process. JOB is a JSON file with the code, the function's name and the
tests' arguments (never their expected values: the comparison happens in the parent,
so a candidate that reads its own memory learns nothing it could not compute). The
child first limits itself (address space, CPU time, file size, open files, processes)
and asks to be killed when its parent dies, then compiles and runs the code and writes
one JSON line per test to RESULTS:

    {"compiled": true}                      or {"compiled": false, "error": "SyntaxError: ..."}
    {"loaded": false, "error": "..."}       when defining the function failed
    {"i": 0, "value": <the result as JSON>} or {"i": 0, "error": "ZeroDivisionError: ..."}
    {"i": 1, "timeout": true}

A test that outlives its time limit is interrupted by SIGALRM. A candidate that
ignores the interruption is killed by RLIMIT_CPU or by the parent's deadline.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MAX_VALUE_BYTES = 1 << 20  # a returned value larger than this as JSON is an error
MAX_ERROR_CHARS = 300


class TimeLimit(BaseException):
    """Raised in the candidate by SIGALRM when a test runs out of time."""


def _limit(kind, soft, hard=None):
    try:
        resource.setrlimit(kind, (soft, soft if hard is None else hard))
    except (ValueError, OSError):
        pass  # a limit the platform or our own hard limit does not allow stays as it was


def _describe(error):
    text = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return text[:MAX_ERROR_CHARS]


def _on_alarm(signum, frame):
    raise TimeLimit()


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    os.remove(sys.argv[1])
    out = open(sys.argv[2], "a", buffering=1)

    def write(record):
        out.write(json.dumps(record) + "\n")

    # The process dies with its parent (the pool worker or Ray worker that runs the check).
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != job["parent_pid"]:
        return  # the parent died before the death signal was armed
    _limit(resource.RLIMIT_AS, job["memory_bytes"])
    _limit(resource.RLIMIT_CPU, job["cpu_seconds"], job["cpu_seconds"] + 1)
    _limit(resource.RLIMIT_FSIZE, job["file_bytes"])
    _limit(resource.RLIMIT_NOFILE, 64)
    _limit(resource.RLIMIT_CORE, 0)
    _limit(resource.RLIMIT_NPROC, 0)  # no fork, no threads (not enforced for root)
    signal.signal(signal.SIGALRM, _on_alarm)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises instead of killing

    try:
        code = compile(job["code"], "<candidate>", "exec")
    except SyntaxError as e:
        where = f" (line {e.lineno})" if e.lineno else ""
        write({"compiled": False, "error": f"{type(e).__name__}: {e.msg}"[: MAX_ERROR_CHARS - len(where)] + where})
        return
    except ValueError as e:  # source code with null bytes
        write({"compiled": False, "error": _describe(e)})
        return
    write({"compiled": True})

    timeout = job["test_timeout"]
    namespace = {"__name__": "__candidate__", "__builtins__": __builtins__}
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout)
        exec(code, namespace)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except TimeLimit:
        write({"loaded": False, "error": f"defining the function took more than {timeout:g} s"})
        return
    except BaseException as e:
        signal.setitimer(signal.ITIMER_REAL, 0)
        write({"loaded": False, "error": "while defining the function: " + _describe(e)})
        return
    function = namespace.get(job["function_name"])
    if not callable(function):
        write({"loaded": False, "error": f"the code defines no function {job['function_name']!r}"})
        return

    for i, args in enumerate(job["args"]):
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout)
            value = function(*args)
            signal.setitimer(signal.ITIMER_REAL, 0)
        except TimeLimit:
            write({"i": i, "timeout": True})
            continue
        except BaseException as e:
            signal.setitimer(signal.ITIMER_REAL, 0)
            write({"i": i, "error": _describe(e)})
            continue
        try:
            line = json.dumps({"i": i, "value": value})
        except (TypeError, ValueError, RecursionError) as e:
            write({"i": i, "error": f"returned a {type(value).__name__}, which is not JSON data ({e})"[:300]})
            continue
        if len(line) > MAX_VALUE_BYTES:
            write({"i": i, "error": f"returned a value of {len(line)} bytes as JSON (limit {MAX_VALUE_BYTES})"})
            continue
        out.write(line + "\n")


main()
