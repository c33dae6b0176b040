"""The state of an unfinished rollout (RolloutState), grown one checkpoint at a time.

A durable run's agent reports each turn boundary as a RunCheckpoint and sends it; both ends
keep the checkpoints, not a state: the agent builds the state from them when the run is
parked, its caller when the run is lost and must be resumed (most runs are neither). One
function applies them for both, so the two states cannot disagree.
"""

from __future__ import annotations

from collections.abc import Iterable

from gym_grpc.v1 import agent_service_pb2 as agent_pb
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

#: RolloutAttempt.ended of a parked attempt.
PARKED = "parked"


def apply(state: task_pb2.RolloutState, checkpoint: agent_pb.RunCheckpoint) -> None:
    """Add what `checkpoint` says to `state` (see RunCheckpoint in agent_service.proto)."""
    if checkpoint.HasField("attempt"):
        state.attempts.append(checkpoint.attempt)
    if not checkpoint.HasField("turn"):
        return
    index, turn = checkpoint.turn_index, checkpoint.turn
    if turn.HasField("response"):
        del state.turns[index:]
        state.turns.add().CopyFrom(turn)
    elif index < len(state.turns):
        kept = state.turns[index]
        kept.tool_outputs.extend(turn.tool_outputs)
        kept.tools_seconds += turn.tools_seconds


def build(base: task_pb2.RolloutState, checkpoints: Iterable[agent_pb.RunCheckpoint]) -> task_pb2.RolloutState:
    """A new state: `base` (where the attempt began) with `checkpoints` applied in order."""
    state = task_pb2.RolloutState()
    state.CopyFrom(base)
    for checkpoint in checkpoints:
        apply(state, checkpoint)
    return state


def calls_of(turn: task_pb2.RolloutTurn) -> int:
    """How many function calls the turn's response made."""
    return sum(1 for item in turn.response.output if item.WhichOneof("item") == "function_call")


def ends_rollout(turn: task_pb2.RolloutTurn) -> bool:
    """Whether the rollout ends with this turn: its output was cut short, or it called no tool."""
    return turn.response.status == r.RESPONSE_STATUS_INCOMPLETE or calls_of(turn) == 0


def end_attempt(state: task_pb2.RolloutState, attempts_before: int, why: str) -> None:
    """Mark the attempt that left `state` as ended (`why`: "parked", or its status), when it
    began (it sent its first checkpoint: `state` has more than `attempts_before` attempts).
    It lost a turn when it ended waiting for the model: the last turn was whole (or there was
    none) and did not end the rollout."""
    if len(state.attempts) <= attempts_before:
        return  # it never began: nothing of it to record
    attempt = state.attempts[-1]
    attempt.ended = why
    if why != PARKED:
        last = state.turns[-1] if state.turns else None
        attempt.turn_lost = last is None or (len(last.tool_outputs) >= calls_of(last) and not ends_rollout(last))


def check(state: task_pb2.RolloutState, field: str) -> None:
    """Raise ValueError naming the field of `state` that an agent cannot resume from."""
    for index, turn in enumerate(state.turns):
        where = f"{field}.turns[{index}]"
        if not turn.HasField("response"):
            raise ValueError(f"{where}.response: is required")
        calls = calls_of(turn)
        if len(turn.tool_outputs) > calls:
            raise ValueError(f"{where}.tool_outputs: {len(turn.tool_outputs)} outputs for {calls} function calls")
        last = index == len(state.turns) - 1
        if not last and (ends_rollout(turn) or len(turn.tool_outputs) < calls):
            raise ValueError(f"{where}: only the last turn may be unfinished or end the rollout")
    for index, attempt in enumerate(state.attempts):
        if attempt.first_turn > len(state.turns):
            raise ValueError(
                f"{field}.attempts[{index}].first_turn: {attempt.first_turn} is past the {len(state.turns)} turns"
            )
