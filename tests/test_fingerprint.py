"""The run fingerprint next to a collect output: same run resumes, another run is refused."""

import json
import subprocess
import sys

import pytest

from gym_grpc import errors
from gym_grpc.batch import fingerprint


def _run(tmp_path, rows: str = '{"x": 1}\n', **changes):
    source = tmp_path / "tasks.jsonl"
    source.write_text(rows)
    settings = {"agent": "a", "overrides": {}, "num_repeats": 1, "skip_verify": False, "placeholder_reward": 0.0}
    return fingerprint.of_run(source, **{**settings, **changes})


def test_an_output_written_before_fingerprints_existed_is_taken_as_this_run(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text('{"task_index": 0}\n')
    fingerprint.check_and_record(out, _run(tmp_path))
    assert json.loads(fingerprint.path_for(out).read_text())["agent"] == "a"


def test_an_empty_output_takes_any_run(tmp_path):
    out = tmp_path / "out.jsonl"
    fingerprint.check_and_record(out, _run(tmp_path))
    out.write_text("")  # the first run wrote nothing
    fingerprint.check_and_record(out, _run(tmp_path, num_repeats=4))
    assert json.loads(fingerprint.path_for(out).read_text())["num_repeats"] == 4


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"rows": '{"x": 2}\n'}, "the input rows differ"),
        ({"num_repeats": 4}, "--num-repeats was 1, is 4 now"),
        ({"skip_verify": True}, "--skip-verify was false, is true now"),
    ],
)
def test_another_run_into_an_output_with_rows_is_refused_naming_the_difference(tmp_path, change, said):
    out = tmp_path / "out.jsonl"
    fingerprint.check_and_record(out, _run(tmp_path))
    out.write_text('{"task_index": 0}\n')
    with pytest.raises(fingerprint.RunMismatch, match=said):
        fingerprint.check_and_record(out, _run(tmp_path, **change))
    fingerprint.check_and_record(out, _run(tmp_path, **change), force=True)  # forced: recorded
    fingerprint.check_and_record(out, _run(tmp_path, **change))


def test_an_output_another_run_holds_is_refused_until_that_run_ends_or_dies(tmp_path):
    """A real second process holds the output (as a second `gym-grpc collect` into it would); once
    SIGKILLed, the kernel lets go of its lock and the output can be claimed."""
    out = tmp_path / "out.jsonl"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from gym_grpc.batch import fingerprint\n"
            "with fingerprint.claimed(Path(sys.argv[1]), {}):\n"
            "    print('held', flush=True); time.sleep(600)",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(errors.OutputInUse, match=f"another run is writing {out}"):
            with fingerprint.claimed(out, _run(tmp_path)):
                pass
    finally:
        holder.kill()
        holder.wait()
    with fingerprint.claimed(out, _run(tmp_path, num_repeats=2)):
        with pytest.raises(errors.OutputInUse):  # one run at a time, in one process too
            with fingerprint.claimed(out, _run(tmp_path, num_repeats=2)):
                pass
    assert json.loads(fingerprint.path_for(out).read_text())["num_repeats"] == 2


def test_an_empty_fingerprint_file_is_taken_as_none(tmp_path):
    """What `claimed` leaves when its process dies before the fingerprint is written, or a write cut short."""
    out = tmp_path / "out.jsonl"
    out.write_text('{"task_index": 0}\n')
    fingerprint.path_for(out).write_text("")
    fingerprint.check_and_record(out, _run(tmp_path))
    assert json.loads(fingerprint.path_for(out).read_text())["agent"] == "a"
