"""Rollout files on disk: JSONL rows keyed by (task_index, repeat_index).

NeMo Gym names the same key `_ng_task_index` / `_ng_rollout_index`. A row is
keyed by ours when it has either of them, else by NeMo Gym's; rows written
here carry both pairs, equal, so that either tool can resume, re-verify and
aggregate the other's files.

Output is only ever appended, one whole line per rollout (`Appender`); a
collector killed mid-write can leave a torn last line, which `repair_tail`
cuts off before anything is appended again. Which keys a file holds is kept
as one bit per key slot (`KeyBits`: 125 KB for a million keys), so resuming a
large output stays small.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Container, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from gym_grpc import errors
from gym_grpc.data import json_input, record


class DuplicateKey(errors.FrameworkError, ValueError):
    """A JSON object with the same key twice (json.loads would keep the last silently)."""

    reason = errors.Reason.JSON_DUPLICATE_KEY


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise DuplicateKey(f"duplicate key {key!r} in a JSON object")
        obj[key] = value
    return obj


def loads(text: str) -> Any:
    """json_input.loads that also refuses objects with a duplicate key."""
    return json_input.loads(text, object_pairs_hook=_no_duplicates)


def parse_line(raw: bytes) -> Any:
    """One input line as JSON; ValueError saying what is wrong (not UTF-8, not JSON, a duplicate key, too deep)."""
    try:
        return loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {e.start}): {raw[:80]!r}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON: {e}") from None
    except json_input.TooDeep as e:
        raise ValueError(f"{e}, the most every gym.v1 peer can carry") from None


def dump_line(row: Any) -> bytes:
    """One JSONL line, compact, UTF-8, with its newline.

    orjson (several times faster than json) unless the row holds what it would write
    differently: orjson writes NaN and Infinity as null, where json writes them as
    they are, so a line with a null in it is written by json (rows rarely hold one);
    and orjson refuses an integer beyond 64 bits or a key that is not a string."""
    try:
        line = orjson.dumps(row, option=orjson.OPT_APPEND_NEWLINE)
    except TypeError:  # orjson.JSONEncodeError is one
        line = b"null"
    if b"null" not in line:
        return line
    return (json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


class Appender:
    """Appends rows to a JSONL file, each line written whole or not at all.

    A line that cannot be written in full (a full disk, a quota, an I/O error)
    is cut off again and `errors.OutputError` is raised: the file keeps every
    earlier row and no torn one. Each line goes to the kernel at once, unbuffered.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._size = os.fstat(self._fd).st_size

    def append(self, row: dict[str, Any]) -> None:
        line = memoryview(dump_line(row))
        try:
            written = 0
            while written < len(line):
                written += os.write(self._fd, line[written:])
        except OSError as e:
            with contextlib.suppress(OSError):  # if even this fails, repair_tail cuts it on resume
                os.ftruncate(self._fd, self._size)
            raise errors.OutputError(f"cannot write {self.path}: {e.strerror}") from None
        self._size += written

    def close(self) -> None:
        os.close(self._fd)


@contextlib.contextmanager
def held(output: Path, lock: Path | None = None) -> Iterator[None]:
    """Hold `output` for one run while the block runs, by `lock` (the output itself unless given: a
    file next to it that the run writes anyway) locked. Raises errors.OutputInUse when another run
    holds it: two runs into one output would each write the rows it lacks. The lock (flock) goes
    with the process however it ends; on a filesystem without locks nothing is held."""
    lock = lock or output
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError as e:  # a read-only place, a disk already full: nothing of the run is written yet
        raise errors.OutputError(f"cannot write {lock}: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held_by = "" if lock == output else f" (it holds {lock})"
            raise errors.OutputInUse(
                f"another run is writing {output}{held_by}: two at once would write its rows twice. "
                "Wait for it to end, or stop it; then run this command again to resume"
            ) from None
        except OSError:
            pass  # no locks on this filesystem (ENOLCK, EOPNOTSUPP): not guarded
        yield
    finally:
        os.close(fd)


def failures_path(output: Path) -> Path:
    """The failures sidecar of an output file: `<stem>.failures.jsonl` next to it."""
    return output.with_name(f"{output.stem}.failures.jsonl")


@dataclass
class SidecarFailures:
    """What a failures sidecar says beyond its output file."""

    #: Rollouts that failed and that no row of the output made good, each with the `error` of its
    #: last record (a key that failed in several runs counts once).
    missing: dict[record.RolloutKey, dict[str, Any]] = field(default_factory=dict)
    #: Rollouts that failed in one run and were written by a later one.
    recovered: int = 0
    #: Records of input rows that did not load (no rollout, so in no group).
    bad_rows: int = 0


def failure_records(output: Path) -> Iterator[tuple[record.RolloutKey, dict[str, Any]]]:
    """The failed rollouts of `output`'s failures sidecar, in the order written: each one's key and
    `error` (a key may come again from a later run). Records of input rows that did not load are
    left out: `sidecar_failures` counts them."""
    for entry in iter_rows(failures_path(output)):
        if not _is_bad_row(entry):
            yield record.failure_key(entry), entry["error"]


def _is_bad_row(entry: dict[str, Any]) -> bool:
    return "line" in entry or not isinstance(entry.get("error"), dict)


def sidecar_failures(output: Path, written: Container[record.RolloutKey]) -> SidecarFailures:
    """Read `output`'s failures sidecar against the keys of the rows `output` holds."""
    found = SidecarFailures()
    recovered: set[record.RolloutKey] = set()
    for entry in iter_rows(failures_path(output)):
        if _is_bad_row(entry):
            found.bad_rows += 1
            continue
        key = record.failure_key(entry)
        if key in written:
            recovered.add(key)
        else:
            found.missing[key] = entry["error"]
    found.recovered = len(recovered)
    return found


#: Bytes read at a time past a line's size limit, looking for its end.
_SKIP_CHUNK = 1 << 20


@dataclass(frozen=True)
class Line:
    """One line of a file as `lines` reads it: its bytes (None when it is over the size limit,
    which were passed over, never held), its size, and its number (from 1)."""

    number: int
    size: int
    raw: bytes | None


def lines(f: IO[bytes], limit: int) -> Iterator[Line]:
    """The lines of a binary file, each held only when it has at most `limit` bytes (its newline
    not counted). A line is read in chunks of a MiB: one that grows past `limit` is let go of and
    read through, so that a line of any size costs at most `limit` bytes of memory."""
    number = 0
    while True:
        chunk = f.readline(_SKIP_CHUNK)
        if not chunk:
            return
        number += 1
        chunks: list[bytes] | None = [chunk]
        size = len(chunk)
        while not chunk.endswith(b"\n"):
            chunk = f.readline(_SKIP_CHUNK)
            if not chunk:
                break
            size += len(chunk)
            if chunks is not None:
                chunks.append(chunk)
                if size - chunk.endswith(b"\n") > limit:
                    chunks = None  # too long to keep: read through the rest
        size -= chunk.endswith(b"\n")
        if chunks is None or size > limit:
            yield Line(number, size, None)
        else:
            yield Line(number, size, chunks[0] if len(chunks) == 1 else b"".join(chunks))


def count_rows(path: Path, limit: int | None = None) -> int:
    """Non-blank lines of a file, at most `limit` (a long line is counted, not held)."""
    with path.open("rb") as f:
        count = sum(1 for line in lines(f, _SKIP_CHUNK) if line.raw is None or line.raw.strip())
    return count if limit is None else min(count, limit)


#: Every digit to "1", every other byte to "0" (for bytes.translate): twenty digits in a row
#: (maybe an integer beyond 64 bits) become twenty "1"s, found at C speed. A regex took
#: 30 times as long on rows full of token ids, and more than parsing them.
_DIGITS = bytes(0x31 if 0x30 <= b <= 0x39 else 0x30 for b in range(256))
_TWENTY_DIGITS = b"1" * 20


def loads_fast(text: str) -> Any:
    """JSON text as json.loads reads it, by orjson (several times faster) where that reads
    it the same: json when the text may hold an integer beyond 64 bits (orjson reads
    those as floats), NaN or Infinity (orjson refuses them), or is too deep for orjson."""
    raw = text.encode("utf-8", "surrogatepass")
    if _TWENTY_DIGITS not in raw.translate(_DIGITS):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


def iter_rows(path: Path) -> Iterator[dict[str, Any]]:
    """The complete JSON-object rows of a file, one at a time (others are passed over), read as
    json reads them (by `loads_fast`: resuming, summarising and reverifying a large output
    read every row of it)."""
    if not path.exists():
        return
    with path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = loads_fast(line)
            except (json.JSONDecodeError, RecursionError):  # a line nested too deep for the parser
                continue
            if isinstance(row, dict):
                yield row


def repair_tail(path: Path) -> None:
    """Cut a torn last line (a writer killed mid-line) so that appending stays valid JSONL."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with path.open("r+b") as f:
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return
        position = f.seek(0, 2)
        while position > 0:
            step = min(65536, position)
            position -= step
            f.seek(position)
            cut = f.read(step).rfind(b"\n")
            if cut >= 0:
                f.truncate(position + cut + 1)
                return
        f.truncate(0)


class KeyBits:
    """A set of key slots in [0, size), one bit each."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._bits = bytearray((size + 7) // 8)

    def add(self, slot: int) -> None:
        if not 0 <= slot < self.size:
            raise IndexError(f"slot {slot} outside [0, {self.size})")
        self._bits[slot >> 3] |= 1 << (slot & 7)

    def __contains__(self, slot: int) -> bool:
        return 0 <= slot < self.size and bool(self._bits[slot >> 3] & (1 << (slot & 7)))

    def __len__(self) -> int:
        """How many slots are in the set."""
        return sum(byte.bit_count() for byte in self._bits)


def done_keys(path: Path, n_tasks: int, repeats: int) -> KeyBits:
    """The key slots (task_index * repeats + repeat_index) whose rollout the file already holds."""
    done = KeyBits(n_tasks * repeats)
    for row in iter_rows(path):
        slot = record.key_slot(row, n_tasks, repeats)
        if slot is not None:
            done.add(slot)
    return done
