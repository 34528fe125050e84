"""What each op adds to, or frees from, its rank's memory: the one rule that the verifier, the
simulator, the plots, tune, the memory passes and the runtime's prediction all ask.

A stage's memory is a `StageMemory`: `saved`, what its forward keeps for the backward;
`kept_for_w`, the part of that which the weight gradient W still needs after the input
gradient I (the Zero Bubble paper's M_W; I frees the rest, its M_B); and `input`, what a
checkpointed forward FC keeps instead. In bytes it comes from a cost model
(`memory_bytes`, `memory_w_bytes`, `input_bytes`); counted, one forward is one activation,
of which the fraction `memory_w_bytes / memory_bytes` stays for W (`pipeir.memunit`).

The rule, per op of (stage s, micro-batch m):

==========  =================================================================================
F, RC       add `saved` (RC runs the forward of an FC again, under autograd)
RELOAD      adds `saved` back; OFF takes it away (it is in host memory until its RELOAD)
FC          adds `input`
B           frees `saved` (a whole backward: input and weight gradients at once)
I           frees `saved - kept_for_w`
W           frees `kept_for_w`
B, W        also free the `input` of an FC (the last backward of a checkpointed forward)
==========  =================================================================================

So a schedule with split backwards but no split given (`kept_for_w == saved`, what an old
cost file means) holds everything until W, and one with whole backwards frees everything at
B whatever the split.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from pipeir.ops import Op


@dataclass(frozen=True, slots=True)
class StageMemory:
    """One stage's memory per micro-batch (bytes, or activations when counted)."""

    saved: float  # what a forward keeps until its backward
    kept_for_w: float  # of `saved`, what W still needs after I (I frees the rest)
    input: float = 0.0  # what a checkpointed forward FC keeps instead

    def __post_init__(self) -> None:
        if not 0 <= self.kept_for_w <= self.saved or self.input < 0:
            raise ValueError(f"a stage's memory needs 0 <= kept_for_w <= saved and input >= 0, "
                             f"got {self}")

    @property
    def freed_by_i(self) -> float:
        """What the input gradient I frees (the paper's M_B)."""
        return self.saved - self.kept_for_w

    def change(self, kind: str, checkpointed: bool = False) -> float:
        """What an op of `kind` adds to memory (negative: frees), `checkpointed` when the
        (stage, micro-batch)'s forward was an FC. See the module's table."""
        if kind == "F" or kind == "RC" or kind == "RELOAD":
            return self.saved
        if kind == "OFF":
            return -self.saved
        if kind == "FC":
            return self.input
        if kind == "I":
            return -self.freed_by_i
        if kind == "B":
            return -self.saved - (self.input if checkpointed else 0.0)
        if kind == "W":
            return -self.kept_for_w - (self.input if checkpointed else 0.0)
        return 0.0


#: One counted activation held whole until its last backward (no split known).
WHOLE = StageMemory(1.0, 1.0)


def live_memory(program: Iterable[Op], memory: Callable[[Op], StageMemory]
                ) -> Iterator[tuple[Op, float]]:
    """(op, memory held after it) along a rank's program, each op's change by `memory(op)`
    (its stage's memory) and `StageMemory.change`."""
    live = 0.0
    checkpointed: set[tuple[int, int]] = set()
    for op in program:
        k = op.kind
        if k in _CHANGING:
            if k == "FC":
                checkpointed.add((op.stage, op.mb))
            last = checkpointed and (k == "B" or k == "W") and (op.stage, op.mb) in checkpointed
            live += memory(op).change(k, bool(last))
        yield op, live


_CHANGING = frozenset(("F", "RC", "RELOAD", "OFF", "FC", "I", "B", "W"))
