"""Where the solver starts: the best known schedule of the same shape within the budget.

Candidates, each made to fit the problem's shape (same stages and placement; backwards split
in place or merged as the problem asks; overlapped pairs run one after the other) and kept
only when within the memory limit:

* `pipeir.search.tune`'s library schedules with its passes, at the same ranks, micro-batches, chunks
  and communication model;
* the Zero Bubble paper's greedy scheduler (`zb_greedy`), for split one-stage-per-rank runs,
  and a memory-aware list scheduler (`greedy`), for shapes no library schedule fits (both
  as time allows above `EXACT_OPS`);
* an input schedule, when synth runs as a pass;
* one micro-batch at a time, which fits any budget the problem can meet at all.

The fastest under the simulator is the warm start; synth never returns anything slower.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from pipeir import driver
from pipeir.diagnostics import PipeirError
from pipeir.ops import Op
from pipeir.passes import Pipeline
from pipeir.passes.merge_backward import MergeBackward
from pipeir.passes.split_backward import split_in_place
from pipeir.schedule import Schedule
from pipeir.search import tune
from pipeir.search.synth.greedy import each_greedy
from pipeir.search.synth.problem import Problem
from pipeir.search.synth.zb_greedy import zb_greedy
from pipeir.sim import CostModel

if TYPE_CHECKING:
    from pipeir.passes.context import CommModel
    from pipeir.search.tune import Candidate

#: Above this many ops the exact model is not expected to close; synthesis decomposes, and
#: the list scheduler (slow in Python at that size: 6 s for its twelve variants at 8,192 ops)
#: runs only as long as synth's time allows (`starts(deadline=...)`).
EXACT_OPS: Final = 1600

#: Above this many ops synthesis does not build the full model (it would take longer to load
#: than the search is worth); the window search, whose model is one window's, still runs.
MAX_OPS: Final = 8000


@dataclass(frozen=True)
class Start:
    """A candidate warm start: where it came from, the schedule, its simulated step."""

    label: str
    schedule: Schedule
    step: float


def conform(problem: Problem, schedule: Schedule) -> Schedule | None:
    """`schedule` as an order of exactly the problem's ops, or None if it has another shape."""
    c, mine = problem.config, schedule.config
    if (c.ranks, c.microbatches, c.stages, c.placement) != \
            (mine.ranks, mine.microbatches, mine.stages, mine.placement):
        return None
    kinds = {op.kind for op in schedule}
    if not kinds <= {"F", "B", "I", "W"}:
        return None  # memory ops or reductions: not an order of the model's ops
    if problem.split and "B" in kinds:
        schedule = split_in_place(schedule)
    elif not problem.split and "I" in kinds:
        schedule = driver.optimize(schedule, Pipeline.of([MergeBackward()]), problem.costs,
                                   verify_each=False).schedule
    if set(schedule) != set(problem.ops):
        return None
    return problem.build(schedule.programs, schedule.name)  # pairs run in turn


def sequential(problem: Problem) -> Schedule:
    """One micro-batch at a time, all the way down and back: the least memory possible."""
    c = problem.config
    progs: list[list[Op]] = [[] for _ in range(c.ranks)]
    for mb in range(c.microbatches):
        for s in range(c.stages):
            progs[c.placement[s]].append(Op("F", s, mb))
        for s in reversed(range(c.stages)):
            back = [Op("I", s, mb), Op("W", s, mb)] if problem.split else [Op("B", s, mb)]
            progs[c.placement[s]].extend(back)
    return problem.build(progs, "sequential")


def library(costs: CostModel, ranks: int, microbatches: int, comm: CommModel,
            max_v: int, deadline: float | None = None) -> list[Candidate]:
    """tune's candidates (within any budget) for `costs` of one stage per rank, as many as
    start before `deadline` (see `library_search`)."""
    return library_search(costs, ranks, microbatches, comm, max_v, deadline)[0]


def library_search(costs: CostModel, ranks: int, microbatches: int, comm: CommModel,
                   max_v: int, deadline: float | None = None
                   ) -> tuple[list[Candidate], bool]:
    """`library`'s candidates, and whether `deadline` cut tune's search short (then tune's
    own answer may be missing from them: see `pipeir.search.tune.search`)."""
    try:
        # dp=1: the model has no gradient reductions, so neither may its warm starts; tune
        # interleaves powers of 2 up to MAX_V chunks, so the largest of those within max_v
        # (`tune.search`, looked up when called: a test stands in for it)
        result = tune.search(costs, ranks, [microbatches],
                             max_v=1 << (min(max_v, tune.MAX_V).bit_length() - 1),
                             comms=(comm,), dp=1, deadline=deadline)
    except PipeirError:
        return [], False
    return [*result.ranked, *result.over_limit], result.cut


def library_starts(problem: Problem, candidates: Sequence[Candidate]) -> list[Start]:
    """The candidates that have the problem's shape, made to fit it, within its budget."""
    out = []
    for cand in candidates:
        s = conform(problem, cand.schedule)
        if s is not None and problem.fits(s):
            label = cand.family + (f" v={cand.v}" if cand.v > 1 else "") + \
                (f" + {cand.passes}" if cand.passes else "")
            if not problem.split and any(op.kind == "I" for op in cand.schedule):
                label += ", backwards merged"  # (an I + W order made B-only)
            out.append(Start(label, s, problem.step_time(s)))
    return out


def starts(problem: Problem, candidates: Sequence[Candidate] = (),
           given: Schedule | None = None, deadline: float | None = None,
           target: float | None = None) -> list[Start]:
    """Every warm start within the budget, fastest first (never empty when the budget is at
    least `problem.least_memory`): `quick_starts`, then the list scheduler's (`list_starts`)
    unless one of those already meets `target`."""
    out = quick_starts(problem, candidates, given)
    if target is None or min(st.step for st in out) > target * (1 + 1e-9):
        out += list_starts(problem, deadline, target)
    out.sort(key=lambda st: st.step)
    return out


def quick_starts(problem: Problem, candidates: Sequence[Candidate] = (),
                 given: Schedule | None = None) -> list[Start]:
    """The warm starts that cost one simulation each, fastest first: tune's `candidates` (see
    `library`) of the problem's shape, the `given` schedule and one micro-batch at a time
    (never empty when the budget is at least `problem.least_memory`)."""
    out = library_starts(problem, candidates)
    if given is not None:
        s = conform(problem, given)
        if s is not None and problem.fits(s):
            out.append(Start(f"input {given.name}", s, problem.step_time(s)))
    seq = sequential(problem)
    if problem.fits(seq):
        out.append(Start("one micro-batch at a time", seq, problem.step_time(seq)))
    out.sort(key=lambda st: st.step)
    return out


def list_starts(problem: Problem, deadline: float | None = None,
                target: float | None = None) -> list[Start]:
    """The list schedulers' warm starts, fastest first: the Zero Bubble greedy scheduler's
    (eight runs of it: 2.5 s at 2,304 ops, which is why it is not a `quick_starts` one), then
    `greedy`'s variants until a `deadline` (with none, all of them), or until one meets
    `target` (nothing is faster than the problem's bound); above `EXACT_OPS` they run only
    when it is not yet past."""
    out: list[Start] = []
    if len(problem.ops) > EXACT_OPS and (deadline is None or time.perf_counter() >= deadline):
        return out
    zb = zb_greedy(problem)
    if zb is not None and problem.fits(zb):
        out.append(Start("zb greedy", zb, problem.step_time(zb)))
        if target is not None and out[-1].step <= target * (1 + 1e-9):
            return out
    # NOTE: a small problem gets the first variant even past the deadline (milliseconds
    # there), every variant with none: what a reproducible run (`--work-limit`) asks for
    for g in each_greedy(problem, deadline=deadline):
        name = g.name[7:].upper().replace("_RANDOM", ", randomised")
        out.append(Start(f"list scheduler ({name})", g, problem.step_time(g)))
        if target is not None and out[-1].step <= target * (1 + 1e-9):
            break
    out.sort(key=lambda st: st.step)
    return out
