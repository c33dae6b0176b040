"""From rollouts to training samples: one token sequence per trajectory, with its loss mask.

A rollout's assistant turns each carry the ids the engine saw and sampled
(`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`). When
every turn's prompt begins with the previous turn's prompt + generation, the
trajectory is one sequence: the first prompt, then each generation (loss mask
1, with its log-probs) and, between two generations, what the template and
the tools added (mask 0, log-prob 0.0), as the engine tokenized it.

A turn whose prompt does not begin so (a non-monotonic history: a caller
edited an earlier message, a template dropped earlier reasoning, the model
server started a new sample) is counted and, by `non_monotonic`, either
starts a new sample of the same rollout (`split`, the default: each sample
is exactly what the model saw) or fails the rollout (`refuse`, NonMonotonic
naming the turn and the position where the ids part).

A failed rollout (the client's failure, or a record of the collector's
failures sidecar) is a masked member of its group: a sample with no ids,
`loss_multiplier` 0, and no reward. It is never a reward-0 sample.

For async training each turn carries the policy version that generated it
(gym_grpc/policy_version.py); a sample's `policy_version` is its oldest
turn's, and `build` can mask or drop samples too many versions behind.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gym_grpc import errors
from gym_grpc.client.training import RolloutResult, TokenTurn
from gym_grpc.data import jsonl, record
from gym_grpc.data.rows import RowError

NonMonotonicPolicy = Literal["split", "refuse"]
StalePolicy = Literal["mask", "drop"]


class NonMonotonic(errors.FrameworkError, ValueError):
    """A turn's prompt does not extend the previous turn's prompt and generation (with `refuse`)."""

    reason = errors.Reason.HISTORY_NOT_MONOTONIC


@dataclass(frozen=True)
class TrainingRollout:
    """A rollout as training sees it: its key, its reward and turns, or the failure that cost it."""

    agent: str
    task_index: int | None
    repeat_index: int | None
    reward: float | None
    turns: list[TokenTurn]
    failure: errors.Failure | None = None
    #: The role whose trajectory this is, in an episode with several; None otherwise.
    role: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> TrainingRollout:
        """A rollout row as `collect` writes it (or NeMo Gym does); of an episode with several roles, its
        items and reward as one trajectory (`per_role` parts them)."""
        agent, task, repeat = record.rollout_key(row)
        output = (row.get("response") or {}).get("output") or []
        return cls(agent, task, repeat, _row_reward(row), _token_turns(output))

    @classmethod
    def per_role(cls, row: dict[str, Any]) -> list[TrainingRollout]:
        """A rollout row as training sees it: one rollout, or one per role of an episode with several
        (its trajectory, RolloutRole.items, and its own reward)."""
        roles = row.get("roles")
        if not isinstance(roles, list) or not roles:
            return [cls.from_row(row)]
        agent, task, repeat = record.rollout_key(row)
        verified = _row_reward(row) is not None
        output = (row.get("response") or {}).get("output") or []
        rewards = record.role_rewards(row)
        out = []
        for number, role in enumerate(roles):
            if not isinstance(role, dict) or not isinstance(role.get("name"), str):
                raise RowError(f"roles.{number}.name", "is required: the role's name")
            positions = role.get("items") or []
            if not isinstance(positions, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(output) for i in positions
            ):
                raise RowError(f"roles.{number}.items", f"must be positions in response.output (0..{len(output) - 1})")
            name = role["name"]
            reward = rewards.get(name) if verified else None
            out.append(cls(agent, task, repeat, reward, _token_turns([output[i] for i in positions]), role=name))
        return out

    @classmethod
    def from_result(
        cls, result: RolloutResult, agent: str, task_index: int | None, repeat_index: int | None = None
    ) -> TrainingRollout:
        """A result of `GymClient.run` or `run_group`, failed or not (of an episode with several roles,
        every role's turns as one trajectory: `per_role_result` parts them)."""
        if not result.ok:
            return cls(agent, task_index, repeat_index, None, [], result.failure)
        return cls(agent, task_index, repeat_index, result.reward, result.turns)

    @classmethod
    def per_role_result(
        cls, result: RolloutResult, agent: str, task_index: int | None, repeat_index: int | None = None
    ) -> list[TrainingRollout]:
        """A result as training sees it: one rollout, or one per role of an episode with several (its
        turns, its own reward)."""
        roles = result.role_turns() if result.ok else {}
        if not roles:
            return [cls.from_result(result, agent, task_index, repeat_index)]
        return [
            cls(agent, task_index, repeat_index, reward, turns, role=name) for name, (reward, turns) in roles.items()
        ]


def _row_reward(row: dict[str, Any]) -> float | None:
    """A row's verified reward; None when it was not verified or has no number."""
    reward = row.get("reward")
    if row.get("verification_skipped") or not isinstance(reward, int | float):
        return None
    return float(reward)


def _token_turns(items: list[Any]) -> list[TokenTurn]:
    """The assistant turns with token ids among a row's output items, in order."""
    turns = []
    for item in items:
        if isinstance(item, dict) and item.get("generation_token_ids"):
            version = item.get("policy_version")
            turns.append(
                TokenTurn(
                    list(item.get("prompt_token_ids") or []),
                    list(item["generation_token_ids"]),
                    list(item.get("generation_log_probs") or []),
                    version if isinstance(version, int) and not isinstance(version, bool) else None,
                )
            )
    return turns


@dataclass
class Sample:
    """One token sequence to train on: `prompt_ids`, then `response_ids` (generations and what came
    between them), with a loss mask and the sampling log-probs aligned to `response_ids`."""

    agent: str
    task_index: int | None
    repeat_index: int | None
    #: Which sample of its rollout this is (a non-monotonic history splits a rollout), from 0.
    part: int
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    #: 1 on generated ids, 0 on the ids the template and tools added between generations.
    response_mask: list[int] = field(default_factory=list)
    #: The engine's log-prob of each generated id; 0.0 where the mask is 0.
    response_log_probs: list[float] = field(default_factory=list)
    #: The rollout's reward (every sample of a rollout shares it); None for a failed rollout.
    reward: float | None = None
    #: Model calls in this sample.
    num_turns: int = 0
    #: Why the rollout failed ("Class (CODE): message"); such a sample has no ids and no loss.
    failure: str | None = None
    #: Set by `groups.assign_advantages`.
    advantage: float = 0.0
    #: The oldest policy version among its turns (None when they carry none).
    policy_version: int | None = None
    #: How many versions behind the trainer's current one that is (`build(current_version=...)`).
    lag: int | None = None
    #: More than `max_lag` behind: no loss (`stale="mask"`).
    stale: bool = False
    #: The role whose trajectory it is, in an episode with several roles; None otherwise.
    role: str | None = None

    @property
    def loss_multiplier(self) -> float:
        """0 for a sample without a reward (a failed rollout, or one not verified yet) or a stale one."""
        return 0.0 if self.failure is not None or self.reward is None or self.stale else 1.0

    @property
    def group(self) -> str:
        """The GRPO group: the rollouts of one task through one agent (and, in episodes with several
        roles, one role: each role's rewards are compared among its own)."""
        group = f"{self.agent}/{self.task_index}"
        return group if self.role is None else f"{group}/{self.role}"


@dataclass
class SampleStats:
    """What building samples met."""

    rollouts: int = 0
    #: Failed rollouts, each a masked sample.
    failed: int = 0
    samples: int = 0
    #: Turns that did not extend the previous turn's ids (each began a new sample with `split`).
    non_monotonic_turns: int = 0
    #: Rollouts without token ids (an engine that returns none): no sample.
    without_ids: int = 0
    #: Samples more than `max_lag` versions behind: masked, or left out (`stale="drop"`).
    stale: int = 0

    def line(self) -> str:
        return (
            f"{self.rollouts:,} rollouts -> {self.samples:,} samples ({self.failed:,} failed rollouts masked, "
            f"{self.non_monotonic_turns:,} non-monotonic turns, {self.without_ids:,} rollouts without token ids, "
            f"{self.stale:,} stale samples)"
        )


def _parting(seen: list[int], prompt: list[int]) -> int:
    """Where `prompt` stops beginning with `seen`: the first differing position (or the shorter length)."""
    for i, (a, b) in enumerate(zip(seen, prompt, strict=False)):
        if a != b:
            return i
    return min(len(seen), len(prompt))


def samples_of(
    rollout: TrainingRollout, non_monotonic: NonMonotonicPolicy = "split", stats: SampleStats | None = None
) -> list[Sample]:
    """The samples of one rollout: one, or more where its history is not monotonic (`split`)."""
    stats = stats if stats is not None else SampleStats()
    stats.rollouts += 1
    key = (rollout.agent, rollout.task_index, rollout.repeat_index)
    if rollout.failure is not None:
        stats.failed += 1
        stats.samples += 1
        f = rollout.failure
        return [Sample(*key, part=0, failure=f"{f.error_class} ({f.code}): {f.message}", role=rollout.role)]
    if not rollout.turns:
        stats.without_ids += 1
        return []
    samples: list[Sample] = []
    seen: list[int] = []
    for number, turn in enumerate(rollout.turns):
        if len(turn.generation_log_probs) != len(turn.generation_token_ids):
            raise RowError(
                "generation_log_probs",
                f"rollout {key}: turn {number} has {len(turn.generation_token_ids)} generated ids but "
                f"{len(turn.generation_log_probs)} log-probs",
            )
        current = samples[-1] if samples else None
        if current is not None and turn.prompt_token_ids[: len(seen)] != seen:
            stats.non_monotonic_turns += 1
            if non_monotonic == "refuse":
                raise NonMonotonic(
                    f"rollout {key}: turn {number}'s prompt does not begin with the earlier turns' ids "
                    f"(they part at position {_parting(seen, turn.prompt_token_ids)} of {len(seen)})"
                )
            current = None
        if current is None:
            current = Sample(
                *key,
                part=len(samples),
                prompt_ids=list(turn.prompt_token_ids),
                reward=rollout.reward,
                role=rollout.role,
            )
            samples.append(current)
            seen = list(turn.prompt_token_ids)
        else:
            between = turn.prompt_token_ids[len(seen) :]
            current.response_ids += between
            current.response_mask += [0] * len(between)
            current.response_log_probs += [0.0] * len(between)
            seen += between
        current.response_ids += turn.generation_token_ids
        current.response_mask += [1] * len(turn.generation_token_ids)
        current.response_log_probs += turn.generation_log_probs
        current.num_turns += 1
        if turn.policy_version is not None:
            old = current.policy_version
            current.policy_version = turn.policy_version if old is None else min(old, turn.policy_version)
        seen += turn.generation_token_ids
    stats.samples += len(samples)
    return samples


def build(
    rollouts: Iterable[TrainingRollout],
    non_monotonic: NonMonotonicPolicy = "split",
    *,
    current_version: int | None = None,
    max_lag: int | None = None,
    stale: StalePolicy = "mask",
) -> tuple[list[Sample], SampleStats]:
    """The samples of every rollout, and what building them met.

    With `current_version` (the trainer's policy version now), each sample's `lag` is how many
    versions its oldest turn is behind; with `max_lag` too, a sample further behind is stale:
    masked (`loss_multiplier` 0, kept in its group) or, with `stale="drop"`, left out. A sample
    whose turns carry no version is never stale."""
    stats = SampleStats()
    samples = []
    for rollout in rollouts:
        for sample in samples_of(rollout, non_monotonic, stats):
            if current_version is not None and sample.policy_version is not None:
                sample.lag = current_version - sample.policy_version
                sample.stale = max_lag is not None and sample.lag > max_lag
                if sample.stale:
                    stats.stale += 1
                    if stale == "drop":
                        stats.samples -= 1
                        continue
            samples.append(sample)
    return samples, stats


def read_rollouts(path: Path) -> Iterator[TrainingRollout]:
    """The rollouts of a `collect` output, then its failures sidecar's failed rollouts that no row made good."""
    done: set[record.RolloutKey] = set()
    for row in jsonl.iter_rows(path):
        for rollout in TrainingRollout.per_role(row):
            done.add((rollout.agent, rollout.task_index, rollout.repeat_index))
            yield rollout
    for (agent, task, repeat), error in jsonl.sidecar_failures(path, done).missing.items():
        failure = errors.Failure(
            str(error.get("class")), str(error.get("code")), str(error.get("message")), error.get("field")
        )
        yield TrainingRollout(agent, task, repeat, None, [], failure)
