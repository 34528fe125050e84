"""Schedule synthesis: the fastest per-rank order of ops for a cost model and a memory budget,
with a proven lower bound (OR-Tools CP-SAT).

    problem  what is solved: ops, durations, dependencies, memory (`problem`)
    warmstart  where the solver starts: tune's best library schedule of the same shape, the
             Zero Bubble greedy scheduler (`zb_greedy`), one micro-batch at a time
    model    the constraint model and its solver run; the probe at the bound (`probe`)
    lns      after the full model's share of the time (all of it on large problems):
             re-solve one window of the step at a time around the best schedule, with a
             model of the window's ops alone
    decompose  large sizes: solve a short pipeline, repeat its steady round

`synthesize(problem)` solves one problem; `synth(costs, ranks, microbatches, ...)` is what
`pipeirc synth` runs: it cuts the cost model into chunks like `pipeir.search.tune` and tries both
placements when asked to search.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from pipeir.config import ConfigError, PipelineConfig
from pipeir.diagnostics import UsageError
from pipeir.memunit import Budget, limit_for
from pipeir.ops import Op
from pipeir.passes.context import CommModel
from pipeir.schedule import Schedule
from pipeir.search.synth.decompose import extend, short_problem
from pipeir.search.synth.lns import improve
from pipeir.search.synth.model import Progress, Solved, probe, settings_error, solve
from pipeir.search.synth.problem import OBJECTIVES, Objective, Problem
from pipeir.search.synth.warmstart import (
    EXACT_OPS,
    MAX_OPS,
    Start,
    library,
    library_search,
    list_starts,
    quick_starts,
    starts,
)
from pipeir.search.tune import MAX_V
from pipeir.sim import CostModel
from pipeir.sim.chunks import rescale
from pipeir.verify import fits_in

if TYPE_CHECKING:
    from pipeir.search.tune import Candidate

Placement = Literal["loop", "vshape", "search"]

#: The full model's share of the solver time; the window search (`lns`) gets the rest.
FULL_SHARE = 0.4

#: The full model runs only when its share of the time is at least this many times what the
#: problem's bound took, and this many seconds per op (see `synthesize`; building the steady
#: objective's model on 1,152 ops took 1.6 s on a loaded machine, its bound nothing).
BUILD_FACTOR, BUILD_PER_OP = 3.0, 2e-3

#: tune's library search (the warm starts) stops starting candidates after this share of the
#: time limit, or `FLOOR` seconds if more. NOTE: it takes 1 s at p = 4, m = 8 and 4 s at
#: p = 16, m = 64, but 19 s at p = 32, m = 128 and 98 s at p = 64, m = 256, which a time
#: limit must cover. The floor keeps small problems whole under any limit (a limit of 0
#: still starts from the best library schedule of every shape), so the warm start does not
#: depend on the machine's speed there.
LIBRARY_SHARE, FLOOR = 1 / 3, 2.0

#: Above `EXACT_OPS` the list scheduler's variants start until this share of the time limit
#: (0.5 s each at 8,192 ops, several at 32,768: a warm start there is worth most of the time).
LIST_SHARE = 3 / 4

#: When the warm start is within this fraction of the bound, the full model's turn begins by
#: asking for a schedule at the bound outright (`model.probe`), with this share of the time.
PROBE_GAP, PROBE_SHARE = 0.01, 0.5

#: Above this many ops the full model gets only `LARGE_SHARE` of the time (the window search
#: the rest). NOTE: measured on the bench's shapes (2 threads): on 384 ops (p = 4, m = 8,
#: four chunks, I + W) the full model first, then windows, is what reaches compute-bound's
#: best; on 1,536 (h100-llama, p = 8, m = 32, two chunks, K = 8) the full model takes seconds
#: to load and reaches 447.4 in 120 s, the window search alone 442.2 in 60 s from the same
#: warm start (459.2). The full model still gets a share there for its bound: on 768 ops
#: (h100-llama, one stage per rank) it proves the warm start optimal in 2 s.
FULL_OPS = 500
LARGE_SHARE = 0.2


class BudgetError(UsageError):
    """The memory limit is below what any schedule needs; `least` is the smallest that works
    (in the problem's unit: activations per rank, or bytes)."""

    def __init__(self, limit: float, least: float):
        self.limit, self.least = limit, least
        super().__init__(f"no schedule fits a memory limit of {limit:g} per rank: the least "
                         f"any schedule needs is {least:g}")


@dataclass(frozen=True)
class SynthResult:
    """The best schedule found, its simulated step, the proven lower bound and how."""

    problem: Problem
    schedule: Schedule
    step: float
    bound: float
    warm: Start
    method: str
    optimal: bool
    wall: float
    shapes: tuple[str, ...] = ()  # the shapes searched (the bound holds over all of them)
    unsearched: tuple[str, ...] = ()  # shapes left out when bounding them outran the time
    library_cut: bool = False  # the time limit cut tune's search short (its answer may be lost)

    @property
    def gap(self) -> float:
        """How much faster than `step` an optimal schedule could at most be, as a fraction."""
        return 0.0 if self.optimal or self.step <= 0 else max(0.0, 1 - self.bound / self.step)


def synthesize(problem: Problem, *, tune_costs: CostModel | None = None,
               given: Schedule | None = None, warm: Start | None = None,
               time_limit: float = 60.0, workers: int = 1, seed: int = 0,
               work_limit: float | None = None, progress: Progress | None = None,
               decompose: bool = True, full_share: float = FULL_SHARE,
               bound: float | None = None) -> SynthResult:
    """Solve `problem` within `time_limit` seconds. `tune_costs` (the costs of one stage per
    rank, which the problem's cut into chunks) let tune's library schedules warm-start it;
    `given` is one more warm start; `warm` the warm start already chosen (see `prepare`);
    `decompose=False` goes straight to the full model even for large problems; the full
    model gets `full_share` of the time (at most `LARGE_SHARE` above `FULL_OPS` ops), the
    window search (`lns`) the rest; `bound`, one already proven for the problem (by an
    earlier turn of the solver, or synth's over its shapes), lets the search stop there, and
    the problem is not bounded again (on thousands of ops that takes seconds: a time limit of
    0 once took 8.7 s)."""
    t0 = time.perf_counter()
    check_settings(seed, workers)
    deadline = t0 + max(time_limit * LIBRARY_SHARE, FLOOR)
    warm = warm if warm is not None else \
        prepare(problem, _library(problem, tune_costs, deadline), given,
                _list_deadline(problem, t0 + time_limit * LIST_SHARE, work_limit))
    left = time_limit - (time.perf_counter() - t0)
    best, optimal, method = warm.schedule, False, "the warm start"
    bound = problem.lower_bound() if bound is None else bound
    step = warm.step
    hint = warm
    if decompose and left > 0 and len(problem.ops) > EXACT_OPS and problem.mb_uniform \
            and step > bound * (1 + 1e-9):
        grown = _decompose(problem, tune_costs, left / 2, workers, seed, work_limit)
        if grown is not None:
            method = f"decomposed: {grown[1]}"
            if grown[0].step < step:
                hint = grown[0]
                best, step = grown[0].schedule, grown[0].step
        left = time_limit - (time.perf_counter() - t0)
    if step <= bound * (1 + 1e-9):
        optimal = True
        method = ("the warm start" if best is warm.schedule else "the decomposition") + \
            " meets the lower bound"
    elif left > 0:
        n = len(problem.ops)
        share = full_share if n <= FULL_OPS else \
            min(full_share, LARGE_SHARE) if n <= MAX_OPS else 0.0
        # NOTE: a model is worth building only with time to solve it once built: building
        # costs about as much again as the bound (`Problem.bound_seconds`; 6.7 s on 1,536
        # ops of h100-llama, which a 0.3 s turn once overran by as much)
        if share > 0 and (left * share < BUILD_PER_OP * n or  # (without bounding it first)
                          left * share < BUILD_FACTOR * problem.bound_seconds):
            share = 0.0
        if share > 0 and n <= EXACT_OPS and step <= bound * (1 + PROBE_GAP) \
                and problem.objective == "makespan":  # (the probe asks for a makespan)
            probed = probe(problem, time_limit=left * PROBE_SHARE, workers=workers, seed=seed,
                           work_limit=work_limit)
            bound = max(bound, probed.bound)
            if probed.schedule is not None and probed.step is not None and probed.step < step:
                best, step, method = probed.schedule, probed.step, "asked for at the bound"
                hint = Start(method, best, step)
                if progress is not None:
                    progress(time.perf_counter() - t0, step, bound)
            left = time_limit - (time.perf_counter() - t0)
        if step <= bound * (1 + 1e-9):
            optimal = True
        elif share > 0:
            solved = solve(problem, hint=hint.schedule, upper=hint.step,
                           time_limit=left * share, workers=workers, seed=seed,
                           work_limit=work_limit, progress=progress)
            bound = max(bound, solved.bound)
            if method == "the warm start":
                method = "exact model"
            if solved.schedule is not None and solved.step is not None and solved.step < step:
                best, step = solved.schedule, solved.step
            optimal = solved.optimal and step <= solved.bound * (1 + 1e-9)
        left = time_limit - (time.perf_counter() - t0)
        if not optimal and left > 0:
            found = improve(problem, best, step, bound=bound, time_limit=left, seed=seed,
                            workers=workers, work_limit=work_limit, progress=progress)
            if found.step < step:
                best, step = found.schedule, found.step
                method += f", then {found.windows} window{'s' if found.windows != 1 else ''} " \
                    "re-solved"
            optimal = step <= bound * (1 + 1e-9)
    bound = step if optimal else min(bound, step)  # (not a rounding error below it)
    if best.name != "synth":
        best = problem.build(best.programs, "synth")
    return SynthResult(problem, best, step, bound, warm, method, optimal,
                       time.perf_counter() - t0)


def _list_deadline(problem: Problem, deadline: float, work_limit: float | None
                   ) -> float | None:
    """When the list scheduler's variants stop: at `deadline`, or, in a reproducible run (a
    `work_limit`) on a small problem, once they are all done."""
    return None if work_limit is not None and len(problem.ops) <= EXACT_OPS else deadline


def prepare(problem: Problem, candidates: Sequence[Candidate] = (),
            given: Schedule | None = None, deadline: float | None = None) -> Start:
    """Check the budget and choose the warm start (the fastest candidate that fits; see
    `starts` for the `deadline`; the list scheduler stops at the problem's bound)."""
    check_budget(problem)
    return starts(problem, candidates, given, deadline, problem.lower_bound())[0]


def check_budget(problem: Problem) -> None:
    """Raise `BudgetError` if no schedule fits the problem's memory limit."""
    limit = problem.memory_limit
    if limit is not None and not fits_in(problem.least_memory, limit):
        raise BudgetError(limit, problem.least_memory)


def check_settings(seed: int, workers: int) -> None:
    """Raise a UsageError for a seed or worker count the solver cannot take."""
    error = settings_error(seed, workers)
    if error is not None:
        raise UsageError(error[1])


def _library(problem: Problem, tune_costs: CostModel | None, deadline: float | None
             ) -> list[Candidate]:
    c = problem.config
    if tune_costs is None:
        return []
    return library(tune_costs, c.ranks, c.microbatches, problem.comm, c.stages // c.ranks,
                   deadline)


def _decompose(problem: Problem, tune_costs: CostModel | None, time_limit: float,
               workers: int, seed: int, work_limit: float | None
               ) -> tuple[Start, str] | None:
    c = problem.config
    t0 = time.perf_counter()
    per_mb = len(problem.ops) // c.microbatches
    m0 = min(c.microbatches - 1, max(2 * c.stages, EXACT_OPS // per_mb))
    if 2 * m0 > c.microbatches:
        return None  # not shorter enough to be worth solving apart (many chunks per rank)
    small = short_problem(problem, m0)
    warm = starts(small, _library(small, tune_costs, t0 + time_limit * LIBRARY_SHARE),
                  deadline=_list_deadline(small, t0 + time_limit * LIBRARY_SHARE, work_limit))[0]
    # NOTE: half of what is left, since growing it back (`extend`) takes seconds at
    # thousands of ops (2.7 s at 8,192)
    solved = solve(small, hint=warm.schedule, upper=warm.step,
                   time_limit=(time_limit - (time.perf_counter() - t0)) / 2, workers=workers,
                   seed=seed, work_limit=work_limit)
    short = solved.schedule if solved.schedule is not None and solved.step is not None \
        and solved.step < warm.step else warm.schedule
    grown = extend(problem, short)
    if grown is None:
        return None
    return Start("decomposition", grown.schedule, grown.step), grown.describe()


def make_problem(costs: CostModel, ranks: int, microbatches: int, v: int = 1,
                 placement: Literal["loop", "vshape"] = "loop", split: bool = False,
                 comm: CommModel = "overlapped", memory_limit: Budget = None,
                 memory_bytes: float | None = None, objective: Objective = "makespan"
                 ) -> Problem:
    """The problem for `costs` of `ranks` stages cut into `v` chunks each (`rescale`),
    `memory_limit` in activations per rank as `check` counts them (`pipeir.memunit`; 1F1B
    needs `ranks`, and `ONE_F_ONE_B` is its memory at this shape) or `memory_bytes` per
    rank, minimising `objective`."""
    try:
        config = PipelineConfig.make(ranks, microbatches, stages=ranks * v, placement=placement)
    except ConfigError as e:  # a size past the memory budget (`pipeir.limits`)
        raise UsageError(str(e)) from None
    chunk = rescale(costs, ranks, v)
    if memory_bytes is not None:
        return Problem(config, chunk, split, comm, memory_bytes, memory_bytes=True,
                       objective=objective)
    return Problem(config, chunk, split, comm, limit_for(memory_limit, ranks, v),
                   objective=objective)


def synth(costs: CostModel, ranks: int, microbatches: int, *, v: int | None = None,
          placement: Placement = "search", split: bool | None = None,
          comm: CommModel = "overlapped", memory_limit: Budget = None,
          memory_bytes: float | None = None, time_limit: float = 60.0, workers: int = 1,
          seed: int = 0, work_limit: float | None = None,
          progress: Progress | None = None, objective: Objective = "makespan"
          ) -> SynthResult:
    """Synthesise a schedule for `costs` (see `make_problem`) over one or more shapes (chunks
    per rank, placement and backwards): `v` chunks (None: 1, 2 and the v of tune's best
    schedule), in `placement` ("search": loop and V when v > 1), with whole backwards, split
    ones (I + W) or, with `split` None, both (on more than one rank: one rank has no bubble
    for a split to fill). Every shape gets its warm start and lower
    bound first; shapes whose bound is no better than the best warm start are dropped, and the
    others share the time. The bound reported holds for every shape searched."""
    t0 = time.perf_counter()
    check_settings(seed, workers)
    for name, value, allowed in (("objective", objective, get_args(Objective)),
                                 ("comm", comm, get_args(CommModel))):
        if value not in allowed:  # (an unknown objective was taken as the makespan)
            raise UsageError(f"synth: {name} must be one of {', '.join(allowed)}, got "
                             f"{value!r}")
    if v is not None and (type(v) is not int or v < 1):
        raise UsageError(f"synth: v (chunks per rank) must be a positive integer, got {v!r}")
    if v is not None and v > MAX_V:
        # NOTE: --v 20000 on two ranks took 17 s and 750 MB before the first solver call
        raise UsageError(f"--v {v}: synth cuts a stage into at most {MAX_V} chunks, as tune "
                         "does (no model has layers for more)")
    make_problem(costs, ranks, microbatches, v or 1)  # a size error before tune's search
    candidates, cut = library_search(costs, ranks, microbatches, comm, 8 if v is None else v,
                                     t0 + max(time_limit * LIBRARY_SHARE, FLOOR))
    # tune's best within the budget (its shape is searched, and warmed first): in bytes,
    # the candidates whose peak bytes fit, else as `_tunes_best` counts
    within = candidates if memory_bytes is None else \
        [c for c in candidates if c.peak_bytes is not None and
         fits_in(c.peak_bytes, memory_bytes)]
    shapes = [make_problem(costs, ranks, microbatches, n, shape, halves, comm, memory_limit,
                           memory_bytes, objective)
              for halves in ((False, True) if split is None and ranks > 1
                             else (bool(split),))
              for n, shape in search_shapes(within, ranks, v, placement,
                                            memory_limit if memory_bytes is None else None,
                                            ranks * microbatches * (3 if halves else 2))]
    problems = _within_budget(shapes)
    # NOTE: bounding a shape costs seconds on large problems (5 s for the 98,304 ops of p =
    # 64, m = 256, two chunks): once half the time (and `FLOOR`) is spent, the shapes not yet
    # bounded are not searched (and the bound reported is over those that are)
    # tune's best shape first: its warm start is tune's answer, which synth must not lose
    tunes = _tunes_shape(within, memory_limit if memory_bytes is None else None)
    tunes_split = _tunes_split(within, memory_limit if memory_bytes is None else None)
    def _tunes_first(p: Problem) -> bool:
        """Sorts tune's shape, in tune's backwards, first."""
        return (p.config.stages // ranks, p.config.placement_name, p.split) != \
            (*tunes, tunes_split) if tunes is not None else True

    problems.sort(key=lambda p: ((p.config.stages // ranks, p.config.placement_name) != tunes,
                                 not p.split))
    bounds: list[float] = []
    unsearched: list[Problem] = []
    split_bounds: dict[tuple[int, str | None], float] = {}
    for n, problem in enumerate(problems):
        if n and time.perf_counter() - t0 > max(time_limit / 2, FLOOR):
            unsearched = problems[n:]
            del problems[n:]
            break
        key = (problem.config.stages, problem.config.placement_name)
        if not problem.split and key in split_bounds and _split_covers(problem):
            bounds.append(split_bounds[key])  # (see `_split_covers`)
            continue
        bounds.append(problem.lower_bound())
        if problem.split:
            split_bounds[key] = bounds[-1]
    warms = _warm_starts(problems, bounds, candidates, _tunes_first,
                         t0 + max(time_limit * LIST_SHARE, FLOOR), t0 + time_limit * LIST_SHARE,
                         work_limit)
    first = min(warms.values(), key=lambda w: w.step)
    # the fastest warm start's shape is searched even when that start meets its own bound
    # (closed at once), or a shape with a lower bound but a slower start could be returned
    live = [i for i in warms if bounds[i] < first.step * (1 - 1e-9) or warms[i] is first]
    # NOTE: two rounds. The live shapes share a third of the time, fastest warm start first,
    # each taking an equal part of what is left (a shape closed early leaves its time to the
    # others); a shape whose bound is no better than the best step found by then is dropped
    # (its time goes to the second round), and the round ends once a shape meets every
    # shape's bound. The rest goes to the fastest shape still open (below), continuing from
    # its best schedule, with the window search alone where it runs (its full model had its
    # turn in the first round, and on compute-bound's four-chunk V the window search still
    # gains at 50 s).
    round_end = time.perf_counter() + (time_limit - (time.perf_counter() - t0)) / 3
    results: dict[int, SynthResult] = {}
    for n, i in enumerate(sorted(live, key=lambda i: warms[i].step)):
        if results and bounds[i] >= min(r.step for r in results.values()) * (1 - 1e-9):
            continue
        share = (round_end - time.perf_counter()) / (len(live) - n)
        if results and share <= 0:
            continue  # (no time left to search it: it keeps its bound, and its start lost)
        results[i] = synthesize(problems[i], tune_costs=costs, warm=warms[i],
                                time_limit=max(share, 0.0), workers=workers, seed=seed,
                                work_limit=work_limit, progress=progress, bound=bounds[i])
        if results[i].step <= min(bounds) * (1 + 1e-9):
            break  # no shape can beat it: each shape's bound is at least min(bounds)
    # the second round: the fastest shape whose own bound leaves room below the best step
    # (the fastest shape may be closed, optimal in its own shape, while another's bound is
    # lower); one that returns before the time is up (closed) hands the rest to the next,
    # until none is open. It starts from the first round's bound, so its window search stops
    # there. NOTE: on compute-bound at K = 4 (seed 3) the two-chunk V led at 103.335, closed
    # at its bound, 103.165, in 9 s, and the 32 s left went unused while the four-chunk V
    # (bound 101.075, which it reaches) was still open.
    tried: set[int] = set()
    while (left := time_limit - (time.perf_counter() - t0)) > 0.05:
        fastest = min(r.step for r in results.values())
        open_ = [i for i, r in results.items()
                 if i not in tried and not r.optimal and r.bound < fastest * (1 - 1e-9)]
        if not open_:
            break
        lead = min(open_, key=lambda i: results[i].step)
        tried.add(lead)
        first_round = results[lead]
        again = synthesize(problems[lead], warm=Start(first_round.method, first_round.schedule,
                                                      first_round.step),
                           time_limit=left, workers=workers, seed=seed, work_limit=work_limit,
                           progress=progress, decompose=False, full_share=0.0,
                           bound=first_round.bound)
        method = first_round.method
        if again.step < first_round.step * (1 - 1e-9):  # say what found the step reported
            method += f"; second round: {again.method.rpartition(', then ')[2]}"
        results[lead] = SynthResult(again.problem, again.schedule, again.step,
                                    max(again.bound, first_round.bound), first_round.warm,
                                    method, again.optimal, again.wall)
    best = results[min(results, key=lambda i: results[i].step)]
    bound = min(best.step, *(r.bound for r in results.values()),
                *(b for i, b in enumerate(bounds) if i not in results))
    optimal = bound >= best.step * (1 - 1e-9)
    method = best.method if optimal else \
        best.method.replace("meets the lower bound", "meets its shape's lower bound")
    return SynthResult(best.problem, best.schedule, best.step, best.step if optimal else bound,
                       first, method, optimal, time.perf_counter() - t0,
                       tuple(map(_shape, problems)), tuple(map(_shape, unsearched)), cut)


def _warm_starts(problems: Sequence[Problem], bounds: Sequence[float],
                 candidates: Sequence[Candidate],
                 first: Callable[[Problem], bool], end: float, list_end: float,
                 work_limit: float | None) -> dict[int, Start]:
    """Each shape's warm start (by index into `problems`): the cheap ones while before `end`,
    the list scheduler's until `list_end`.

    NOTE: two passes, so that no shape's cheap starts wait on another's list scheduler. The
    first gives every shape the starts that cost one simulation each (`quick_starts`: tune's
    candidates of that shape, the Zero Bubble greedy scheduler, one micro-batch at a time);
    the second runs the list scheduler shape by shape, each taking an equal part of the time
    left to `list_end` (a small shape that is done early leaves its time to the others). Both
    go tune's shape in tune's backwards first (`first` sorts it first), then by increasing
    bound, the smaller first where bounds tie (back to back every shape has the busiest rank's
    bound, and a small shape's starts cost least: at p = 16, m = 48, tune's eight chunks took
    11 s to conform and time, and 7 s more with backwards merged); a shape whose bound is no
    better than the fastest start found by then gets none (it can neither give the best start
    nor be searched), and the search ends once a start meets every shape's bound. With one
    pass, tune's eight-chunk shape at p = 8, m = 24 (4,608 ops) ran its list scheduler to the
    end of the warm starts' time, and one stage per rank, whose library start (1F1B split h2,
    the paper's ZB-H2) meets the bound, never had its turn."""
    order = sorted(range(len(problems)),
                   key=lambda i: (first(problems[i]), bounds[i], len(problems[i].ops)))
    floor = min(bounds)
    warms: dict[int, Start] = {}

    def fastest() -> float:
        return min((w.step for w in warms.values()), default=math.inf)

    def wanted(i: int) -> bool:  # (not yet met by a start found)
        return fastest() > floor * (1 + 1e-9) and bounds[i] < fastest() * (1 - 1e-9)

    for i in order:
        if warms and time.perf_counter() > end:
            break  # (the search needs the rest; the shapes left keep their bounds)
        if not warms or wanted(i):
            check_budget(problems[i])
            warms[i] = quick_starts(problems[i], candidates)[0]
    listed = [i for i in order if i in warms]
    for n, i in enumerate(listed):
        if not wanted(i) or (len(problems[i].ops) > EXACT_OPS and
                             time.perf_counter() > list_end):
            continue
        share = (list_end - time.perf_counter()) / (len(listed) - n)
        more = list_starts(problems[i], _list_deadline(problems[i], time.perf_counter() + share,
                                                        work_limit), bounds[i])
        if more and more[0].step < warms[i].step:
            warms[i] = more[0]
    return warms


def _split_covers(whole: Problem) -> bool:
    """Whether the same shape with split backwards bounds `whole` too: every B costs at
    least its I and W together, so a B-only schedule, each B run as its I then its W, is a
    split schedule no slower, holding no more (W frees what B did). Then the split shape's
    bound, which synth computes first, serves both (bounding a shape takes seconds)."""
    costs = whole.costs
    return all(costs.cost(op) >= costs.cost(Op("I", op.stage, op.mb)) +
               costs.cost(Op("W", op.stage, op.mb)) - 1e-12
               for op in whole.ops if op.kind == "B")


def _shape(problem: Problem) -> str:
    c = problem.config
    return f"v={c.stages // c.ranks} {c.placement_name or 'explicit'}" + \
        (" I + W" if problem.split else "")


def _within_budget(problems: list[Problem]) -> list[Problem]:
    """The shapes some schedule fits (chunks change what a rank must hold at least);
    `BudgetError` in the user's unit (activations as `check` counts them, or bytes: the
    problems' own) with the least over every shape when none does."""
    out = []
    for p in problems:
        try:
            check_budget(p)
        except BudgetError:
            continue
        out.append(p)
    limits = [p.memory_limit for p in problems if p.memory_limit is not None]
    if out or not limits:
        return out
    raise BudgetError(min(limits), min(p.least_memory for p in problems))


def search_shapes(candidates: Sequence[Candidate], ranks: int, v: int | None,
                  placement: Placement, memory_limit: Budget, ops_per_chunk: int
            ) -> list[tuple[int, Literal["loop", "vshape"]]]:
    """The (chunks per rank, placement) pairs to search, in `placement` ("search": loop and
    V): `v`, or with v None 1, 2, 4 while its model is small enough to solve exactly (it has
    `ops_per_chunk` ops per chunk per rank), and the v of tune's fastest candidate within the
    budget (in its own placement, and in the other too while small enough).

    NOTE: more chunks let uneven stages be balanced across ranks (heavy first and last stages
    split over more ranks), but every shape searched also lowers the bound reported, which
    holds for all of them; a shape is added only where the exact model and the list scheduler
    can still give it a good schedule. The other placement of tune's v is what closes
    compute-bound at p = 4, m = 8, K = 8: tune's best is an eight-chunk loop, 98.705 at
    best against the bound 98.555, and the eight-chunk V has a schedule at that bound (the
    probe finds it in 4 s)."""
    both: list[Literal["loop", "vshape"]] = ["loop", "vshape"] if placement == "search" \
        else [placement]
    if v is not None:  # (on one rank, or with one chunk, the V is the loop)
        return [(v, "loop")] if v == 1 or ranks == 1 else [(v, shape) for shape in both]
    out: list[tuple[int, Literal["loop", "vshape"]]] = [(1, "loop")]
    if ranks > 1:
        out.extend((2, shape) for shape in both)
        if 4 * ops_per_chunk <= EXACT_OPS:
            out.extend((4, shape) for shape in both)
        best = _tunes_shape(candidates, memory_limit)
        if best is not None:
            v_best, own = best
            small = v_best * ops_per_chunk <= EXACT_OPS
            out.extend((v_best, shape) for shape in both  # (one chunk: V is the loop)
                       if (small or shape == own) and (v_best, shape) not in out
                       and (v_best > 1 or shape == "loop"))
    return out


def _tunes_best(candidates: Sequence[Candidate], memory_limit: Budget) -> Candidate | None:
    """tune's fastest candidate within the budget (at its own shape: `ONE_F_ONE_B` is P x V
    activations with V chunks)."""
    fits = [c for c in candidates if c.fits(limit_for(memory_limit, c.schedule.config.ranks,
                                                      c.v))]
    return min(fits, key=lambda c: c.sort_key()) if fits else None


def _tunes_shape(candidates: Sequence[Candidate], memory_limit: Budget
                 ) -> tuple[int, Literal["loop", "vshape"]] | None:
    """The chunks per rank and placement of tune's fastest candidate within the budget."""
    best = _tunes_best(candidates, memory_limit)
    if best is None:
        return None
    return best.v, "vshape" if best.schedule.config.placement_name == "vshape" else "loop"


def _tunes_split(candidates: Sequence[Candidate], memory_limit: Budget) -> bool:
    """Whether tune's fastest candidate within the budget splits its backwards."""
    best = _tunes_best(candidates, memory_limit)
    return best is not None and any(op.kind == "I" for op in best.schedule)


__all__ = ["EXACT_OPS", "OBJECTIVES", "BudgetError", "Objective", "Problem", "Solved",
           "SynthResult", "make_problem", "prepare", "synth", "synthesize"]
