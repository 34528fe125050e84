"""verify: the checks of `pipeirc check` as a pass, to assert validity at a point in a
pipeline (the pass manager also verifies after every pass unless told not to)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pipeir.passes.base import OptionError, Pass
from pipeir.passes.context import DEFAULT_CONTEXT, PassContext
from pipeir.schedule import Schedule
from pipeir.verify import verify


@dataclass(frozen=True)
class Verify(Pass):
    """Check the schedule; return it unchanged."""

    name: ClassVar[str] = "verify"
    summary: ClassVar[str] = ("check completeness, placement, deadlock freedom and memory "
                              "(memory_limit overrides the pipeline's)")

    #: in activations (`pipeir.memunit`), which may be fractional (an activation waiting
    #: only for its W), as `pipeir.verify(memory_limit=...)` and `check` take it
    memory_limit: float | None = None

    def __post_init__(self) -> None:
        limit = self.memory_limit
        if limit is not None and limit <= 0:
            raise OptionError("memory_limit", f"verify: memory_limit must be a positive "
                                              f"number, got {limit!r}")

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        verify(schedule, memory_limit=self.memory_limit, sizes=ctx.costs)
        return schedule
