"""GRPO groups: the rollouts of one task through one agent, and each sample's advantage.

A sample's advantage is its rollout's reward less the mean reward of the
group's rollouts that finished, divided by their standard deviation (GRPO;
`scale="none"` leaves the division out, as Dr. GRPO does). A failed rollout
is in its group as a masked member: it counts in no mean and gets advantage
0 with `loss_multiplier` 0. The samples a non-monotonic history split a
rollout into share that rollout's advantage. A group whose finished rollouts
all have the same reward teaches nothing: every advantage in it is 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from gym_grpc.training.samples import Sample

Scale = Literal["std", "none"]


@dataclass(frozen=True)
class GroupStats:
    """One group: its finished rollouts' rewards' mean and spread, and its failed members."""

    group: str
    rollouts: int
    failed: int
    mean: float
    std: float


def assign_advantages(samples: Sequence[Sample], scale: Scale = "std", epsilon: float = 1e-6) -> list[GroupStats]:
    """Set `advantage` on every sample, per group; the groups' statistics, in first-seen order."""
    members: dict[str, dict[int | None, float | None]] = {}  # group -> repeat -> reward (None: failed)
    for sample in samples:
        members.setdefault(sample.group, {})[sample.repeat_index] = sample.reward
    stats: dict[str, GroupStats] = {}
    for group, rewards in members.items():
        finished = [reward for reward in rewards.values() if reward is not None]
        mean = sum(finished) / len(finished) if finished else math.nan
        std = math.sqrt(sum((x - mean) ** 2 for x in finished) / len(finished)) if finished else math.nan
        stats[group] = GroupStats(group, len(rewards), len(rewards) - len(finished), mean, std)
    for sample in samples:
        of = stats[sample.group]
        if sample.reward is None or sample.failure is not None:
            sample.advantage = 0.0
            continue
        centred = sample.reward - of.mean
        sample.advantage = centred / (of.std + epsilon) if scale == "std" else centred
    return list(stats.values())
