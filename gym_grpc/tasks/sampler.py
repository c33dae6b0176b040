"""Which task to roll out next: datasets with weights, difficulty pools, a cap per task.

A task's pool follows its recent outcomes (the last `history` finished rollouts): passed at least
`easy_at` of the time, easy; at most `hard_at`, hard; in between, or not seen yet, learning. A draw
picks a pool by `proportions` among the pools that have a task to give, then a dataset by weight
among those with tasks in that pool, then one of its tasks uniformly. A drawn task is held (out of
every pool) until `release`, so that a batch's groups are distinct tasks and a task is not rolled
out by two batches at once; it goes back to the pool its outcomes then say, unless it reached
`max_groups` (then it is retired).

Pure bookkeeping, no I/O: the task server (tasks/server.py) owns one and feeds it each group's rewards.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from gym_grpc.v1 import task_service_pb2 as tasks_pb

Pool: TypeAlias = tasks_pb.TaskPool.ValueType
EASY: Pool = tasks_pb.TASK_POOL_EASY
LEARNING: Pool = tasks_pb.TASK_POOL_LEARNING
HARD: Pool = tasks_pb.TASK_POOL_HARD
POOLS = (EASY, LEARNING, HARD)
POOL_NAMES = {EASY: "easy", LEARNING: "learning", HARD: "hard"}


@dataclass
class TaskRecord:
    """What is known of one task."""

    dataset: int
    index: int
    #: Rewards of its last finished rollouts, newest last.
    recent: deque[float]
    #: Groups of it rolled out.
    groups: int = 0
    #: Passes among `recent` (kept with it, not recounted).
    passes: int = 0

    @property
    def pass_rate(self) -> float:
        return self.passes / len(self.recent) if self.recent else 0.0


class _Bag:
    """A set with O(1) add, remove and uniform choice."""

    def __init__(self) -> None:
        self._items: list[int] = []
        self._where: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: int) -> None:
        if item not in self._where:
            self._where[item] = len(self._items)
            self._items.append(item)

    def remove(self, item: int) -> None:
        at = self._where.pop(item)
        last = self._items.pop()
        if at < len(self._items):
            self._items[at] = last
            self._where[last] = at

    def choice(self, rng: random.Random) -> int:
        return self._items[rng.randrange(len(self._items))]


@dataclass(frozen=True)
class PoolRule:
    """How outcomes make pools, and how often each pool is drawn from."""

    #: A pass is a reward at or above this.
    pass_threshold: float = 1.0
    #: Pass rate at or above which a task is easy.
    easy_at: float = 1.0
    #: Pass rate at or below which a task is hard.
    hard_at: float = 0.0
    #: Share of draws from each pool (renormalised over the pools that have a task to give).
    proportions: dict[Pool, float] = field(default_factory=lambda: {EASY: 0.05, LEARNING: 0.9, HARD: 0.05})
    #: Finished rollouts remembered per task.
    history: int = 16
    #: Pools at all; without, every task stays in the learning pool and draws are uniform.
    pools: bool = True

    def pool(self, record: TaskRecord) -> Pool:
        if not record.recent or not self.pools:
            return LEARNING
        rate = record.pass_rate
        if rate >= self.easy_at:
            return EASY
        if rate <= self.hard_at:
            return HARD
        return LEARNING


class TaskSampler:
    """Draws tasks from `sizes[i]` tasks of dataset i, weighted by `weights[i]` (see the module's doc)."""

    def __init__(
        self,
        sizes: Sequence[int],
        weights: Sequence[float],
        rule: PoolRule | None = None,
        *,
        max_groups: int | None = None,
        seed: int | None = None,
    ) -> None:
        if len(sizes) != len(weights):
            raise ValueError("one weight per dataset")
        self.rule = rule or PoolRule()
        self.weights = list(weights)
        self.max_groups = max_groups
        self._rng = random.Random(seed)
        self._records: list[list[TaskRecord | None]] = [[None] * size for size in sizes]
        #: The drawable tasks of each dataset in each pool.
        self._bags: dict[Pool, list[_Bag]] = {pool: [_Bag() for _ in sizes] for pool in POOLS}
        for dataset, size in enumerate(sizes):
            learning = self._bags[LEARNING][dataset]
            for index in range(size):
                learning.add(index)
        self._held: set[tuple[int, int]] = set()
        self.retired = 0

    def record(self, dataset: int, index: int) -> TaskRecord:
        found = self._records[dataset][index]
        if found is None:
            found = self._records[dataset][index] = TaskRecord(dataset, index, deque(maxlen=self.rule.history))
        return found

    def seen(self) -> list[TaskRecord]:
        """Every task served at least once."""
        return [record for per_dataset in self._records for record in per_dataset if record is not None]

    def pool_of(self, dataset: int, index: int) -> Pool:
        found = self._records[dataset][index]
        return LEARNING if found is None else self.rule.pool(found)

    def pool_sizes(self) -> dict[Pool, int]:
        """Drawable tasks in each pool (held and retired ones left out)."""
        return {pool: sum(len(bag) for bag in bags) for pool, bags in self._bags.items()}

    def draw(self) -> tuple[int, int, Pool] | None:
        """(dataset, index, pool) of a task to roll out, now held; None when no pool with a share has one."""
        sizes = self.pool_sizes()
        pools = [p for p in POOLS if sizes[p] and self.rule.proportions.get(p, 0.0) > 0]
        if not pools:
            return None
        pool = self._rng.choices(pools, [self.rule.proportions[p] for p in pools])[0]
        bags = self._bags[pool]
        datasets = [d for d, bag in enumerate(bags) if len(bag) and self.weights[d] > 0]
        if not datasets:
            return None
        dataset = self._rng.choices(datasets, [self.weights[d] for d in datasets])[0]
        index = bags[dataset].choice(self._rng)
        bags[dataset].remove(index)
        self._held.add((dataset, index))
        self.record(dataset, index).groups += 1
        return dataset, index, pool

    def observe(self, dataset: int, index: int, rewards: Sequence[float]) -> None:
        """The rewards of a group of a held task's finished rollouts."""
        record = self.record(dataset, index)
        for reward in rewards:
            if len(record.recent) == record.recent.maxlen and record.recent[0] >= self.rule.pass_threshold:
                record.passes -= 1
            record.recent.append(reward)
            record.passes += reward >= self.rule.pass_threshold

    def release(self, dataset: int, index: int) -> None:
        """Put a held task back in the pool its outcomes say, or retire it at its cap."""
        self._held.discard((dataset, index))
        record = self.record(dataset, index)
        if self.max_groups is not None and record.groups >= self.max_groups:
            self.retired += 1
            return
        self._bags[self.rule.pool(record)][dataset].add(index)
