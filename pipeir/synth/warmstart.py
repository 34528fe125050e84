"""Where the solver starts: the best known schedule of the same shape within the budget.

Candidates, each made to fit the problem's shape (same stages and placement; backwards split
in place or merged as the problem asks; overlapped pairs run one after the other) and kept
only when within the memory limit:

* `pipeir.tune`'s library schedules with its passes, at the same ranks, micro-batches, chunks
  and communication model;
* the Zero Bubble paper's greedy scheduler (`zb_greedy`), for split one-stage-per-rank runs;
* a memory-aware list scheduler (`greedy`), for shapes no library schedule fits;
* an input schedule, when synth runs as a pass;
* one micro-batch at a time, which fits any budget the problem can meet at all.

The fastest under the simulator is the warm start; synth never returns anything slower.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeir.diagnostics import PipeirError
from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.sim import CostModel
from pipeir.synth.greedy import greedy
from pipeir.synth.problem import Problem
from pipeir.synth.zb_greedy import zb_greedy


@dataclass(frozen=True)
class Start:
    """A candidate warm start: where it came from, the schedule, its simulated step."""

    label: str
    schedule: Schedule
    step: float


def conform(problem: Problem, schedule: Schedule) -> Schedule | None:
    """`schedule` as an order of exactly the problem's ops, or None if it has another shape."""
    from pipeir.passes.merge_backward import MergeBackward
    from pipeir.passes.split_backward import split_in_place

    c, mine = problem.config, schedule.config
    if (c.ranks, c.microbatches, c.stages, c.placement) != \
            (mine.ranks, mine.microbatches, mine.stages, mine.placement):
        return None
    kinds = {op.kind for op in schedule}
    if problem.split and "B" in kinds:
        schedule = split_in_place(schedule)
    elif not problem.split and "I" in kinds:
        schedule = MergeBackward().run(schedule)
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


def library_starts(problem: Problem, costs: CostModel, v: int) -> list[Start]:
    """tune's candidates (at `costs` for one stage per rank, `v` chunks) that fit."""
    from pipeir.tune import search

    c = problem.config
    try:
        result = search(costs, c.ranks, [c.microbatches], max_v=v, comms=(problem.comm,))
    except PipeirError:
        return []
    out = []
    for cand in [*result.ranked, *result.over_limit]:
        if cand.v != v:
            continue
        s = conform(problem, cand.schedule)
        if s is not None and problem.fits(s):
            label = cand.family + (f" v={v}" if v > 1 else "") + \
                (f" + {cand.passes}" if cand.passes else "")
            out.append(Start(label, s, problem.step_time(s)))
    return out


def starts(problem: Problem, costs: CostModel | None = None, v: int = 1,
           given: Schedule | None = None) -> list[Start]:
    """Every candidate within the budget, fastest first (never empty when the budget is at
    least `problem.least_memory`). `costs`: the one-stage-per-rank costs tune searches with."""
    out = library_starts(problem, costs, v) if costs is not None else []
    zb = zb_greedy(problem)
    if zb is not None and problem.fits(zb):
        out.append(Start("zb greedy", zb, problem.step_time(zb)))
    if given is not None:
        s = conform(problem, given)
        if s is not None and problem.fits(s):
            out.append(Start(f"input {given.name}", s, problem.step_time(s)))
    for g in greedy(problem):
        out.append(Start(f"list scheduler ({g.name[7:].upper()})", g, problem.step_time(g)))
    seq = sequential(problem)
    if problem.fits(seq):
        out.append(Start("one micro-batch at a time", seq, problem.step_time(seq)))
    out.sort(key=lambda st: st.step)
    return out
