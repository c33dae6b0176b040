"""Aggregate metrics over rollouts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any


class Means:
    """Running mean of every numeric (or boolean) top-level field of the rows added."""

    def __init__(self) -> None:
        self.count = 0
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._min: dict[str, float] = {}
        self._max: dict[str, float] = {}

    def add(self, row: Mapping[str, Any]) -> None:
        self.count += 1
        for key, value in row.items():
            if isinstance(value, (bool, int, float)):
                value = float(value)
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
