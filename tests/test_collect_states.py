"""The states file of a collection (gym_grpc/batch/states.py): what a stopped collector leaves of
its rollouts in flight, read back by the next run. The end to end tests (a real `gym-grpc collect`
killed and run again) are in test_durable_rollouts.py."""

from __future__ import annotations

import io
import json

import pytest

from gym_grpc.batch import states
from gym_grpc.data import rollout_state
from gym_grpc.testing import call
from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2
from tests.support import eventually

RUN = "digest-of-the-run"


def _turn(index: int) -> bytes:
    """A turn that calls `add`, as its checkpoint (the first one also begins the attempt)."""
    add = call("add", json.dumps({"a": index, "b": 1}))
    checkpoint = agent_pb.RunCheckpoint(turn_index=index)
    checkpoint.turn.response.CopyFrom(r.Response(status=r.RESPONSE_STATUS_COMPLETED, output=[add]))
    if index == 0:
        checkpoint.attempt.CopyFrom(task_pb2.RolloutAttempt(agent="agent", session_id="s1"))
    return checkpoint.SerializeToString()


def _output(index: int, turn: int) -> bytes:
    """The tool output of turn `turn`'s call, as its checkpoint."""
    checkpoint = agent_pb.RunCheckpoint(turn_index=turn)
    checkpoint.turn.tool_outputs.add(call_id=f"call-{index}", output=str(turn + 1))
    return checkpoint.SerializeToString()


def _open(path, log=None) -> states.States:
    return states.States.open(path, RUN, log or io.StringIO())


def _begun(file: states.States, key, rollout_id: str, *checkpoints: bytes):
    """The progress of a rollout sent durable from its prompt under `key`, given `checkpoints`."""
    progress = file.track(key)
    progress.attempt(rollout_id, task_pb2.RolloutState())
    for checkpoint in checkpoints:
        progress.checkpoint(checkpoint)
    return progress


def _stopped_run(path, *checkpoints: bytes) -> None:
    """A run that kept rollout "r" under key (0, 0) with `checkpoints`, then stopped."""
    file = _open(path)
    _begun(file, (0, 0), "r", *checkpoints)
    file.close(finished=False)


def test_a_rollout_not_ended_comes_back_with_its_turns_and_its_attempt_ended_as_stopped(tmp_path):
    path = tmp_path / "out.states"
    file = _open(path)
    _begun(file, (3, 1), "r-1", _turn(0), _output(0, 0), _turn(1))
    _begun(file, (4, 0), "r-2", _turn(0))
    file.end((4, 0))
    file.track((5, 0))  # never sent durable: nothing of it is kept
    file.close(finished=False)

    again = _open(path)
    assert again.resumable == 1 and again.resume_of((4, 0)) is None and again.resume_of((5, 0)) is None
    kept = again.resume_of((3, 1))
    assert kept is not None and kept.rollout_id == "r-1"
    assert len(kept.state.turns) == 2 and len(kept.state.turns[0].tool_outputs) == 1
    (attempt,) = kept.state.attempts
    assert attempt.session_id == "s1" and attempt.ended == states.STOPPED
    assert not attempt.turn_lost  # it stopped before turn 1's tool call, not in a model call
    rollout_state.check(kept.state, "resume")  # an agent can go on from it


def test_a_resumed_rollout_stopped_again_comes_back_from_its_new_attempt(tmp_path):
    path = tmp_path / "out.states"
    _stopped_run(path, _turn(0))

    second_run = _open(path)
    kept = second_run.resume_of((0, 0))
    assert kept is not None
    progress = second_run.track((0, 0))
    progress.attempt(kept.rollout_id, kept.state)
    attempt = agent_pb.RunCheckpoint(turn_index=0, attempt=task_pb2.RolloutAttempt(agent="agent", first_turn=1))
    progress.checkpoint(attempt.SerializeToString())
    progress.checkpoint(_output(0, 0))
    second_run.close(finished=False)

    third_run = _open(path)
    assert third_run.resumable == 1
    state = third_run.resume_of((0, 0)).state
    assert [a.ended for a in state.attempts] == [states.STOPPED, states.STOPPED]
    assert len(state.turns[0].tool_outputs) == 1


def test_a_record_cut_short_by_the_process_end_is_left_out_and_the_rest_kept(tmp_path):
    path = tmp_path / "out.states"
    _stopped_run(path, _turn(0), _output(0, 0))
    path.write_bytes(path.read_bytes()[:-3])  # the last checkpoint only partly written

    kept = _open(path).resume_of((0, 0))
    assert kept is not None and len(kept.state.turns) == 1 and not kept.state.turns[0].tool_outputs


def test_the_states_of_another_run_are_replaced_with_a_note(tmp_path):
    path = tmp_path / "out.states"
    _stopped_run(path, _turn(0))

    log = io.StringIO()
    other = states.States.open(path, "another-run", log)
    assert other.resumable == 0 and other.resume_of((0, 0)) is None
    assert f"{path} holds the states of another run: replaced" in log.getvalue()
    other.close(finished=False)
    assert _open(path).resumable == 0


def test_a_finished_run_removes_the_file(tmp_path):
    path = tmp_path / "out.states"
    file = _open(path)
    assert path.exists()
    file.close(finished=True)
    assert not path.exists()


def test_the_file_is_written_again_with_only_its_rollouts_not_ended_once_it_outgrows_them(tmp_path, monkeypatch):
    monkeypatch.setattr(states, "COMPACT_BYTES", 20_000)
    path = tmp_path / "out.states"
    file = _open(path)
    _begun(file, (0, 0), "kept", _turn(0))
    largest = 0
    for index in range(1, 2_000):
        _begun(file, (index, 0), f"r-{index}", _turn(0)).flush()  # as the client does after each reply
        file.end((index, 0))
        largest = max(largest, path.stat().st_size)
    file.close(finished=False)
    assert largest < 25_000  # ~100 bytes a rollout ended, 2,000 of them: 200 KB without rewriting
    again = _open(path)
    assert again.resumable == 1 and again.resume_of((0, 0)).rollout_id == "kept"


def test_a_file_that_cannot_be_written_costs_a_warning_not_the_run(tmp_path):
    """The warning is `failed`, which the run's summary says (collector.py)."""
    (tmp_path / "taken").write_text("a file where the directory would be")
    file = _open(tmp_path / "taken" / "out.states")
    _begun(file, (0, 0), "r", _turn(0))  # nothing raised: the rollout goes on
    file.close(finished=True)
    assert file.failed is not None and "rollouts in flight are not kept" in file.failed


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (b"\x05\x00\x00\x00\x01\x07\x00\x00\x00x y z", "is not 'TASK REPEAT ID'"),
        (b"\x02\x00\x00\x00\x01\x07\x00\x00\x00\xff\xfe", "is not 'TASK REPEAT ID'"),
        (b"\x00\x00\x00\x00\x09\x07\x00\x00\x00", "of no known kind (9)"),
    ],
)
def test_a_damaged_file_is_read_up_to_the_damage_with_a_note(tmp_path, damage, says):
    path = tmp_path / "out.states"
    _stopped_run(path, _turn(0))
    path.write_bytes(path.read_bytes() + damage)
    log = io.StringIO()
    again = _open(path, log)
    assert again.resumable == 1 and again.resume_of((0, 0)).rollout_id == "r"
    assert f"{path} is damaged" in log.getvalue() and says in log.getvalue()


def test_a_state_an_agent_cannot_go_on_from_is_left_out_with_a_note(tmp_path):
    path = tmp_path / "out.states"
    _stopped_run(path, b"\xff not a checkpoint")
    log = io.StringIO()
    assert _open(path, log).resume_of((0, 0)) is None
    assert "the state of rollout (0, 0)" in log.getvalue() and "from its prompt" in log.getvalue()


async def test_records_no_checkpoint_asked_for_are_written_within_a_second_all_the_same(tmp_path):
    """A stateless environment's turns are never asked for (their tool calls have no effects to
    lose): they are written by the file's timer, not at once."""
    path = tmp_path / "out.states"
    file = _open(path)
    _begun(file, (0, 0), "r", _turn(0))
    written = path.stat().st_size
    await eventually(lambda: path.stat().st_size > written, "the timer's write", seconds=states.PENDING_SECONDS + 30)
    copy = tmp_path / "copy.states"
    copy.write_bytes(path.read_bytes())
    assert _open(copy).resume_of((0, 0)) is not None
    file.close(finished=True)
