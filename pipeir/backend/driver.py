"""The backend driver: schedule passes, lowering, lowered passes, then the deadlock proof.

Every compiled program goes through `compile_schedule`, so nothing reaches codegen or the
runtime without `pipeir.backend.commcheck` having proved its communication deadlock-free.
"""

from __future__ import annotations

from pipeir.backend.commcheck import check_comm
from pipeir.backend.lower import Lowered, lower
from pipeir.schedule import Schedule
from pipeir.verify import verify


def compile_schedule(schedule: Schedule, passes: str | None = None,
                     overlap: bool = False, max_posted: int | None = None) -> Lowered:
    """Run the `passes` pipeline string (schedule-level passes, then lowered-level ones such
    as `overlap`), lower, and prove the result deadlock-free. `overlap`/`max_posted` are the
    flag spellings of `--passes overlap{max_posted=K}`."""
    from pipeir.passes.overlap import Overlap
    from pipeir.passes.pipeline import Pipeline, parse_pipeline

    pipeline = parse_pipeline(passes) if passes else Pipeline.of(())
    for p in pipeline.by_level("schedule").passes:
        schedule = p.run(schedule)
        verify(schedule)
    lowered = lower(schedule)
    low_passes = list(pipeline.by_level("lowered").passes)
    if (overlap or max_posted is not None) and not any(isinstance(p, Overlap)
                                                       for p in low_passes):
        low_passes.append(Overlap(max_posted=max_posted or 0))
    for p in low_passes:
        run_lowered = getattr(p, "run_lowered", None)
        assert callable(run_lowered), f"lowered pass {p.name} has no run_lowered"
        lowered = run_lowered(lowered)
    check_comm(lowered)
    return lowered
