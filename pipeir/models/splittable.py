"""A model that can be cut at named points: the seam between bringing an `nn.Module`
(`pipeir.split`, which cuts a user's module) and planning where to cut it (`pipeirc plan`,
which profiles every candidate piece and chooses the cut points with the schedule).

NOTE (why points, not stage numbers): a plan is written once and run many times, often with
another rank count or schedule; the names of the modules where stages begin (torchtitan's split
points, torch's `SplitPoint.BEGINNING`) stay meaningful across all of them, where "layers 3 to
5" does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from pipeir.models.spec import ModelSpec


@runtime_checkable
class Splittable(Protocol):
    """A model with candidate cut points, in model order."""

    def split_points(self) -> Sequence[str]:
        """The names where a stage may begin, in the order the model runs them (the first
        stage always begins at the model's start, which is not listed)."""
        ...

    def at(self, points: Sequence[str]) -> ModelSpec:
        """The model cut into `len(points) + 1` stages, stage k (k >= 1) beginning at
        `points[k - 1]`; `points` is a subsequence of `split_points()` (UsageError otherwise).
        Each stage keeps the original parameter names, and stage s's initial weights are the
        unsplit model's."""
        ...
