"""The one unit of a counted memory budget, shared by `check`, `simulate`, `tune`, `synth`,
`opt` and the passes, so that whatever synth or tune writes passes `check` with the same flag.

A counted budget is in *activations*: one per forward of one stage (a chunk, when a rank holds
V of them) and micro-batch, held until its backward (its W, when split) frees it. Where the
costs say what W still needs after I (`memory_w_bytes`, `pipeir.memmodel`), an I frees the
rest, so an activation waiting only for its W counts as `memory_w_bytes / memory_bytes` of
one and a count may be fractional (ZB-H1's rank 1 of 4 holds 3 + that fraction). This is what
a schedule states on its own (the `.sched` file's `memory_limit`, the verifier's peak), with
no assumption about how big a stage's activation is: chunks of uneven stages differ in size,
and so do micro-batches of another count. 1F1B on P ranks holds P; the same bytes cut into V
chunks per rank are P x V activations. To compare memory across V or micro-batch counts, give
bytes (`--memory-limit 8GB` to `check`, `--memory-bytes` to `synth`), which the cost file's
activation sizes make exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

#: How the unit counts, as messages say it.
COUNTING: Final = "one per stage, or chunk, and micro-batch"

#: The unit of a limit, as messages name it.
UNIT: Final = f"activations per rank, counting {COUNTING}"

#: The `--memory-limit K` help text every command shares (a command adds its default).
HELP: Final = ("most activations a rank may hold at once, counted as `check` counts them: one "
               "per forward of a stage (a chunk, with V per rank) and micro-batch until its "
               "backward frees it; 1F1B holds P, and the same memory in V chunks is P x V")

#: What a command that counts with the costs' split adds to `HELP`.
SPLIT_HELP: Final = ("with memory_w_bytes in the costs, I frees the rest and what W keeps counts "
                     "as memory_w_bytes / memory_bytes of one, so K may be fractional")

#: A budget of 1F1B's memory at every shape: P x V activations with V chunks per rank.
ONE_F_ONE_B: Final = "1f1b"

Budget = float | Literal["1f1b"] | None


def limit_for(budget: Budget, ranks: int, v: int) -> float | None:
    """The counted limit of `budget` for `ranks` ranks of `v` chunks each (None: no limit)."""
    if budget == ONE_F_ONE_B:
        return float(ranks * v)
    return budget


def describe(budget: Budget) -> str:
    """`budget` as the `--memory-limit` flag that asks for it."""
    if budget is None:
        return "no memory limit"
    if budget == ONE_F_ONE_B:
        return "--memory-limit P x V (1F1B's memory)"
    return f"--memory-limit {budget:g}"


@dataclass(frozen=True)
class MemoryLimit:
    """A budget per rank as a user gives it (`--memory-limit`, `plan --memory`): activations
    counted in this module's unit (fractional where W keeps part of an activation after I),
    or bytes (`in_bytes`)."""

    value: float
    in_bytes: bool
    text: str = field(default="", compare=False)  # as given on the command line

    @property
    def count(self) -> float | None:
        return None if self.in_bytes else self.value

    @property
    def bytes(self) -> float | None:
        return self.value if self.in_bytes else None

    def __str__(self) -> str:
        return self.text or (f"{self.value:g}B" if self.in_bytes else f"{self.value:g}")
