"""The rollout record: the row `collect` writes for one rollout, and everything that reads one back.

A record is the task row it came from, then what the rollout produced
(`response`, `reward`, the verifier's fields, `stop_reason`, `model_calls`,
`timings`) and its key: (task index, repeat index), written under gym-grpc's
names and NeMo Gym's. The collector, the agent's RunJson, the training client,
reverify and the summary all build and read records here.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from gym_grpc.data import rows
from gym_grpc.v1 import responses_pb2 as r
from gym_grpc.v1 import task_pb2

JSON = dict[str, Any]

# --- building ---------------------------------------------------------------------


def with_verdict(row: JSON, reward: float, fields: JSON, components: Mapping[str, float]) -> JSON:
    """A copy of `row` with a verification: `reward`, the verifier's fields (named
    in `verifier_fields`) and `reward_components` when there are any."""
    return _add_verdict(dict(row), reward, fields, components)


def _add_verdict(row: JSON, reward: float, fields: JSON, components: Mapping[str, float]) -> JSON:
    """`with_verdict` in place: a key the row has keeps its place and takes the new value."""
    row["reward"] = reward
    row.update(fields)
    row["verifier_fields"] = sorted(fields)
    if components:
        row["reward_components"] = dict(components)
    return row


def scored(row: JSON, rollout: task_pb2.Rollout) -> JSON:
    """The task row, then `response` and the verification (a record without `build`'s run fields).
    The task row is copied once."""
    out = {**row, "response": rows.response_to_json(rollout.response)}
    return _add_verdict(out, rollout.reward, rows.json_field(rollout, "verifier_fields"), rollout.reward_components)


STOP_REASONS = {
    task_pb2.STOP_REASON_FINAL_MESSAGE: "final_message",
    task_pb2.STOP_REASON_MAX_STEPS: "max_steps",
    task_pb2.STOP_REASON_INCOMPLETE: "incomplete",
    task_pb2.STOP_REASON_EPISODE_OVER: "episode_over",
    task_pb2.STOP_REASON_TOKEN_BUDGET: "token_budget",
}


def build(task_row: JSON, rollout: task_pb2.Rollout, placeholder_reward: float = 0.0) -> JSON:
    """The rollout row (without its key): `scored`'s row, then the run's fields."""
    row = scored(task_row, rollout)
    if rollout.verification_skipped:
        row["reward"] = placeholder_reward
        row["verification_skipped"] = True
    t = rollout.timings
    row["stop_reason"] = STOP_REASONS.get(rollout.stop_reason, "unspecified")
    row["model_calls"] = rollout.model_calls
    row["timings"] = {
        "model": t.model_seconds,
        "tools": t.tools_seconds,
        "verify": t.verify_seconds,
        "total": t.total_seconds,
    }
    if rollout.HasField("policy_version"):
        row["policy_version"] = rollout.policy_version
    if rollout.attempts:
        row["attempts"] = [_attempt(a) for a in rollout.attempts]
    if rollout.roles:
        row["roles"] = [_role(role, not rollout.verification_skipped) for role in rollout.roles]
    row["finished_at"] = time.time()  # for throughput over time (`gym-grpc report`)
    return row


def _attempt(attempt: task_pb2.RolloutAttempt) -> JSON:
    """One attempt of a resumed rollout, as its row shows it."""
    out: JSON = {"agent": attempt.agent, "first_turn": attempt.first_turn}
    if attempt.session_id:
        out["session_id"] = attempt.session_id
    if attempt.session_replayed:
        out["session_replayed"] = True
    if attempt.ended:
        out["ended"] = attempt.ended
    if attempt.turn_lost:
        out["turn_lost"] = True
    return out


def _role(role: task_pb2.RolloutRole, verified: bool) -> JSON:
    """One role of an episode with several, as its row shows it: `items` are positions in the row's
    response.output."""
    out: JSON = {"name": role.name, "model_server": role.model_server}
    if verified:
        out["reward"] = role.reward
    out["model_calls"] = role.model_calls
    out["items"] = list(role.items)
    return out


def role_rewards(row: JSON) -> dict[str, float]:
    """The rewards of a row's roles, by name (empty for a rollout of one agent, or one not verified)."""
    roles = row.get("roles")
    if not isinstance(roles, list):
        return {}
    return {
        str(role["name"]): float(role["reward"])
        for role in roles
        if isinstance(role, dict)
        and "name" in role
        and isinstance(role.get("reward"), int | float)
        and not isinstance(role.get("reward"), bool)
    }


def turns_regenerated(row: JSON) -> int:
    """How many of a rollout's turns were generated again after an attempt at it was lost."""
    attempts = row.get("attempts")
    return sum(1 for a in attempts if isinstance(a, dict) and a.get("turn_lost")) if isinstance(attempts, list) else 0


# --- keys -------------------------------------------------------------------------


#: The key's names: gym-grpc's, then NeMo Gym's.
KEY = ("task_index", "repeat_index")
NEMO_KEY = ("_ng_task_index", "_ng_rollout_index")


def key_names(row: dict[str, Any]) -> tuple[str, str] | None:
    """The names a row's key is written under: ours when it has either, else NeMo Gym's; None without."""
    return next((names for names in (KEY, NEMO_KEY) if names[0] in row or names[1] in row), None)


def row_key(row: dict[str, Any]) -> tuple[Any, Any]:
    """A row's (task index, repeat index) as written, unchecked; (None, None) without."""
    t, k = key_names(row) or KEY
    return row.get(t), row.get(k)


def set_key(row: dict[str, Any], task_index: int, repeat_index: int) -> None:
    """Write a row's key under both names."""
    for t, k in (KEY, NEMO_KEY):
        row[t], row[k] = task_index, repeat_index


#: The agent of a row that names none (NeMo Gym's rows may have no agent_ref).
NO_AGENT = "(no agent)"
#: A rollout's identity across runs: (agent, task index, repeat index); an index that is
#: missing or not a non-negative integer is None.
RolloutKey = tuple[str, int | None, int | None]


def _index(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def rollout_key(row: dict[str, Any]) -> RolloutKey:
    """The (agent, task, repeat) of a rollout row, under either key name."""
    ref = row.get("agent_ref")
    name = ref.get("name") if isinstance(ref, dict) else None
    task, repeat = row_key(row)
    return (name if isinstance(name, str) and name else NO_AGENT, _index(task), _index(repeat))


def failure_key(entry: dict[str, Any]) -> RolloutKey:
    """The (agent, task, repeat) a failures sidecar record is about."""
    group = entry.get("group")
    return (
        group if isinstance(group, str) and group else NO_AGENT,
        _index(entry.get("task_index")),
        _index(entry.get("repeat_index")),
    )


def key_slot(row: dict[str, Any], n_tasks: int, repeats: int) -> int | None:
    """The slot of a row's key in [0, n_tasks * repeats), or None when it has none there."""
    t, k = row_key(row)
    if not (isinstance(t, int) and isinstance(k, int) and 0 <= t < n_tasks and 0 <= k < repeats):
        return None
    return t * repeats + k


#: Rollout fields that the collector writes, none of them a task's own.
ROLLOUT_FIELDS = frozenset(
    {
        "response",
        "reward",
        "reward_components",
        "verifier_fields",
        "verification_skipped",
        "stop_reason",
        "model_calls",
        "timings",
        "finished_at",
        "policy_version",
        "roles",
        *KEY,
        *NEMO_KEY,
    }
)

# --- reading ----------------------------------------------------------------------


def parse(row: Any) -> tuple[JSON, task_pb2.Task, r.Response]:
    """A record read back: its task row, that row as a Task, and its response.

    Raises `rows.RowError` naming the field when the row is not a rollout record."""
    if not isinstance(row, dict) or not isinstance(row.get("response"), dict):
        raise rows.RowError("response", "is required: this is not a rollout row")
    response = rows.response_from_json(row["response"])
    task_row = task_fields(row)
    return task_row, rows.task_from_row(task_row), response


def verification(row: JSON) -> task_pb2.VerificationResult:
    """A record's verdict as the protocol carries it: its task index, reward, verifier fields
    and reward components."""
    task_index, _ = row_key(row)
    fields = {name: row[name] for name in row.get("verifier_fields") or () if name in row}
    result = task_pb2.VerificationResult(
        task_index=task_index if isinstance(task_index, int) and task_index >= 0 else 0,
        reward=float(row.get("reward") or 0.0),
        fields_json=rows.dumps(fields) if fields else "",
    )
    components = row.get("reward_components")
    if isinstance(components, dict):
        result.reward_components.update({k: float(v) for k, v in components.items() if isinstance(v, int | float)})
    return result


def task_fields(row: dict[str, Any]) -> dict[str, Any]:
    """The task row inside a rollout row: without the rollout's fields and its verifier's."""
    produced = set(row.get("verifier_fields") or ()) | ROLLOUT_FIELDS
    return {k: v for k, v in row.items() if k not in produced}


def has_answer(response: Any) -> bool:
    """Whether a dumped response holds any assistant text or tool call."""
    for item in response.get("output", []) if isinstance(response, dict) else []:
        if item.get("type") == "function_call":
            return True
        if item.get("type") == "message" and item.get("role") == "assistant":
            content = item.get("content")
            texts = [content] if isinstance(content, str) else [p.get("text", "") for p in content or []]
            if any(t.strip() for t in texts):
                return True
    return False


def usage_of(row: dict[str, Any]) -> tuple[int, int]:
    """(input tokens, output tokens) of a rollout row's response."""
    usage = (row.get("response") or {}).get("usage") or {}
    return int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)
