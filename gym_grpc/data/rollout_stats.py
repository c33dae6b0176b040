"""The statistics of a rollouts file, in one place: every mean, pass@k, mean@k, stage name and stage
time quantile that `collect`'s end-of-run summary (batch/summary.py), `gym-grpc report` (report/), its
W&B and MLflow exporters and an environment's default `aggregate_metrics` give comes from here, so the
same file gives the same number whichever command reads it.

How a rollout counts
--------------------
A row is *verified* when its `reward` is a finite number (not a boolean) and the row is not marked
`verification_skipped` (`verified_reward`). Any other row is *unverified*: written by
`collect --skip-verify` and not re-verified yet, or with no usable reward. A *failed* rollout is a
record of the failures sidecar (`<stem>.failures.jsonl`) whose key no row of the file holds: it never
completed, so it has no reward at all.

- The reward mean (and the mean of every other numeric field a rollout produced) is over the
  verified rollouts, one rollout one weight.
- pass@k, per task: of its n verified rollouts, c passed (reward at least the pass threshold); its
  pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, "Evaluating Large
  Language Models Trained on Code"), the chance that at least one of k rollouts drawn from those n
  without replacement passed. A file's pass@k is the mean over the tasks with n >= k; a task with
  fewer verified rollouts says nothing about k draws and is left out of pass@k (not counted as a
  fail). pass@1 is then each task's pass rate, averaged over the tasks with a verified rollout.
- mean@k, per task: the expected mean reward of k rollouts drawn from its n, which is its mean
  reward; a file's mean@k is the mean over the same tasks as pass@k (n >= k).
- Unverified and failed rollouts are counted and shown beside these numbers (`unverified`,
  `failed`), never folded into them: not as a reward of 0, and not by dropping the task that lost
  one.

Why this way: a failure (a deadline, an engine that went away, a full session pool) is the
infrastructure's, not an answer of the policy. Counting it as a 0 makes pass@k move with the load on
the machine; dropping every task that lost a rollout (what `collect`'s summary did before) throws away
that task's verified rollouts and makes pass@1 depend on which tasks a failure happened to hit. Over
the rollouts that completed is also what NeMo Gym's pass@k gives on the rows of a file
(tests/test_nemo_interop.py checks it against NeMo Gym's own code), and what verifiers' eval shows as
its reward (the mean over the rollouts that did not error, their share beside it), so the numbers
compare. The price: failures that fall on the hard tasks (the model rambles until the deadline)
flatter the numbers, which is why the count of failures stands beside every pass@k and `report`
names them by class and code.

Memory: `collect` summarises the output of a million rollouts in flat memory, so a task's state is
four numbers in arrays indexed by a task slot (`TaskScores`: n, c, the sum of its rewards and their
squared deviations, 24 bytes), stage times go to fixed histograms past 4,096 values (`Quantiles`), and
means are running sums (`Means`). Only `report` keeps every verified reward (its histogram).
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

#: The stages a rollout's time splits into, as a row's `timings` names them.
STAGES = ("model", "tools", "verify")
#: What a row's `timings` holds: the stages, and the whole rollout.
TIMINGS = (*STAGES, "total")


def finite(value: Any) -> float | None:
    """A finite JSON number (not a boolean) as a float, else None."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def verified_reward(row: Mapping[str, Any]) -> float | None:
    """The reward of a verified rollout row; None for an unverified one (see the module's docstring)."""
    if row.get("verification_skipped"):
        return None
    return finite(row.get("reward"))


def pass_at_k(n: int, c: int, k: int) -> float:
    """The chance that at least one of k rollouts drawn without replacement from n, c of which
    passed, passed: 1 - C(n-c, k) / C(n, k). Needs 1 <= k <= n and 0 <= c <= n."""
    if not (1 <= k <= n and 0 <= c <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class AtK(NamedTuple):
    """pass@k and mean@k of a set of tasks, and how many tasks (those with at least k verified rollouts)
    they are over; nan when there are none."""

    tasks: int
    pass_at: float
    mean_at: float


class TaskSummary(NamedTuple):
    """One task's verified rollouts."""

    rollouts: int
    passed: int
    mean: float
    #: Population standard deviation: the spread a GRPO group's advantages are scaled by.
    std: float
    #: "always", "never" or "mixed" passed, for a task with at least two verified rollouts; else None.
    kind: str | None


class TaskScores:
    """The verified rewards of many tasks, per task slot (an index the caller gives each task): how
    many (n), how many passed (c, reward >= `threshold`), their sum and their sum of squared
    deviations (Welford's, for the spread). 24 bytes a slot, whatever the number of rollouts."""

    def __init__(self, threshold: float, size: int = 0) -> None:
        self.threshold = threshold
        self._n = array("I", bytes(4 * size))
        self._c = array("I", bytes(4 * size))
        self._sum = array("d", bytes(8 * size))
        self._m2 = array("d", bytes(8 * size))

    def __len__(self) -> int:
        return len(self._n)

    def new_slot(self) -> int:
        """A slot for one more task; its index."""
        for values in (self._n, self._c, self._sum, self._m2):
            values.append(0)
        return len(self._n) - 1

    def add(self, slot: int, reward: float) -> None:
        """A verified rollout of the task in `slot`."""
        n = self._n[slot]
        before = self._sum[slot] / n if n else 0.0
        self._n[slot] = n + 1
        self._sum[slot] += reward
        self._m2[slot] += (reward - before) * (reward - self._sum[slot] / (n + 1))
        if reward >= self.threshold:
            self._c[slot] += 1

    def task(self, slot: int) -> TaskSummary:
        n, c = self._n[slot], self._c[slot]
        if not n:
            return TaskSummary(0, 0, math.nan, math.nan, None)
        kind = None if n < 2 else "always" if c == n else "never" if not c else "mixed"
        return TaskSummary(n, c, self._sum[slot] / n, math.sqrt(max(self._m2[slot], 0.0) / n), kind)

    def _slots(self, slots: Iterable[int] | None) -> Iterable[int]:
        return range(len(self._n)) if slots is None else slots

    def at_k(self, ks: Sequence[int], slots: Iterable[int] | None = None) -> dict[int, AtK]:
        """pass@k and mean@k for each k of `ks`, over the tasks of `slots` (all by default) with at least
        k verified rollouts, in one pass over them."""
        tasks = dict.fromkeys(ks, 0)
        passes = dict.fromkeys(ks, 0.0)
        means = dict.fromkeys(ks, 0.0)
        for slot in self._slots(slots):
            n = self._n[slot]
            if not n:
                continue
            c, mean = self._c[slot], self._sum[slot] / n
            for k in ks:
                if n >= k:
                    tasks[k] += 1
                    passes[k] += pass_at_k(n, c, k)
                    means[k] += mean
        return {
            k: AtK(tasks[k], passes[k] / tasks[k], means[k] / tasks[k]) if tasks[k] else AtK(0, math.nan, math.nan)
            for k in ks
        }

    def pass_curve(self, slots: Sequence[int] | None = None) -> dict[int, float]:
        """pass@k for k = 1 up to the most verified rollouts a task has, each over the tasks with >= k."""
        top = max((self._n[slot] for slot in self._slots(slots)), default=0)
        return {k: at.pass_at for k, at in self.at_k(range(1, top + 1), slots).items()}

    def kinds(self, slots: Iterable[int] | None = None) -> Counter[str]:
        """How many tasks (of those with >= 2 verified rollouts) always, never or sometimes passed."""
        return Counter(kind for slot in self._slots(slots) if (kind := self.task(slot).kind) is not None)


class Means:
    """Running mean of every numeric (or boolean) top-level field of the rows added, with its
    smallest and largest value."""

    def __init__(self) -> None:
        self.count = 0
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._min: dict[str, float] = {}
        self._max: dict[str, float] = {}

    def add(self, row: Mapping[str, Any]) -> None:
        self.count += 1
        for key, value in row.items():
            if isinstance(value, bool | int | float):
                self._number(key, float(value))

    def add_number(self, key: str, value: float) -> None:
        """A row with the one field `key`."""
        self.count += 1
        self._number(key, value)

    def _number(self, key: str, value: float) -> None:
        self._sums[key] = self._sums.get(key, 0.0) + value
        self._counts[key] = self._counts.get(key, 0) + 1
        self._min[key] = min(self._min.get(key, value), value)
        self._max[key] = max(self._max.get(key, value), value)

    def min(self, key: str) -> float | None:
        """Smallest value of one field, None before any row had it."""
        return self._min.get(key)

    def max(self, key: str) -> float | None:
        """Largest value of one field, None before any row had it."""
        return self._max.get(key)

    def mean(self, key: str) -> float | None:
        """Mean of one field, None before any row had it."""
        n = self._counts.get(key)
        return self._sums[key] / n if n else None

    def means(self) -> dict[str, float]:
        """Mean of every field, over the rows that had it, sorted by name."""
        return {key: self._sums[key] / self._counts[key] for key in sorted(self._sums)}


def numeric_means(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Mean of every numeric (or boolean) top-level field, over the rows that have it."""
    means = Means()
    for row in rows:
        means.add(row)
    return means.means()


def spread(values: Sequence[float], mean: float) -> float:
    """Population standard deviation of `values` about their `mean`; nan when there are none."""
    if not values:
        return math.nan
    return math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))


class Quantiles:
    """Quantiles of non-negative numbers (seconds), exact up to `EXACT` values, then to within
    half a bucket (0.5%) in constant memory.

    The first `EXACT` values are kept as they are. Past that, every value goes to a bucket
    [LOW * RATIO**(i - 1), LOW * RATIO**i), and a quantile is the middle of its bucket, clamped
    to the smallest and largest value seen. Values up to LOW (zero among them) share bucket 0,
    values above the top the last one: 4,000 buckets from 1 ns reach ~2e8 s. At most ~64 KB
    however many values are added."""

    EXACT = 4096
    LOW = 1e-9
    RATIO = 1.01
    BUCKETS = 4000

    def __init__(self) -> None:
        self.count = 0
        self.low = math.inf
        self.high = -math.inf
        self._exact: array | None = array("d")
        self._buckets = array("Q", bytes(8 * self.BUCKETS))

    def add(self, value: float) -> None:
        self.count += 1
        if value < self.low:
            self.low = value
        if value > self.high:
            self.high = value
        if self._exact is None:
            self._bucket(value)
        elif len(self._exact) < self.EXACT:
            self._exact.append(value)
        else:
            for kept in self._exact:
                self._bucket(kept)
            self._bucket(value)
            self._exact = None

    def _bucket(self, value: float) -> None:
        i = math.ceil((math.log(value) - _LOG_LOW) * _PER_LOG_RATIO) if value > self.LOW else 0
        self._buckets[i if i < self.BUCKETS else self.BUCKETS - 1] += 1

    def __len__(self) -> int:
        return self.count

    def median(self) -> float:
        """The median (the mean of the two middle values of an even count while exact)."""
        if self._exact is not None and self._exact:
            return statistics.median(self._exact)
        return self.quantile(0.5)

    def quantile(self, q: float) -> float:
        """The value of rank ceil(q * count) (1-based, at least 1); nan when empty."""
        if not self.count:
            return math.nan
        rank = max(1, math.ceil(q * self.count))
        if self._exact is not None:
            return sorted(self._exact)[min(rank, self.count) - 1]
        if rank == 1 or rank >= self.count:
            return self.low if rank == 1 else self.high
        i = seen = 0
        while seen + self._buckets[i] < rank:
            seen += self._buckets[i]
            i += 1
        middle = self.LOW * self.RATIO ** (i - 0.5) if i else 0.0
        return min(max(middle, self.low), self.high)


_LOG_LOW = math.log(Quantiles.LOW)
_PER_LOG_RATIO = 1 / math.log(Quantiles.RATIO)
