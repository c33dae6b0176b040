"""The states of a collection's rollouts in flight, kept in a file next to its output, so that a
collector that dies (SIGKILL, an out-of-memory kill, a lost node) loses only their turns in flight.

`gym-grpc collect` keeps each durable rollout's progress in `<output stem>.states` as it comes: the
state its attempt began from and each checkpoint the agent sends (client/run_many.py, Progress).
A turn whose tool calls the agent makes next is written before the client tells the agent it read
it, so it is in the file before they run. Running the same command again resumes each rollout of
the file whose key is not in the output: from its last turn boundary, under its rollout id, in its
session when the environment still holds it (docs/durable-rollouts.md). The agent is told a
rollout came only once its row is written (Progress.result), so that its session outlives a
collector stopped between the two. The file goes when a run ends with every job done, failed or
skipped.

The file: MAGIC, the run's digest (batch/fingerprint.py) and a newline, then records, each
`<payload bytes: u32><kind: u8><rollout: u32>` (little-endian) and its payload: BEGIN (a rollout
under a key: `TASK_INDEX REPEAT_INDEX ROLLOUT_ID` in UTF-8), BASE (the RolloutState an attempt
began from, when not empty), CHECKPOINT (a RunCheckpoint), END (the rollout's row was written or it
failed: nothing to resume). Records are written together, with one system call, before the client
says it read a turn whose tool calls come next, and otherwise within a second; they are not synced:
they survive the process, not the machine. A record cut short by the process's end is left out.
Once the file is several times what its rollouts in flight needed when it was last written, it is
written again with only theirs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from google.protobuf.message import DecodeError

from gym_grpc.data import rollout_state
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import task_pb2

MAGIC = b"gym-grpc rollout states 1\n"
_RECORD = struct.Struct("<IBI")
BEGIN, BASE, CHECKPOINT, END = 1, 2, 3, 4

#: Records are written at the latest once this many bytes of them wait, or they waited this long
#: (and before the client says it read a checkpoint that asked: see `States.flush`).
PENDING_BYTES = 256 * 2**10
PENDING_SECONDS = 1.0

#: The file is written again with only its rollouts not ended once it is past this size and
#: COMPACT_RATIO times its size when it was last written (what they needed then).
COMPACT_BYTES = 64 * 2**20
COMPACT_RATIO = 4

#: RolloutAttempt.ended of the attempt a collector that stopped left unfinished.
STOPPED = "CANCELLED: the collector stopped with the rollout in flight"

Key = tuple[int, int]


def path_for(output: Path) -> Path:
    """The states file of an output: `<stem>.states` next to it."""
    return output.with_name(f"{output.stem}.states")


@dataclass(frozen=True)
class Kept:
    """A rollout a stopped collector left in flight: the state to resume it from, under its id."""

    rollout_id: str
    state: task_pb2.RolloutState


@dataclass
class _Rollout:
    """A rollout's records in the file, as written (for writing the file again), under its slot."""

    slot: int
    begin: bytes
    base: bytes = b""
    checkpoints: list[bytes] = field(default_factory=list)
    #: Tells the agent its rollout is kept, once it has come (Progress.result): called at its end.
    acknowledge: Callable[[], None] | None = None

    def records(self) -> Iterator[tuple[int, bytes]]:
        yield BEGIN, self.begin
        if self.base:
            yield BASE, self.base
        for checkpoint in self.checkpoints:
            yield CHECKPOINT, checkpoint

    def kept(self) -> Kept | None:
        """The state to resume from, the attempt that stopped ended; None when no attempt began."""
        _, _, rollout_id = self.begin.decode().split(" ", 2)
        base = task_pb2.RolloutState.FromString(self.base)
        state = rollout_state.build(base, map(agent_pb.RunCheckpoint.FromString, self.checkpoints))
        rollout_state.end_attempt(state, len(base.attempts), STOPPED)
        if not state.attempts:
            return None  # nothing was done: the rollout starts again from its prompt
        return Kept(rollout_id, state)


def _read(data: bytes) -> tuple[dict[Key, _Rollout], str | None]:
    """The rollouts of a file's records not ended, by key (the latest under each key), and what was
    wrong with the record the reading stopped at, if anything (one cut short says nothing: the
    process that wrote it ended)."""
    rollouts: dict[int, tuple[Key, _Rollout]] = {}
    at, damage = 0, None
    while at + _RECORD.size <= len(data):
        size, kind, slot = _RECORD.unpack_from(data, at)
        start = at + _RECORD.size
        if start + size > len(data):
            break
        payload, at = data[start : start + size], start + size
        if kind == BEGIN:
            try:
                task_index, repeat_index, _ = payload.decode().split(" ", 2)
                key = (int(task_index), int(repeat_index))
            except ValueError:
                damage = f"a rollout's first record at byte {start - _RECORD.size} is not 'TASK REPEAT ID'"
                break
            rollouts[slot] = (key, _Rollout(slot, payload))
        elif slot in rollouts and kind == BASE:
            rollouts[slot][1].base, rollouts[slot][1].checkpoints = payload, []
        elif slot in rollouts and kind == CHECKPOINT:
            rollouts[slot][1].checkpoints.append(payload)
        elif kind == END:
            rollouts.pop(slot, None)
        elif kind not in (BASE, CHECKPOINT):
            damage = f"the record at byte {start - _RECORD.size} is of no known kind ({kind})"
            break
    return dict(rollouts.values()), damage  # in the order written: a later BEGIN of a key wins


class States:
    """The states file of one collection (see the module's docstring)."""

    def __init__(self, path: Path, run: str, log: TextIO) -> None:
        self.path, self._header = path, MAGIC + run.encode() + b"\n"
        self._log = log
        #: The rollouts in the file not ended, by key.
        self._live: dict[Key, _Rollout] = {}
        self._next_slot = 0
        #: How many rollouts the file held to resume when it was opened.
        self.resumable = 0
        #: Records given and not written yet (see `flush`), and the timer that writes them in time.
        self._pending = bytearray()
        self._timer: asyncio.TimerHandle | None = None
        self._written = 0
        #: The file's size past which it is written again (see `_rewrite`).
        self._rewrite_at = COMPACT_BYTES
        self._fd = -1
        #: Why the file is no longer written (a full disk): the run goes on without it.
        self.failed: str | None = None

    @classmethod
    def open(cls, path: Path, run: str, log: TextIO) -> States:
        """The states file at `path` for the run whose digest is `run`: the rollouts it holds of that
        run are kept to resume; a file of another run (or not one of ours) is replaced, with a note."""
        states = cls(path, run, log)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            data = b""
        except OSError as e:
            data = b""
            log.write(f"note: cannot read {path} ({e.strerror or e}): its rollouts start from their prompts\n")
        if data.startswith(states._header):
            states._live, damage = _read(data[len(states._header) :])
            if damage:
                log.write(f"note: {path} is damaged ({damage}): what comes after starts from the prompts\n")
        elif data:
            log.write(f"note: {path} holds the states of another run: replaced\n")
        states.resumable = len(states._live)
        states._next_slot = 1 + max((rollout.slot for rollout in states._live.values()), default=-1)
        states._rewrite()
        return states

    def resume_of(self, key: Key) -> Kept | None:
        """What a stopped collector left of the rollout under `key`, to go on from (None: nothing,
        or nothing an agent could go on from: the rollout starts from its prompt)."""
        rollout = self._live.get(key)
        if rollout is None:
            return None
        try:
            kept = rollout.kept()
            if kept is not None:
                rollout_state.check(kept.state, "resume")
        except (DecodeError, ValueError) as e:
            self._log.write(f"note: the state of rollout {key} in {self.path} is not usable ({e}): from its prompt\n")
            return None
        return kept

    def track(self, key: Key) -> _Tracker:
        """The progress of the rollout under `key` (given to AgentClient.run), kept once it is sent
        durable, in place of what was kept of the key."""
        return _Tracker(self, key)

    def begin(self, key: Key, rollout_id: str) -> _Rollout:
        """A rollout under `key` is sent durable, in place of what was kept of the key."""
        self.end(key)
        begin = f"{key[0]} {key[1]} {rollout_id}".encode()
        rollout = self._live[key] = _Rollout(self._next_slot, begin)
        self._next_slot += 1
        self._write(BEGIN, rollout.slot, rollout.begin)
        return rollout

    def end(self, key: Key) -> None:
        """The rollout under `key` is over (its row written, or its failure): nothing to resume, and
        the agent may close its session."""
        rollout = self._live.pop(key, None)
        if rollout is not None:
            self._write(END, rollout.slot, b"")
            if rollout.acknowledge is not None:
                rollout.acknowledge()

    def base(self, rollout: _Rollout, base: bytes) -> None:
        """An attempt of `rollout` begins from `base` (serialized)."""
        rollout.base, rollout.checkpoints = base, []
        if base:  # empty for the first attempt (from the prompt), as a BEGIN's rollout has it
            self._write(BASE, rollout.slot, base)

    def checkpoint(self, rollout: _Rollout, data: bytes) -> None:
        rollout.checkpoints.append(data)
        self._write(CHECKPOINT, rollout.slot, data)

    def flush(self) -> None:
        """Write the records given so far, at once (one system call, as a rule): the client calls it
        before it says it read a checkpoint that asked (client/run_many.py's Progress)."""
        if not self._pending or self._fd < 0:
            return
        # Taken, not cleared after: a failed write's traceback keeps a view of it, which no resize survives.
        data, self._pending = self._pending, bytearray()
        try:
            self._write_all(self._fd, data)
        except OSError as e:
            self._give_up(e)
            return
        self._written += len(data)
        if self._written > self._rewrite_at:
            self._rewrite()

    def close(self, finished: bool) -> None:
        """Stop writing; when the run `finished` (every job done, failed or skipped), remove the file."""
        self.flush()
        if self._timer is not None:
            self._timer.cancel()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if finished:
            with contextlib.suppress(OSError):  # never written (see `failed`), or gone
                self.path.unlink()

    def _write(self, kind: int, slot: int, payload: bytes) -> None:
        if self._fd < 0:
            return
        if self._timer is None:
            with contextlib.suppress(RuntimeError):  # no event loop (a caller of its own): at `flush`
                self._timer = asyncio.get_running_loop().call_later(PENDING_SECONDS, self._flush_in_time)
        self._pending += _RECORD.pack(len(payload), kind, slot)
        self._pending += payload
        if len(self._pending) > PENDING_BYTES:
            self.flush()

    def _flush_in_time(self) -> None:
        self._timer = None
        self.flush()

    @staticmethod
    def _write_all(fd: int, data: bytes | bytearray) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]

    def _rewrite(self) -> None:
        """Write the file again with its rollouts not ended only, in place of the old one at once
        (a rename)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        parts = [self._header]
        for rollout in self._live.values():
            for kind, payload in rollout.records():
                parts += [_RECORD.pack(len(payload), kind, rollout.slot), payload]
        data = b"".join(parts)
        temporary = self.path.with_name(self.path.name + ".new")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o644)
            self._write_all(self._fd, data)
            os.replace(temporary, self.path)
        except OSError as e:
            self._give_up(e)
            return
        self._written = len(data)
        self._rewrite_at = max(COMPACT_BYTES, COMPACT_RATIO * len(data))

    def _give_up(self, error: OSError) -> None:
        self._pending.clear()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self.failed is None:  # said in the run's summary; a full disk stops the run with its own error
            self.failed = f"cannot write {self.path} ({error.strerror or error}): rollouts in flight are not kept"


class _Tracker:
    """One rollout's progress into the file (client/run_many.py's Progress)."""

    __slots__ = ("_states", "_key", "_rollout")

    def __init__(self, states: States, key: Key) -> None:
        self._states, self._key = states, key
        self._rollout: _Rollout | None = None

    def attempt(self, rollout_id: str, base: task_pb2.RolloutState) -> None:
        if self._rollout is None:
            self._rollout = self._states.begin(self._key, rollout_id)
        self._states.base(self._rollout, base.SerializeToString())

    def checkpoint(self, data: bytes) -> None:
        if self._rollout is not None:
            self._states.checkpoint(self._rollout, data)

    @property
    def flush(self) -> Callable[[], None]:
        return self._states.flush  # equal for every rollout of the file: the client calls it once a reply

    def result(self, acknowledge: Callable[[], None]) -> None:
        assert self._rollout is not None  # the client tells of the attempt first
        # Called once its row is written (States.end), not before: a collector stopped between resumes it.
        self._rollout.acknowledge = acknowledge
