"""Policy versions, for a trainer that samples while it trains (async RL).

Two versions meet here:

- the version a rollout was *asked* under: `RunRequest.policy_version`. The
  agent's servicer puts it in a context variable for the rollout, and every
  model call the rollout makes carries it (`CreateResponseRequest.policy_version`),
  as deadlines travel (`requested`);
- the version a model server's engine *serves*: the trainer tells it after
  each weight update (`ModelService.SetPolicyVersion`). A model server stamps
  each turn with that version when it was told one, else with the requested
  one, so a rollout that spans an update says so turn by turn.

The served version lives in `ServedVersion`: in the process, or, for a server
with several worker processes, in a small file every worker maps (the runner
creates it), so that a call that reaches one worker tells them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import fcntl
import mmap
import os
import struct
from collections.abc import AsyncIterator
from pathlib import Path

#: The policy version the current rollout was asked under (None: no version).
requested: contextvars.ContextVar[int | None] = contextvars.ContextVar("gym_grpc_policy_version", default=None)

#: The file's layout: the version + 1 as an unsigned 64-bit integer (0: none told yet).
_LAYOUT = struct.Struct("<Q")


class ServedVersion:
    """The policy version a model server was told, shared by its worker processes through `path`
    when given (a file of _LAYOUT.size bytes), else held in this process."""

    def __init__(self, path: str | Path | None = None) -> None:
        self._value: int | None = None
        self._map: mmap.mmap | None = None
        self._path = path
        self._lock = asyncio.Lock()
        if path is not None:
            fd = os.open(path, os.O_RDWR)
            try:
                self._map = mmap.mmap(fd, _LAYOUT.size)
            finally:
                os.close(fd)

    @staticmethod
    def create_file(path: str | Path) -> None:
        """Make the shared file (no version yet), for the workers of one server to map."""
        Path(path).write_bytes(_LAYOUT.pack(0))

    def get(self) -> int | None:
        if self._map is None:
            return self._value
        (stored,) = _LAYOUT.unpack_from(self._map, 0)
        return stored - 1 if stored else None

    def set(self, version: int) -> int | None:
        """Serve `version` from now on; the version before (None when none was told)."""
        previous = self.get()
        if self._map is None:
            self._value = version
        else:
            _LAYOUT.pack_into(self._map, 0, version + 1)  # one aligned 8-byte store: readers see old or new
        return previous

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the version for a weight update: one at a time in this process and, through the
        file's lock, across the server's worker processes. Not to be cancelled while waiting (a
        thread waits for the file's lock): the model server enters it in a shielded task."""
        async with self._lock:
            if self._path is None:
                yield
                return
            fd = os.open(self._path, os.O_RDWR)
            try:
                await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
                yield
            finally:
                os.close(fd)  # releases the lock
