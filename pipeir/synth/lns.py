"""Large-neighbourhood search around the best schedule: re-solve one time window at a time.

The full model on a few hundred ops improves slowly on two threads (CP-SAT's own neighbourhood
workers get a small share of them). So after the full model's turn, synthesis keeps the best
schedule and repeats:

1. simulate it and pick a window of the step, [a, a + w), at random (`seed`);
2. on every rank, the ops that start inside the window are a run of its program; every op
   outside keeps its place: it stays after its predecessor on the rank, and the run stays
   between the ops around it (extra precedences for `model.solve`);
3. solve that model, a small one, with the current schedule as the hint and a short
   deterministic limit, and keep the result when its simulated step is no worse.

The window grows after a neighbourhood closed without gain (nothing more to find there) and
shrinks after one that ran out of time. Every schedule kept is one the full model allows
(verified, within the memory limit, simulated), so the step can only go down; the bound is
not touched (a neighbourhood proves nothing about the whole problem).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.sim import simulate
from pipeir.synth.model import Progress, solve
from pipeir.synth.problem import Problem

#: Deterministic seconds one neighbourhood may take.
STEP_WORK = 0.25


@dataclass(frozen=True)
class Improved:
    """The best schedule after the search, its simulated step and how many windows ran."""

    schedule: Schedule
    step: float
    windows: int


def chains(problem: Problem, schedule: Schedule, start: dict[Op, float], lo: float,
           hi: float) -> list[tuple[Op, Op]]:
    """The precedences that keep every op starting outside [lo, hi) in its place: consecutive
    pairs of each rank's program, except pairs of two ops both inside the window."""
    out = []
    for prog in schedule.programs:
        inside = [lo <= start[op] < hi for op in prog]
        run = [i for i, x in enumerate(inside) if x]
        for i in range(len(prog) - 1):
            if not (inside[i] and inside[i + 1]):
                out.append((prog[i], prog[i + 1]))
        if run:
            first, last = run[0], run[-1]
            # the run stays between its neighbours: after the op before it, before the one
            # after it (the pairs above pin only the run's ends)
            for i in run:
                if first > 0:
                    out.append((prog[first - 1], prog[i]))
                if last + 1 < len(prog):
                    out.append((prog[i], prog[last + 1]))
    return out


def improve(problem: Problem, schedule: Schedule, step: float, *, bound: float,
            time_limit: float, seed: int = 0, workers: int = 1,
            work_limit: float | None = None, progress: Progress | None = None) -> Improved:
    """Search windows of `schedule` (whose simulated step is `step`) for `time_limit` seconds
    (and, when given, `work_limit` deterministic seconds: then the result is reproducible),
    stopping early at `bound`."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    frac, spent, windows = 0.25, 0.0, 0
    best, best_step = schedule, step
    while best_step > bound * (1 + 1e-9):
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0.05 or (work_limit is not None and spent + STEP_WORK > work_limit):
            break
        starts = simulate(best, problem.costs, comm=problem.comm).start
        width = frac * best_step
        lo = rng.uniform(-0.1 * width, best_step - 0.9 * width)
        got = solve(problem, hint=best, upper=best_step, time_limit=left, workers=workers,
                    seed=rng.randrange(1 << 30), work_limit=STEP_WORK,
                    chains=chains(problem, best, starts, lo, lo + width))
        spent += STEP_WORK
        windows += 1
        # closed: nothing more in windows this wide; out of time: too wide for the limit
        closed = got.status == "OPTIMAL"
        frac = min(0.6, frac * 1.15) if closed else max(0.06, frac * 0.85)
        if got.schedule is not None and got.step is not None and got.step <= best_step:
            if got.step < best_step and progress is not None:
                progress(time.perf_counter() - t0, got.step, bound)
            best, best_step = got.schedule, got.step
    return Improved(best, best_step, windows)
