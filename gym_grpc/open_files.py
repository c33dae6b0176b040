"""Open files: each gym-grpc process raises its limit at start, and says so when it runs out.

Every socket, pipe and file a process holds is a descriptor, and a common
Linux default allows 1,024 (the soft limit) while permitting far more (the
hard limit). A model server with `max_connections: 1024` to its engine, or a
server that many clients connect to, runs out of them. So every process that
serves or collects raises its soft limit to the hard limit when it starts
(NeMo Gym raises it to 65,535), and `gym-grpc status` shows what each server
got.
"""

from __future__ import annotations

import os
import resource

#: The soft limit to aim for when the hard limit is unlimited.
UNLIMITED_TARGET = 65_535

_process = f"process {os.getpid()}"


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
