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

from pipeir.diagnostics import UsageError, did_you_mean
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


def check_points(available: Sequence[str], points: Sequence[str]) -> list[int]:
    """The positions of `points` in `available` (a model's `split_points()`); a UsageError
    unless they are distinct known points in model order."""
    index = {p: i for i, p in enumerate(available)}
    out: list[int] = []
    for p in points:
        if p not in index:
            raise UsageError(f"split point '{p}' is not one of the model's "
                             f"({_shown(available)})", notes=did_you_mean(p, available))
        if out and index[p] <= out[-1]:
            where = ("twice" if index[p] == out[-1]
                     else f"before '{available[out[-1]]}' in the model")
            raise UsageError(f"split point '{p}' comes {where}; give the points once each, "
                             "in model order")
        out.append(index[p])
    return out


def uniform_points(available: Sequence[str], stages: int) -> list[str]:
    """The split a user guesses without measuring (`s * L // P`): the first and last pieces
    (embedding, head) stay on the first and last stage and the pieces between are shared out
    evenly by count; with fewer middle pieces than stages, all pieces are."""
    pieces = len(available) + 1
    if not 1 <= stages <= pieces:
        raise UsageError(f"cannot cut a model of {pieces} pieces into {stages} stages")
    middle = pieces - 2
    if middle >= stages:
        starts = [1 + s * middle // stages for s in range(1, stages)]
    else:
        starts = [s * pieces // stages for s in range(1, stages)]
    return [available[k - 1] for k in starts]


def _shown(names: Sequence[str], most: int = 6) -> str:
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")
