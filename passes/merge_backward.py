"""merge-backward: the inverse of split-backward, for backends or tools that want one B.

Every I(s, mb) / W(s, mb) pair on a rank becomes B(s, mb) at the I's place. That is always
safe, adjacent or not: a W needs only its own I, which runs earlier on the same rank, and
nothing waits for a W, so running the weight gradient together with the input gradient can
delay later ops on the rank but never creates a wait cycle, and it only lowers memory. With
`adjacent_only=true` a pair is merged only where W directly follows I (nothing moves, so
timing is unchanged under costs where B = I + W); other pairs stay split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeir.ops import Op
from pipeir.passes.base import Pass
from pipeir.passes.context import DEFAULT_CONTEXT, PassContext
from pipeir.schedule import Schedule


@dataclass(frozen=True)
class MergeBackward(Pass):
    """Merge I/W pairs back into full backwards."""

    name: ClassVar[str] = "merge-backward"
    summary: ClassVar[str] = ("inverse of split-backward: each I(s,mb) with its W(s,mb) "
                              "becomes B(s,mb) at the I's place")

    adjacent_only: bool = False

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        progs = []
        for prog in schedule.programs:
            present = set(prog)
            merged: set[Op] = set()  # the W ops folded into a B
            out: list[Op] = []
            for i, op in enumerate(prog):
                w = Op("W", op.stage, op.mb)
                if op.kind == "I" and w in present and (
                        not self.adjacent_only or (i + 1 < len(prog) and prog[i + 1] == w)):
                    out.append(Op("B", op.stage, op.mb))
                    merged.add(w)
                elif op not in merged:
                    out.append(op)
            progs.append(out)
        return schedule.with_programs(progs)
