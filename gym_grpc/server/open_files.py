"""Open files: each gym-grpc process raises its limit at start, and says so when it runs out.

Every socket, pipe and file a process holds is a descriptor, and a common
Linux default allows 1,024 (the soft limit) while permitting far more (the
hard limit). A model server with `max_connections: 1024` to its engine, or a
server that many clients connect to, runs out of them. So every process that
serves or collects raises its soft limit to the hard limit when it starts
(NeMo Gym raises it to 65,535), and `gym-grpc status` shows what each server
got. When the hard limit itself is too low, running out (EMFILE) becomes an
`errors.OutOfFiles` (RESOURCE_EXHAUSTED) whose message names the process and
its limits, and the process says so in one line at most once a minute (see
`serving` and `batch`), not in a line per call that it cost.
"""

from __future__ import annotations

import errno
import os
import resource
import time

import grpc

#: The soft limit to aim for when the hard limit is unlimited.
UNLIMITED_TARGET = 65_535

#: Seconds between two lines of one process saying that it ran out.
SAY_EVERY = 60.0

_process = f"process {os.getpid()}"
_said_at: float | None = None


def raise_limit(process: str) -> int:
    """Raise this process's soft limit on open files to its hard limit and return the
    soft limit it got. `process` names this process in messages ("server 'math'")."""
    global _process
    _process = process
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_TARGET if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):  # macOS refuses more than OPEN_MAX: keep what we have
            pass
    return limit()


def limit() -> int:
    """The soft limit on open files now; 0 when there is none."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 0 if soft == resource.RLIM_INFINITY else soft


def in_use() -> int:
    """Descriptors this process holds now; 0 where the system does not say."""
    for directory in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(directory)) - 1  # listing it opened one
        except OSError:
            continue
    return 0


def ran_out(error: BaseException) -> bool:
    """Whether `error`, or what caused it, is this process running out of descriptors:
    an OSError with EMFILE, or a gRPC call that could not open its connection."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.EMFILE:
            return True
        if isinstance(seen, grpc.aio.AioRpcError) and seen.code() == grpc.StatusCode.UNAVAILABLE:
            return os.strerror(errno.EMFILE) in (seen.details() or "")
        seen = seen.__cause__ or seen.__context__
    return False


def explain(doing: str = "") -> str:
    """What to say when this process ran out while `doing` ("connecting to engine http://...")."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    hard_text = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    return (
        f"{_process} is out of open files (EMFILE){f' {doing}' if doing else ''}: limit {limit()} "
        f"(hard limit {hard_text}); "
        f"raise the hard limit (ulimit -Hn, or LimitNOFILE= under systemd) or open fewer connections"
    )


def time_to_say() -> bool:
    """Whether a failure from running out should be said now: at most once in SAY_EVERY
    seconds for the whole process (each call it costs is still counted)."""
    global _said_at
    now = time.monotonic()
    if _said_at is not None and now - _said_at < SAY_EVERY:
        return False
    _said_at = now
    return True
