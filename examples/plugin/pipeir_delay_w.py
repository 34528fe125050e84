"""An example pass plugin for pipeir: delay weight-gradient ops.

`delay-w` moves each W op later on its rank, keeping at most `max_pending` of them waiting
(0: no bound, so every W runs at the very end of its rank's program). A W needs only its
own I and nothing needs a W, so moving it later can never deadlock a schedule; it holds
activations longer, which `verify{memory_limit=K}` after it would catch.

Install with `pip install -e examples/plugin`, then `pipeirc opt FILE --passes
'split-backward,delay-w{max_pending=2}'`; or, without installing, `pipeirc opt FILE
--pass-plugin examples/plugin/pipeir_delay_w.py:DelayW --passes ...`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from pipeir.ops import Op
from pipeir.passes import OptionError, Pass, PassContext
from pipeir.passes.context import DEFAULT_CONTEXT
from pipeir.schedule import Schedule


@dataclass(frozen=True)
class DelayW(Pass):
    """Move W ops later on their rank, at most `max_pending` waiting (0 = all to the end)."""

    name: ClassVar[str] = "delay-w"
    summary: ClassVar[str] = "move W ops later on each rank (max_pending bounds the waiting W)"

    max_pending: int = 0

    def __post_init__(self) -> None:
        if self.max_pending < 0:
            raise OptionError("max_pending", f"delay-w: max_pending must be >= 0, "
                                             f"got {self.max_pending}")

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        programs = []
        for prog in schedule.programs:
            out: list[Op] = []
            waiting: deque[Op] = deque()
            for op in prog:
                if op.kind == "W":
                    waiting.append(op)
                    if self.max_pending and len(waiting) > self.max_pending:
                        out.append(waiting.popleft())
                else:
                    out.append(op)
            programs.append(out + list(waiting))
        return schedule.with_programs(programs)
