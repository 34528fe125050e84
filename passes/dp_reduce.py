"""dp-reduce: data parallelism's gradient all-reduces, placed in the schedule.

With the pipeline replicated D times, every stage's weight gradients are all-reduced across
the replicas before the optimizer step. This pass inserts one R(s) per stage (torch's
REDUCE_GRAD) on the rank that owns stage s:

* ``at=last`` (default): right after the last op that produces stage s's weight gradients
  (its last B or W in program order; after the whole pair when that op is half of an
  overlapped pair). The reduction then runs on the rank's reduction channel while the rank
  goes on with the rest of its backward work, as DDP's bucketed all-reduce overlaps backward.
* ``at=end``: every reduction at the end of its rank's program (earliest-finished stage
  first): nothing overlaps, the baseline the placement is measured against.

Existing R ops are removed first, so the pass can run again after passes that move W ops.
Run it after the passes that reorder backwards (`split-backward,dp-reduce`); the reductions'
cost (`dp`, `param_bytes`, `dp_latency`, `dp_bandwidth` in the costs) is the simulator's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pipeir.diagnostics import UsageError
from pipeir.ops import NO_MB, REDUCE, Op
from pipeir.passes.base import OptionError, Pass
from pipeir.passes.context import DEFAULT_CONTEXT, PassContext
from pipeir.schedule import Schedule

At = Literal["last", "end"]


@dataclass(frozen=True)
class DpReduce(Pass):
    """Insert one gradient all-reduce R(s) per stage."""

    name: ClassVar[str] = "dp-reduce"
    summary: ClassVar[str] = ("data parallelism: one gradient all-reduce R(s) per stage, right "
                              "after its last weight gradient (at=last) or at the end (at=end)")

    at: At = "last"

    def __post_init__(self) -> None:
        if self.at not in ("last", "end"):
            raise OptionError("at", f"dp-reduce: at must be last or end, got {self.at!r}")

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        return schedule.with_programs([self._rank(schedule, prog)
                                       for prog in schedule.programs])

    def _rank(self, schedule: Schedule, prog: tuple[Op, ...]) -> list[Op]:
        ops = [op for op in prog if op.kind != REDUCE]
        last: dict[int, int] = {}  # stage -> index of its last weight-gradient op
        for i, op in enumerate(ops):
            if op.kind in ("B", "W"):
                partner = schedule.pair_next(op)
                last[op.stage] = i + 1 if partner is not None else i
        after: dict[int, list[Op]] = {}
        for stage, i in sorted(last.items(), key=lambda kv: kv[1]):
            at = i if self.at == "last" else len(ops) - 1
            after.setdefault(at, []).append(Op(REDUCE, stage, NO_MB))
        out: list[Op] = []
        for i, op in enumerate(ops):
            out.append(op)
            out.extend(after.get(i, ()))
        return out


def reject_reductions(schedule: Schedule, pass_name: str) -> None:
    """For passes that rebuild backwards: a UsageError when `schedule` already has R ops
    (their place depends on where the weight gradients end up)."""
    if any(op.kind == REDUCE for op in schedule):
        raise UsageError(f"{pass_name}: the input has gradient reductions (R ops), whose place "
                         "depends on the backwards this pass moves; run dp-reduce after it: "
                         f"'{pass_name},dp-reduce'")
