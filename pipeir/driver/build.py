"""Running the planned pipeline: compile (passes, the data-parallel policy, lowering and
the deadlock proof), optimize (schedule-level passes only) and simulate."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeir.driver.load import Loaded
from pipeir.driver.plan import data_parallel
from pipeir.passes import (
    Compiled,
    Instrument,
    Optimized,
    PassContext,
    PassManager,
    Phases,
    Pipeline,
)
from pipeir.passes.context import CommModel
from pipeir.schedule import Schedule
from pipeir.sim import COMM_MODELS, CostModel, SimResult
from pipeir.sim import simulate as simulate_schedule
from pipeir.verify import verify


@dataclass(frozen=True)
class Build:
    """A compiled schedule (after its passes, lowered and proved deadlock-free) and the
    data-parallel replicas it runs with."""

    compiled: Compiled
    dp: int


def compile_schedule(schedule: Schedule, pipeline: Pipeline, costs: CostModel, *,
                     dp: int | None = None, comm: CommModel | None = None,
                     progress: Callable[[str], None] | None = None) -> Build:
    """`schedule` through `pipeline` under the data-parallel policy (`data_parallel`),
    lowered and proved; `comm` defaults to the pipeline's (overlapped with `overlap`), and
    `progress` hears of each phase (`pipeir.progress`)."""
    rep = data_parallel(pipeline, schedule, costs, dp)
    ctx = PassContext(rep.costs, comm if comm is not None else rep.pipeline.comm)
    instruments = [Phases(progress)] if progress is not None else []
    compiled = PassManager(rep.pipeline, context=ctx, instruments=instruments).compile(schedule)
    return Build(compiled, rep.dp)


def optimize(schedule: Schedule, pipeline: Pipeline, costs: CostModel, *,
             comm: CommModel | None = None, verify_each: bool = True,
             instruments: Sequence[Instrument] = ()) -> Optimized:
    """`schedule` through a pipeline of schedule-level passes, not lowered (`pipeirc opt`,
    tune's candidates). The pipeline runs as given: `data_parallel` decides reductions."""
    ctx = PassContext(costs, comm if comm is not None else pipeline.comm)
    return PassManager(pipeline, context=ctx, verify_each=verify_each,
                       instruments=instruments).optimize(schedule)


def simulate(loaded: Loaded, comm: str = COMM_MODELS[0]) -> SimResult:
    """A loaded schedule, verified and simulated under its costs (simulate, plot, bubble)."""
    return simulate_verified(loaded.schedule, loaded.costs, comm)


def simulate_verified(schedule: Schedule, costs: CostModel | None,
                      comm: str = COMM_MODELS[0]) -> SimResult:
    """`schedule` verified, then simulated under `costs` (the command line's and
    `pipeir.simulate`'s road): timing a schedule that lacks ops would report the bubble of
    other work."""
    verify(schedule, sizes=costs)  # counted with the split, as `check` counts
    return simulate_schedule(schedule, costs, comm=comm)
