"""The log of one server as `gym-grpc run` sees it: what its processes write on stderr.

Every line is forwarded to the runner's own stderr as it comes, unchanged,
and the last lines are kept so that the runner can quote them when the
server dies before it is healthy. Each process's stderr is a pipe read by a
thread of its own: a pipe nobody drains would block the server's logging,
and a write to a slow stderr must never hold up the runner's event loop (the
runner's stderr is a `server.stderr.Stderr`, whose writes never block).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections import deque
from typing import Any

from gym_grpc.server import stderr

#: Lines of a server's log kept to quote when it fails.
KEPT_LINES = 20

#: Characters of one line kept (the whole line is still forwarded).
KEPT_LINE_CHARS = 500


class ServerLog:
    """The stderr of a server's processes: forwarded, and its last lines kept."""

    def __init__(self, kept_lines: int = KEPT_LINES) -> None:
        self._last: deque[str] = deque(maxlen=kept_lines)
        self._readers: dict[int, threading.Thread] = {}

    async def spawn(self, *command: str, name: str, **kwargs: Any) -> asyncio.subprocess.Process:
        """`asyncio.create_subprocess_exec(*command, **kwargs)` with its stderr read by this log."""
        read, write = os.pipe()
        try:
            process = await asyncio.create_subprocess_exec(*command, stderr=write, **kwargs)
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)
        reader = threading.Thread(target=self._forward, args=(read,), name=f"log of {name}", daemon=True)
        reader.start()
        self._readers = {pid: r for pid, r in self._readers.items() if r.is_alive()}  # forget finished ones
        self._readers[process.pid] = reader
        return process

    async def drained(self, process: asyncio.subprocess.Process, timeout: float = 2.0) -> None:
        """Wait until all `process` wrote has been read (at most `timeout` s: something it
        started may still hold the pipe open)."""
        reader = self._readers.pop(process.pid, None)
        if reader is not None:
            await asyncio.to_thread(reader.join, timeout)

    def quote(self) -> str:
        """To append to a message: "; its last log lines:" and the lines, indented ("" when none)."""
        if not self._last:
            return ""
        return "; its last log lines:\n" + "\n".join(f"    {line}" for line in self._last)

    def _forward(self, read: int) -> None:
        with open(read, "rb") as pipe:
            for line in pipe:
                stderr.write_bytes(line)  # never blocks under `gym-grpc run` (server/stderr.py)
                text = line.decode("utf-8", "replace").rstrip()
                if text:
                    self._last.append(text[:KEPT_LINE_CHARS])
