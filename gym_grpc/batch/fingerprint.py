"""What defines a collection, recorded next to its output: a re-run resumes only the same run.

`gym-grpc collect` skips the keys an output already holds, so a second command
into the same output resumes the first. That is only right when it is the same
run: the same input rows, agent, overrides, repeats and verification. Otherwise
the output would mix rollouts of two runs (weather rows counted as done math
rows, temperature 0.6 rows beside 1.0 rows). The first run writes
`<output stem>.run.json`; a later run with another fingerprint is refused unless
forced, and `--limit` is not part of it (raising it is how a run is extended).

One run writes an output at a time: a run holds the fingerprint file locked while it goes
(`claimed`), and a second one into the same output stops at once. Two at once would each run every
key the output lacks, writing their rows twice, and write the states of their rollouts in flight
into one file (batch/states.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gym_grpc import errors
from gym_grpc.data import jsonl

#: Keys compared between runs, in the order a mismatch names them.
_COMPARED = ("input_sha256", "agent", "overrides", "num_repeats", "skip_verify", "placeholder_reward")
_LABELS = {
    "input_sha256": "the input rows",
    "agent": "--agent",
    "overrides": "the KEY=VALUE overrides",
    "num_repeats": "--num-repeats",
    "skip_verify": "--skip-verify",
    "placeholder_reward": "--placeholder-reward",
}


class RunMismatch(errors.FrameworkError):
    """The output holds rollouts of another run; resuming into it would mix the two."""

    reason = errors.Reason.RUN_MISMATCH


def path_for(output: Path) -> Path:
    """The fingerprint of an output file: `<stem>.run.json` next to it."""
    return output.with_name(f"{output.stem}.run.json")


def of_run(
    input_path: Path,
    *,
    agent: str | None,
    overrides: dict[str, Any],
    num_repeats: int,
    skip_verify: bool,
    placeholder_reward: float,
) -> dict[str, Any]:
    """The fingerprint of a collection: the compared keys, and the input's path for people."""
    with input_path.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return {
        "input": str(input_path),
        "input_sha256": digest,
        "agent": agent,
        "overrides": overrides,
        "num_repeats": num_repeats,
        "skip_verify": skip_verify,
        "placeholder_reward": placeholder_reward if skip_verify else None,
    }


@contextlib.contextmanager
def claimed(output: Path, fingerprint: dict[str, Any], *, force: bool = False) -> Iterator[None]:
    """Hold `output` for this run while the block runs (its fingerprint file locked: data/jsonl.py's
    `held`), its fingerprint checked and recorded (check_and_record). Raises errors.OutputInUse when
    another run holds it."""
    with jsonl.held(output, path_for(output)):
        check_and_record(output, fingerprint, force=force)
        yield


def check_and_record(output: Path, fingerprint: dict[str, Any], *, force: bool = False) -> None:
    """Record `fingerprint` for `output`. Raise RunMismatch when the output already holds
    rollouts of a run with another fingerprint, unless `force` (then the new one is recorded).

    An output with rows but no fingerprint (written by an older gym-grpc, or by hand) is
    taken as this run's: there is nothing to compare with; so is an empty fingerprint file (made by
    `claimed`, or cut short as it was written)."""
    record = path_for(output)
    earlier: dict[str, Any] = {}
    if not force and record.exists() and output.exists() and output.stat().st_size:
        try:
            text = record.read_text()
            earlier = json.loads(text) if text else {}
        except (OSError, ValueError) as e:
            raise RunMismatch(f"cannot read {record}: {e}; remove it to resume into {output}") from None
    if earlier:
        differences = [
            _difference(key, earlier.get(key), fingerprint[key])
            for key in _COMPARED
            if earlier.get(key) != fingerprint[key]
        ]
        if differences:
            raise RunMismatch(
                f"{output} holds rollouts of another run ({record}): " + "; ".join(differences) + ". "
                "Write to a new --output, or pass --force to resume into it anyway (the keys it holds are skipped)"
            )
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(fingerprint, indent=2) + "\n")
    except OSError as e:  # a read-only place, a disk already full: nothing of the run is written yet
        raise errors.OutputError(f"cannot write {record}: {e.strerror or e}") from None


def digest(fingerprint: dict[str, Any]) -> str:
    """What tells this run from another, in one string: the digest of the compared keys (the states
    file's header, batch/states.py)."""
    compared = {key: fingerprint[key] for key in _COMPARED}
    return hashlib.sha256(json.dumps(compared, sort_keys=True).encode()).hexdigest()


def _difference(key: str, before: Any, now: Any) -> str:
    if key == "input_sha256":
        return f"the input rows differ (sha256 {str(before)[:12]}... then, {now[:12]}... now)"
    was, now_is = ("were", "are") if key == "overrides" else ("was", "is")
    return f"{_LABELS[key]} {was} {json.dumps(before)}, {now_is} {json.dumps(now)} now"
