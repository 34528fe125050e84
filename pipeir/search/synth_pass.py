"""synth: replace a schedule by the fastest order of the same ops that the solver finds.

The input fixes the shape: ranks, micro-batches, stages and their placement, and whether
backwards are split (I + W) or not. The costs and the communication model come from the pass
context (`pipeirc opt --costs`, `pipeir.compile(..., costs=...)`), so the pass optimises for
the model it will run (a context without costs plans for unit costs, and `PassManager` warns).
See `pipeir.search.synth` for the model, its bound and its warm starts.

NOTE (guarantees). The input is one of the warm starts, so the result is never slower than
the input under the context's costs, and never holds more activations per rank than
`memory_limit`, which defaults to the pipeline's own `memory_limit`, or else the input's
peak: the pass never trades memory for time unless asked to.

It refuses inputs with memory ops (FC/RC/OFF/RELOAD) or gradient reductions (R): run
`recompute`, `offload` and `dp-reduce` after it (`synth,dp-reduce`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from pipeir.diagnostics import UsageError
from pipeir.passes.base import OptionError, Pass
from pipeir.passes.context import PassContext, given
from pipeir.passes.dp_reduce import reject_reductions
from pipeir.passes.memory import reject_memory_ops
from pipeir.schedule import Schedule
from pipeir.verify import memory_report


@dataclass(frozen=True)
class Synth(Pass):
    """Synthesise the fastest order of the input's ops under the context's costs."""

    name: ClassVar[str] = "synth"
    summary: ClassVar[str] = ("reorder every rank's ops for the shortest step under the "
                              "context's costs (CP-SAT; never slower, same memory by default)")
    costed: ClassVar[bool] = True

    time_limit: float = 10.0
    memory_limit: int = 0  # 0: the pipeline's memory_limit, else the input's peak
    workers: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        # NOTE: pipeir.search.synth imports OR-Tools, the optional `synth` extra: loading the
        # pass class (`pipeirc passes` lists every pass) must work without it
        from pipeir.search.synth.model import settings_error  # noqa: PLC0415 - ortools

        if not 0 < self.time_limit < math.inf:  # also refuses nan
            raise OptionError("time_limit", f"synth: time_limit must be a finite number of "
                                            f"seconds > 0, got {self.time_limit}")
        if self.memory_limit < 0:
            raise OptionError("memory_limit", "synth: memory_limit must be a positive number "
                                              "of activations per rank (or 0: the input's), "
                                              f"got {self.memory_limit}")
        error = settings_error(self.seed, self.workers)
        if error is not None:
            raise OptionError(error[0], f"synth: {error[1]}")

    def run(self, schedule: Schedule, ctx: PassContext | None = None) -> Schedule:
        ctx = given(ctx, self.name)
        from pipeir.search.synth import Problem, synthesize  # noqa: PLC0415 - ortools

        # NOTE: the model orders F/B/I/W ops only; memory ops change what a rank holds and
        # reductions follow the weight gradients, so both are added after synth, not kept.
        reject_memory_ops(schedule, self.name)
        reject_reductions(schedule, self.name)
        c = schedule.config
        limit = self.memory_limit or c.memory_limit or \
            max(memory_report(schedule).peak_activations, default=1)
        split = any(op.kind in ("I", "W") for op in schedule)
        whole = next((op for op in schedule if op.kind == "B"), None) if split else None
        if whole is not None:  # the model has one kind of backward, and would change the ops
            raise UsageError(f"{self.name} orders the ops it is given, but this schedule has "
                             f"both whole backwards ({whole}) and split ones (I, W): run "
                             "split-backward or merge-backward over all of it first",
                             schedule.span_of(whole))
        problem = Problem(c, ctx.costs, split, ctx.comm, float(limit))
        result = synthesize(problem, given=schedule,
                            tune_costs=ctx.costs if c.stages == c.ranks else None,
                            time_limit=self.time_limit, workers=self.workers, seed=self.seed)
        # the input's spans, not its overlapped pairs: the solver timed every op on its own
        spans = {op: schedule.span_of(op) for op in schedule}
        return Schedule.from_programs(c, result.schedule.programs, schedule.name, spans)
