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

    def add(self, row: Mapping[str, Any]) -> None:
        self.count += 1
        for key, value in row.items():
            if isinstance(value, (bool, int, float)):
                self._sums[key] = self._sums.get(key, 0.0) + float(value)
                self._counts[key] = self._counts.get(key, 0) + 1

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
