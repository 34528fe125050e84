"""Ops: the units of work a pipeline schedule orders.

An op names *what* is computed (kind, stage, micro-batch), never *where* or *when*: the rank
and the position in that rank's program are attributes of the op's node in the IR graph. So
two ops compare equal exactly when they are the same work, and an op can be a graph key.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Final, Literal

Kind = Literal["F", "B", "I", "W", "R", "FC", "RC", "OFF", "RELOAD"]

#: Every kind with a time per (stage, micro-batch), in canonical order: forward, full backward,
#: input-grad, weight-grad, then the memory ops: a checkpointed forward FC (keeps only its
#: input), its recompute RC (runs the forward again, keeping the activations, before the
#: backward), and OFF / RELOAD, which move a forward's saved activations to host memory and
#: back. (Recompute is not a bare R: that is the data-parallel gradient all-reduce below.)
KINDS: Final[tuple[Kind, ...]] = ("F", "B", "I", "W", "FC", "RC", "OFF", "RELOAD")

#: The kinds that run a stage's forward (the activation a forward sends is the same).
FORWARDS: Final[frozenset[str]] = frozenset(("F", "FC"))
#: The memory ops: a checkpointed forward and its recompute, an offload and its reload.
MEMORY_KINDS: Final[tuple[Kind, ...]] = ("FC", "RC", "OFF", "RELOAD")

#: The gradient reduction: R(s) all-reduces stage s's weight gradients across the
#: data-parallel replicas (torch's REDUCE_GRAD). It has no micro-batch (`mb` is `NO_MB`).
REDUCE: Final = "R"
NO_MB: Final = -1

#: Kinds that do not occupy the rank's compute but run on a per-rank side channel, one op
#: after another: the channel's name per kind (see `pipeir.sim.engine`).
CHANNEL: Final[dict[str, str]] = {REDUCE: "reduce", "OFF": "copy", "RELOAD": "copy"}

#: Every op kind with the number of arguments it takes in the language: R(s), the others
#: K(s, mb). The frontend recognises ops by these names.
OP_ARITY: Final[dict[str, int]] = {**{k: 2 for k in KINDS}, REDUCE: 1}

#: What each kind means, for messages and legends.
KIND_NAMES: Final[dict[str, str]] = {
    "F": "forward",
    "B": "backward",
    "I": "input-grad",
    "W": "weight-grad",
    "R": "gradient all-reduce",
    "FC": "checkpointed forward",
    "RC": "recompute",
    "OFF": "offload",
    "RELOAD": "reload",
}


@dataclass(frozen=True, slots=True, order=True)
class Op:
    """One op: `kind` of micro-batch `mb` through stage `stage` (for R: all of the stage's
    micro-batches, `mb` = NO_MB)."""

    kind: Kind
    stage: int
    mb: int
    # NOTE: ops are graph keys and get hashed millions of times while building large
    # schedules; caching the hash halves build time (measured by bench/compile_scale.py).
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # (one test on the common path; the checks and their messages are `_checked`'s)
        if type(self.stage) is not int or type(self.mb) is not int or \
                self.kind not in OP_ARITY or (self.kind == REDUCE and self.mb != NO_MB):
            self._checked()
        # (the low 30 bits: an int object of 28 bytes, not 36, which the allocator rounds
        # to 48; a large schedule keeps one per op)
        object.__setattr__(self, "_hash", hash((self.kind, self.stage, self.mb)) & 0x3FFFFFFF)

    def _checked(self) -> None:
        """Refuse an op that is no op here, when it is made: an op kind the language does
        not have, a stage or micro-batch that is not an integer, or an R with a micro-batch
        went through `verify` and failed later, far from the mistake (a micro-batch out of
        range is verify's to report, at its span). Integers of other types (numpy's) become
        ints."""
        if self.kind not in OP_ARITY:
            raise ValueError(f"unknown op kind {self.kind!r}; the kinds are "
                             f"{', '.join(OP_ARITY)}")
        for name in ("stage", "mb"):
            value = getattr(self, name)
            if type(value) is not int:
                try:
                    if isinstance(value, bool):
                        raise TypeError
                    object.__setattr__(self, name, operator.index(value))
                except TypeError:
                    raise TypeError(f"{self.kind} op: the {'micro-batch' if name == 'mb' else name}"
                                    f" must be an integer, got {type(value).__name__} "
                                    f"{value!r}") from None
        if self.kind == REDUCE and self.mb != NO_MB:
            raise ValueError(f"R({self.stage}) reduces every micro-batch of its stage: its mb "
                             f"is NO_MB ({NO_MB}), not {self.mb} (make it with pipeir.R(stage))")

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Op], tuple[Kind, int, int]]:
        # NOTE: a str's hash differs from process to process (hash randomisation), so the
        # cached hash must not travel: an op unpickled in a spawned rank, or from a file,
        # would compare equal to its twin there and miss it in every dict and set.
        return (Op, (self.kind, self.stage, self.mb))

    def __str__(self) -> str:
        if self.kind == REDUCE:
            return f"R({self.stage})"
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


def R(stage: int) -> Op:
    """The all-reduce of stage `stage`'s weight gradients across data-parallel replicas."""
    return Op("R", stage, NO_MB)


def FC(stage: int, mb: int) -> Op:
    """A checkpointed forward: keeps only its input; its RC runs it again before the backward."""
    return Op("FC", stage, mb)


def RC(stage: int, mb: int) -> Op:
    """The recompute of a checkpointed forward FC(stage, mb), before its backward."""
    return Op("RC", stage, mb)


def OFF(stage: int, mb: int) -> Op:
    """Offload F(stage, mb)'s saved activations to host memory (on the rank's copy channel)."""
    return Op("OFF", stage, mb)


def RELOAD(stage: int, mb: int) -> Op:
    """Bring OFF(stage, mb)'s activations back to the device before the backward."""
    return Op("RELOAD", stage, mb)
