"""The constraint model: one interval per op on its rank, solved with OR-Tools CP-SAT.

* Each op is an interval of its occupation (`Problem.occupation`); a rank's intervals do not
  overlap (one op at a time).
* A data edge p -> q is a precedence: q starts no earlier than p's end plus the edge's delay.
* Activation memory is a cumulative constraint per rank: the activation of (stage, mb) is an
  interval from its F's start to its release op's end, with demand 1 (or its bytes), under
  the limit.
* Minimise the makespan, the latest end (`solve`); or, with every op ending by a given
  step and no objective, find any schedule at all (`probe`).

NOTE (why the model and `simulate` agree). For a fixed per-rank order the simulator's times
are the earliest that respect the order and these same precedences, so the simulated step of
the order read off a solution (sort each rank's ops by start) is at most the solution's
objective, and equal at an optimum. Costs are scaled to integers (the smallest power of ten
that makes every duration and delay whole, when one up to 10^6 does; otherwise durations are
rounded *down*, so the model stays a relaxation and its bound stays a bound); the step synth
reports is always the simulated one.

NOTE (symmetry). When every micro-batch costs the same, ops of one kind on one stage run in
micro-batch order (F(s, m) before F(s, m + 1), and likewise for B, I and W). That loses no
schedule: relabel, on each stage and kind, the k-th op to run as micro-batch k; every
dependency still holds (the k-th F(s) starts after k F(s - 1) ended, so after the k-th
did), live counts per rank are unchanged, and with equal costs so are all times.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.search.interrupt import solving
from pipeir.search.synth.cpsat import cp_model
from pipeir.search.synth.problem import Problem, busiest, heads_tails, longest_paths, lower_bound
from pipeir.sim.engine import Timing

#: Called on every improving solution: (seconds since the start, best step, bound).
Progress = Callable[[float, float, float], None]


@dataclass(frozen=True)
class Scale:
    """Model units per time unit; `exact` when every duration and delay is whole in them."""

    factor: int
    exact: bool

    def down(self, x: float) -> int:
        return math.floor(x * self.factor + 1e-6)

    def up(self, x: float) -> int:
        return math.ceil(x * self.factor - 1e-6)


def choose_scale(values: Iterable[float]) -> Scale:
    """The smallest power of ten (up to 10^6) that makes every value whole; else 10^6, or a
    resolution of 1/1000 of the smallest positive value if that is finer."""
    vals = [v for v in values if v > 0]
    for k in range(7):
        f = 10 ** k
        if all(abs(v * f - round(v * f)) <= 1e-6 + 1e-12 * v * f for v in vals):
            return Scale(f, True)
    least = min(vals, default=1.0)
    return Scale(max(10 ** 6, 10 ** math.ceil(math.log10(1000 / least))), False)


class Timed(NamedTuple):
    """A per-rank order timed by the simulator's core: integer starts (in an `Integral`'s
    units), the order they were computed in (a topological one) and the simulated step."""

    start: dict[Op, int]
    order: list[Op]
    step: float


#: Memory sizes that are not whole are counted in units of the largest over 2^40: fine
#: enough that a set the model admits exceeds the limit by less than `Problem.fits` allows.
MEMORY_RESOLUTION = 2 ** 40


class Integral:
    """The problem in the solver's integer units: durations and delays scaled (`Scale`), the
    implied precedences (`Problem.implied`, zero delay), activation sizes, the parts their
    releases free and the memory limit (`demand`, `parts`, `cap`), and the dependency lists
    the window model reads (built once per search)."""

    def __init__(self, problem: Problem):
        self.problem = problem
        self.scale = choose_scale([*problem.occupation.values(),
                                   *(h for _, _, h in problem.edges)])
        self.units, self.cap = _memory_units(problem)
        # per activation (its F): the ops that free it, each with what it frees, in units
        self.parts = {(s, mb): [(rel, self.units(x)) for rel, x in problem.releases(s, mb)]
                      for s in range(problem.config.stages)
                      for mb in range(problem.config.microbatches)}
        self.demand = {s: self.units(problem.weight(s)) for s in range(problem.config.stages)}
        self.occ = {op: self.scale.down(d) for op, d in problem.occupation.items()}
        self.edges = [(p, q, self.scale.down(h)) for p, q, h in problem.edges]
        self.implied = [(p, q, 0) for p, q in problem.implied]
        self.preds: dict[Op, list[tuple[Op, int]]] = defaultdict(list)
        self.succs: dict[Op, list[tuple[Op, int]]] = defaultdict(list)
        self.implied_preds: dict[Op, list[Op]] = defaultdict(list)
        for p, q, d in self.edges:
            self.preds[q].append((p, d))
            self.succs[p].append((q, d))
        for p, q, _ in self.implied:
            self.implied_preds[q].append(p)

    def times(self, schedule: Schedule) -> Timed | None:
        """`schedule` timed by `Timing` (the one timing core; its makespan is `simulate`'s for
        these ops), starts rounded down to the model's units; None if it deadlocks."""
        problem = self.problem
        timing = Timing(schedule, problem.costs, problem.comm)
        if not timing.complete:
            return None
        ops = timing.ops
        t = timing.sweep([problem.costs.cost(op) for op in ops])
        return Timed({op: self.scale.down(x) for op, x in zip(ops, t.start)},
                     [ops[i] for i in timing.order], max(t.release, default=0.0))


def _memory_units(problem: Problem) -> tuple[Callable[[float], int], int]:
    """Sizes as integers, and the limit (0 when there is none). Whole sizes stay as they
    are; otherwise sizes are rounded *down* in fine units (`MEMORY_RESOLUTION`), and the
    limit too, so every set of activations (or their parts: what an I frees, what W keeps)
    that fits the real limit fits the model's (a sum of rounded-down sizes is at most the
    rounded-down sum): the model stays a relaxation and its bound a bound. NOTE: rounding
    sizes up instead, as the models once did, made a budget of exactly k activations of a
    fractional size admit only k - 1."""
    sizes = [x for s in range(problem.config.stages)
             for x in (problem.memory(s).saved, problem.memory(s).kept_for_w)]
    limit = problem.memory_limit or 0.0
    whole = all(float(x).is_integer() for x in sizes)
    unit = 1.0 if whole or max(sizes) <= 0 else max(sizes) / MEMORY_RESOLUTION

    def units(x: float) -> int:
        return math.floor(x / unit)
    return units, math.floor(limit * (1 + 1e-12) / unit)


@dataclass(frozen=True)
class Solved:
    """What one solver run found: the best order (None if none), its simulated step, the
    model's objective for it, the proven bound (in time units) and whether the solver closed
    the gap in its model."""

    schedule: Schedule | None
    step: float | None
    objective: float | None
    bound: float
    optimal: bool
    wall: float
    status: str


class _Callback(cp_model.CpSolverSolutionCallback):  # type: ignore[misc]
    def __init__(self, scale: int, weight: int, progress: Progress, t0: float):
        super().__init__()
        self.scale, self.weight, self.progress, self.t0 = scale, weight, progress, t0

    def on_solution_callback(self) -> None:
        self.progress(time.perf_counter() - self.t0,
                      int(self.objective_value) // self.weight / self.scale,
                      math.ceil(self.best_objective_bound) // self.weight / self.scale)


@dataclass
class _Base:
    """The constraints every run shares: starts within heads, tails and the horizon, one op
    at a time per rank, precedences and memory; `alive` as `_memory` returns it."""

    model: cp_model.CpModel
    start: dict[Op, cp_model.IntVar]
    alive: dict[tuple[Op, Op], tuple[cp_model.IntVar, cp_model.IntVar]]
    lb: int
    horizon: int


def _base(iz: Integral, horizon: int | None) -> _Base:
    """The model with every op ending by `horizon` (None: the sum of all durations and
    delays); a horizon below the lower bound is raised to it."""
    problem, occ = iz.problem, iz.occ
    edges = [*iz.edges, *iz.implied]
    if problem.objective == "steady":  # (no step horizon to sharpen them against: cheap ones)
        head, tail = longest_paths(problem.ops, edges, occ)
    else:
        head, tail = heads_tails(problem, edges, occ)
    lb = lower_bound(problem, head, occ, tail)
    if horizon is None:
        horizon = sum(occ.values()) + sum(h for _, _, h in iz.edges)
    horizon = max(horizon, lb)
    m = cp_model.CpModel()
    start = {op: m.new_int_var(head[op], max(head[op], horizon - occ[op] - tail[op]),
                               f"s_{op}") for op in problem.ops}
    interval = {op: m.new_fixed_size_interval_var(start[op], occ[op], f"i_{op}")
                for op in problem.ops}
    for r in range(problem.config.ranks):
        m.add_no_overlap([interval[op] for op in problem.ops if problem.rank(op) == r])
    for p, q, h in edges:
        m.add(start[q] >= start[p] + occ[p] + h)
    return _Base(m, start, _memory(iz, m, start, occ, horizon), lb, horizon)


#: CP-SAT keeps its seed and its thread count in 32-bit integers; past a few hundred threads
#: a machine only thrashes.
MAX_SEED = 2**31 - 1
MAX_WORKERS = 256


def settings_error(seed: int, workers: int) -> tuple[str, str] | None:
    """Why the solver cannot take `seed` or `workers`: (the setting, the reason), or None.
    Checked before any search, since `run` is reached only after the warm starts."""
    if not -MAX_SEED - 1 <= seed <= MAX_SEED:
        return "seed", f"the seed must be a 32-bit integer (at most {MAX_SEED:,}), got {seed}"
    if not 1 <= workers <= MAX_WORKERS:
        return "workers", f"workers must be 1 to {MAX_WORKERS}, got {workers}"
    return None


def run(m: cp_model.CpModel, time_limit: float, workers: int, seed: int,
        work_limit: float | None, callback: _Callback | None = None
        ) -> tuple[cp_model.CpSolver, cp_model.CpSolverStatus]:
    """Solve `m` with synth's solver settings (the full model, the probe, a window)."""
    solver = cp_model.CpSolver()
    prm = solver.parameters
    prm.max_time_in_seconds = max(0.01, time_limit)
    if work_limit is not None:
        prm.max_deterministic_time = work_limit
    prm.num_workers = workers
    prm.random_seed = seed
    prm.catch_sigint_signal = False  # Ctrl-C ends the whole search (`pipeir.search.interrupt`)
    with solving(solver):
        return solver, solver.solve(m, callback)


def _read(iz: Integral, solver: cp_model.CpSolver, base: _Base, objective: float,
          bound: float, optimal: bool, t0: float, name: str) -> Solved:
    """The solution's order (each rank's ops by start), verified and simulated."""
    problem, occ = iz.problem, iz.occ
    at = {op: solver.value(base.start[op]) for op in problem.ops}
    ranks = range(problem.config.ranks)
    sched = problem.build(in_order(problem, [[op for op in problem.ops if problem.rank(op) == r]
                                             for r in ranks], at, occ))
    if not Timing(sched, problem.costs, problem.comm).complete or not problem.fits(sched):
        # only with zero-duration ops, whose ties the model leaves open (see `in_order`)
        return Solved(None, None, None, bound, False, time.perf_counter() - t0, name)
    return Solved(sched, problem.step_time(sched), objective, bound, optimal,
                  time.perf_counter() - t0, name)


def solve(problem: Problem, *, hint: Schedule | None = None, upper: float | None = None,
          time_limit: float = 60.0, workers: int = 1, seed: int = 0,
          work_limit: float | None = None, progress: Progress | None = None) -> Solved:
    """Solve `problem` from `hint` (a valid schedule of it, whose step `upper` is), within
    `time_limit` seconds (and `work_limit` deterministic seconds: reproducible)."""
    t0 = time.perf_counter()
    iz = Integral(problem)
    scale, occ = iz.scale, iz.occ
    steady = problem.objective == "steady"
    ranks = problem.config.ranks
    if steady:
        # NOTE: the starts are any timing of the order, not the simulator's as-soon-as-
        # possible one (the steady state runs each rank from its previous step's end), so
        # no step-time horizon applies: every path of one step is at most the sum of all
        # durations and delays, and a steady timing's starts lie within P such paths
        base = _base(iz, ranks * (sum(occ.values()) + sum(h for _, _, h in iz.edges)))
        lb = busiest(problem, occ)
    else:
        base = _base(iz, scale.up(upper) if upper is not None else None)
        lb = base.lb
    m, start, horizon = base.model, base.start, base.horizon
    goal = m.new_int_var(lb, horizon, "step")
    finish = [m.new_int_var(0, horizon, f"end_{r}") for r in range(ranks)]
    first = [m.new_int_var(0, horizon, f"first_{r}") for r in range(ranks)]
    for op in problem.ops:
        m.add(finish[problem.rank(op)] >= start[op] + occ[op])
        if steady:
            m.add(first[problem.rank(op)] <= start[op])
    # back to back, a rank's next step starts once it has finished this one: every shift
    # of one step's timing by at least each rank's span is a valid steady state, and the
    # least such shift over all timings of an order is its steady step (`pipeir.sim.steady`)
    spans = [m.new_int_var(0, horizon, f"span_{r}") for r in range(ranks)] if steady else finish
    for r, f in enumerate(finish):
        if steady:
            m.add(spans[r] >= f - first[r])
        m.add(goal >= spans[r])
    weight = minimize(m, goal, spans, horizon)
    timed = iz.times(hint) if hint is not None else None
    if timed is not None:
        at = timed.start
        for op in problem.ops:
            m.add_hint(start[op], at[op])
        mine = [[op for op in problem.ops if problem.rank(op) == r] for r in range(ranks)]
        ends = [max((at[op] + occ[op] for op in ops), default=0) for ops in mine]
        starts = [min((at[op] for op in ops), default=0) for ops in mine]
        for r in range(ranks):
            m.add_hint(finish[r], ends[r])
            if steady:
                m.add_hint(first[r], starts[r])
                m.add_hint(spans[r], ends[r] - starts[r])
        m.add_hint(goal, max(e - b for e, b in zip(ends, starts)) if steady else max(ends))
        for (f_op, rel), (size, end) in base.alive.items():
            m.add_hint(end, at[rel] + occ[rel])
            m.add_hint(size, at[rel] + occ[rel] - at[f_op])

    cb = _Callback(scale.factor, weight, progress, t0) if progress is not None else None
    solver, status = run(m, time_limit - (time.perf_counter() - t0), workers, seed,
                          work_limit, cb)
    name = solver.status_name(status)
    found = status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    # the sum of ends (spans) is < weight, so bound // weight bounds the step
    bound = max(lb, math.ceil(solver.best_objective_bound) // weight
                if found else lb) / scale.factor
    if not found:
        return Solved(None, None, None, bound, False, time.perf_counter() - t0, name)
    return _read(iz, solver, base, solver.value(goal) / scale.factor, bound,
                 status == cp_model.OPTIMAL and scale.exact, t0, name)


def probe(problem: Problem, at: float | None = None, *, time_limit: float = 10.0,
          workers: int = 1, seed: int = 0, work_limit: float | None = None) -> Solved:
    """Ask for a schedule whose step is at most `at` (None: the lower bound) outright: the
    model with every op ending by then and no objective. Found at the bound, it is optimal
    (where the scale is exact); proven impossible, the bound rises to one of the model's
    units above `at`.

    NOTE: where the bound is tight this is much faster than minimising down to it: every
    start's domain shrinks to its slack against the bound and the solver only has to find a
    feasible point. On compute-bound at K = 8 (768 ops, eight chunks in a V) it finds a
    schedule at the bound in 4 s where the full model from 98.64 needs 6 to more than 24 s;
    on heavy-ends at K = 8 (four chunks in a V) in 0.8 s, where the full model and the window
    search took 18 s. Where the bound is loose it only costs its time: synth tries it when
    the warm start is already close (`synthesize`)."""
    t0 = time.perf_counter()
    iz = Integral(problem)
    want = None if at is None else iz.scale.down(at)
    base = _base(iz, 0 if want is None else want)  # (raised to the bound)
    f = iz.scale.factor
    if want is not None and want < base.lb:  # below the bound: nothing to solve
        return Solved(None, None, None, base.lb / f, False, time.perf_counter() - t0,
                      "INFEASIBLE")
    solver, status = run(base.model, time_limit - (time.perf_counter() - t0), workers, seed,
                          work_limit)
    name = solver.status_name(status)
    if status == cp_model.INFEASIBLE:
        return Solved(None, None, None, (base.horizon + 1) / f, False,
                      time.perf_counter() - t0, name)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return Solved(None, None, None, base.lb / f, False, time.perf_counter() - t0, name)
    return _read(iz, solver, base, base.horizon / f, base.lb / f,
                 iz.scale.exact and base.horizon == base.lb, t0, name)


def minimize(m: cp_model.CpModel, span: cp_model.IntVar, finish: Sequence[cp_model.IntVar],
             horizon: int) -> int:
    """Set the objective: the step (`span`) first, then the sum of the ranks' ends (or
    spans), which gives the search a slope on the step's plateaus. Returns the step's
    weight (which keeps the first term decisive): 1, the step alone, where the weighted sum
    could overflow CP-SAT's 64-bit integers (steps of thousands of time units at the finest
    scale)."""
    weight = len(finish) * horizon + 1
    if weight * (horizon + 1) >= 2 ** 62:
        m.minimize(span)
        return 1
    m.minimize(span * weight + sum(finish))
    return weight


def in_order(problem: Problem, programs: Sequence[Sequence[Op]], start: Mapping[Op, int],
             occ: Mapping[Op, int]) -> list[list[Op]]:
    """Each program's ops sorted by a solution's start times. NOTE: ops of zero duration can
    share a start with a producer of theirs; ties go by end, then by a topological order of
    the data edges, so no consumer is put before its producer."""
    topo = problem.topological
    return [sorted(prog, key=lambda op: (start[op], start[op] + occ[op], topo[op]))
            for prog in programs]


def _memory(iz: Integral, m: cp_model.CpModel, start: dict[Op, cp_model.IntVar],
            occ: dict[Op, int], horizon: int
            ) -> dict[tuple[Op, Op], tuple[cp_model.IntVar, cp_model.IntVar]]:
    """The per-rank cumulative of live activations (in `Integral`'s memory units), when the
    limit can bind at all: each activation is one interval from its F to the end of each op
    that frees part of it (its B; or its I and its W), of that part's size. Returns the
    (size, end) variables of each interval, by (its F, the releasing op)."""
    out: dict[tuple[Op, Op], tuple[cp_model.IntVar, cp_model.IntVar]] = {}
    problem, demand, cap = iz.problem, iz.demand, iz.cap
    if problem.memory_limit is None:
        return out
    c = problem.config
    for r in range(c.ranks):
        stages = c.stages_of(r)
        if sum(demand[s] for s in stages) * c.microbatches <= cap:
            continue
        alive, need = [], []
        for s in stages:
            for mb in range(c.microbatches):
                f = Op("F", s, mb)
                for rel, part in iz.parts[s, mb]:
                    if part <= 0:
                        continue
                    size = m.new_int_var(0, horizon, "")
                    end = m.new_int_var(0, horizon, "")
                    m.add(end == start[rel] + occ[rel])
                    alive.append(m.new_interval_var(start[f], size, end, f"a_{rel}"))
                    need.append(part)
                    out[f, rel] = (size, end)
        m.add_cumulative(alive, need, cap)
    return out
