"""Ops: the units of work a pipeline schedule orders.

An op names *what* is computed (kind, stage, micro-batch), never *where* or *when*: the rank
and the position in that rank's program are attributes of the op's node in the IR graph. So
two ops compare equal exactly when they are the same work, and an op can be a graph key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

Kind = Literal["F", "B", "I", "W"]

#: Every op kind, in canonical order: forward, full backward, input-grad, weight-grad.
KINDS: Final[tuple[Kind, ...]] = ("F", "B", "I", "W")

#: What each kind means, for messages and legends.
KIND_NAMES: Final[dict[str, str]] = {
    "F": "forward",
    "B": "backward",
    "I": "input-grad",
    "W": "weight-grad",
}


@dataclass(frozen=True, slots=True, order=True)
class Op:
    """One compute op: `kind` of micro-batch `mb` through stage `stage`."""

    kind: Kind
    stage: int
    mb: int
    # NOTE: ops are graph keys and get hashed millions of times while building large
    # schedules; caching the hash halves build time (measured by bench/compile_scale.py).
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.kind, self.stage, self.mb)))

    def __hash__(self) -> int:
        return self._hash

    def __str__(self) -> str:
        return f"{self.kind}({self.stage},{self.mb})"


def F(stage: int, mb: int) -> Op:
    """The forward of micro-batch `mb` through stage `stage`."""
    return Op("F", stage, mb)


def B(stage: int, mb: int) -> Op:
    """The full backward (input and weight gradients together)."""
    return Op("B", stage, mb)


def I(stage: int, mb: int) -> Op:  # noqa: E743 - the paper's name for the op
    """The input-gradient half of a backward (zero-bubble schedules)."""
    return Op("I", stage, mb)


def W(stage: int, mb: int) -> Op:
    """The weight-gradient half of a backward (zero-bubble schedules)."""
    return Op("W", stage, mb)
