"""A process's stderr that never holds the process up.

A server's stderr is a pipe that `gym-grpc run` drains; the runner's is a terminal or a pipe of
its own. When the reader stops (the runner stopped by SIGSTOP, a debugger or a terminal's Ctrl-S;
its output piped to a program that does not read), a pipe fills after ~64 KB and every write to it
blocks: a server that logged from its event loop stopped answering, health checks included.

`install()` replaces `sys.stderr` (and `sys.stdout` where it is stderr) with `Stderr`. A write goes
out at once when it cannot block (nothing is waiting before it, it fits in one atomic pipe write
and the descriptor has room for it): so a process's last words reach its log even when it dies the
next instant (`os._exit`, a signal). Otherwise it waits on a bounded queue that a thread of its own
writes out, blocking alone while the reader does. Past `CAPACITY` writes waiting, writes are dropped
and counted; the first write queued after them goes out behind a line saying how many were lost,
where they went missing. At exit the queue gets a moment to drain.
"""

from __future__ import annotations

import atexit
import io
import os
import queue
import select
import sys
import threading
import time

#: Writes (log lines) that may wait to be written; past it they are dropped, and counted.
CAPACITY = 10_000

#: Seconds the queue gets to drain when the process exits.
EXIT_DRAIN_SECONDS = 2.0


class Stderr(io.TextIOBase):
    """A text stream on descriptor `fd` whose writes never block: see the module's docstring."""

    def __init__(self, fd: int = 2, capacity: int = CAPACITY) -> None:
        self._fd = fd
        #: (writes dropped before this one was queued, the write): the count places a drop's note
        #: where the lines went missing, not where the writer thread happened to notice it.
        self._queue: queue.Queue[tuple[int, bytes]] = queue.Queue(maxsize=capacity)
        #: Held while writing to `fd`: by the writer thread, or by a write that cannot block.
        self._writing = threading.Lock()
        #: Held while queueing or dropping, so that the counts in the queue only grow.
        self._counting = threading.Lock()
        #: Writes dropped since start (the queue was full).
        self.dropped = 0
        #: Drops a note has told of; written under `_writing`.
        self._told = 0
        self._writer = threading.Thread(target=self._write_out, name="stderr writer", daemon=True)
        self._writer.start()

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        """The descriptor, for a child process to write to directly (an MCP server's stderr, say)."""
        return self._fd

    def write(self, text: str) -> int:
        self.write_bytes(text.encode("utf-8", "backslashreplace"))
        return len(text)

    def write_bytes(self, data: bytes) -> None:
        """Write `data` as it is (a line another process wrote, say): now if that cannot block, else queued."""
        if len(data) <= select.PIPE_BUF and self._writing.acquire(blocking=False):
            try:
                # Queued writes not written yet, and drops not told of yet, go first, in order.
                if (
                    not self._queue.unfinished_tasks
                    and self.dropped == self._told
                    and select.select([], [self._fd], [], 0)[1]
                ):
                    _write_all(self._fd, data)  # room for PIPE_BUF bytes: one write, which does not block
                    return
            finally:
                self._writing.release()
        with self._counting:
            try:
                self._queue.put_nowait((self.dropped, data))
            except queue.Full:
                self.dropped += 1

    def flush(self) -> None:
        """Nothing to do: the writer thread writes as soon as it can (`drain` waits for it)."""

    def drain(self, timeout: float) -> None:
        """Wait up to `timeout` s for what is queued to be written."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _write_out(self) -> None:
        while True:
            dropped, data = self._queue.get()
            with self._writing:
                if dropped > self._told:
                    lost, self._told = dropped - self._told, dropped
                    note = f"[gym-grpc] {lost:,} log lines dropped: nobody read this process's stderr\n"
                    _write_all(self._fd, note.encode())
                _write_all(self._fd, data)
            self._queue.task_done()


def _write_all(fd: int, data: bytes) -> None:
    """Write all of `data` on `fd`, blocking while it is full; drop it when `fd` is gone."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except OSError:
        pass  # nowhere to say anything


def write_bytes(data: bytes) -> None:
    """Write `data` to this process's stderr: through the `Stderr` that `install()` made it, else
    directly (blocking); dropped when descriptor 2 is gone."""
    if isinstance(sys.stderr, Stderr):
        sys.stderr.write_bytes(data)
    else:
        _write_all(2, data)


def install() -> Stderr:
    """Make this process's `sys.stderr` (and `sys.stdout` where it is stderr) a `Stderr`, drained for a
    moment at exit; returns it. Call it before logging is configured, so that logging writes to it."""
    stream = Stderr()
    if sys.stdout is sys.stderr:
        sys.stdout = stream
    sys.stderr = stream
    atexit.register(stream.drain, EXIT_DRAIN_SECONDS)
    return stream
