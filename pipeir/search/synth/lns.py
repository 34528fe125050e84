"""Large-neighbourhood search around the best schedule: re-solve one time window at a time.

The full model on a few hundred ops improves slowly on two threads (CP-SAT's own neighbourhood
workers get a small share of them), and on thousands it takes seconds just to load. So after
the full model's turn, synthesis keeps the best schedule and repeats:

1. time it and pick a window of the step, [a, a + w), at random (`seed`);
2. on every rank, the ops that start inside the window are a run of its program; they may be
   reordered and retimed, every other op keeps its place on its rank;
3. solve a model of the window alone (`Window`), with the current order as the hint and a
   short deterministic limit, and keep the result when its simulated step is no worse.

NOTE (why the window's model is small and exact). Ops that start before the window
(the prefix) depend only on ops before them, so their times are constants: they give each
window op a release time. Ops that start after it (the suffix) keep their order on their
ranks, and no suffix op feeds a window op, so the step is max(C, max over window ops w of
end(w) + L(w)): L(w) is the longest path from w's end through the suffix (data edges, and
program order, where every window op precedes its rank's first suffix op), C the longest path
that avoids the window. Memory, counted in program order per rank, changes only inside the
window: before and after it a rank holds the same activations whatever the window's order.
So the model has only the window's ops, whatever the size of the step, and its optimum is the
best step over every order of the window (ops of zero duration aside: see `model.in_order`).

The window grows after one whose model was solved to the end (windows that size are cheap)
and shrinks after any other (out of time, or nothing usable). Every schedule kept is verified
complete, within the memory limit and simulated, so the step can only go down; the bound is
not touched (a neighbourhood proves nothing about the whole problem).
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass

from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.search.synth.cpsat import cp_model
from pipeir.search.synth.model import Integral, Progress, in_order, minimize, run
from pipeir.search.synth.problem import Problem

#: Deterministic seconds one neighbourhood may take.
STEP_WORK = 0.1

#: The number of ops a window starts at, and the range it adapts in.
WINDOW_OPS, LEAST_OPS, MOST_OPS = 120, 16, 320


@dataclass(frozen=True)
class Improved:
    """The best schedule after the search, its simulated step and how many windows ran."""

    schedule: Schedule
    step: float
    windows: int


class Window:
    """The model of one window [lo, hi) of `programs` (integer times `start`, topological
    `order`): its ops' starts are the variables, the rest of the step is constants and
    longest paths (see the module's NOTE)."""

    def __init__(self, iz: Integral, programs: list[list[Op]], start: dict[Op, int],
                 order: list[Op], lo: int, hi: int):
        self.iz, self.programs = iz, programs
        problem, occ = iz.problem, iz.occ
        self.runs: list[tuple[int, int]] = []  # per rank: the window's run [a, b)
        for prog in programs:
            inside = [i for i, op in enumerate(prog) if lo <= start[op] < hi]
            a = inside[0] if inside else sum(start[op] < lo for op in prog)
            self.runs.append((a, inside[-1] + 1 if inside else a))
        where: dict[Op, str] = {}
        for prog, (a, b) in zip(programs, self.runs):
            where.update({op: "P" for op in prog[:a]})
            where.update({op: "W" for op in prog[a:b]})
            where.update({op: "Q" for op in prog[b:]})
        self.ops = [op for prog, (a, b) in zip(programs, self.runs) for op in prog[a:b]]
        end = {op: start[op] + occ[op] for op, w in where.items() if w == "P"}
        rank_free = [end[prog[a - 1]] if a else 0 for prog, (a, _) in zip(programs, self.runs)]
        # the longest path after each suffix op's end, through the suffix only
        first_q = {r: prog[b] for r, (prog, (_, b)) in enumerate(zip(programs, self.runs))
                   if b < len(prog)}
        nxt = {prog[i]: prog[i + 1] for prog, (_, b) in zip(programs, self.runs)
               for i in range(b, len(prog) - 1)}
        after: dict[Op, int] = {}
        for op in reversed(order):
            if where[op] != "Q":
                continue
            best = 0
            for q, d in iz.succs[op]:
                best = max(best, d + occ[q] + after[q])
            if op in nxt:
                best = max(best, occ[nxt[op]] + after[nxt[op]])
            after[op] = best
        self.tail: dict[Op, int] = {}
        for w in self.ops:
            best = 0
            for q, d in iz.succs[w]:
                if where[q] == "Q":
                    best = max(best, d + occ[q] + after[q])
            nq = first_q.get(problem.rank(w))
            if nq is not None:
                best = max(best, occ[nq] + after[nq])
            self.tail[w] = best
        # C: the step's paths that avoid the window
        const = max(end.values(), default=0)
        has_window = {problem.rank(w) for w in self.ops}
        for r, q in first_q.items():
            if r not in has_window:
                const = max(const, rank_free[r] + occ[q] + after[q])
        for op in after:
            ready = max((end[p] + d for p, d in iz.preds[op] if where[p] == "P"), default=None)
            if ready is not None:
                const = max(const, ready + occ[op] + after[op])
        self.const = const
        self.release = {w: max([rank_free[problem.rank(w)],
                                *(end[p] + d for p, d in iz.preds[w] if where[p] == "P")])
                        for w in self.ops}
        self.where, self.start = where, start
        # NOTE: the implied precedences (`Problem.implied`: each stage's ops of one kind in
        # micro-batch order, and what that means under memory) lose nothing only when the
        # rest of the step already keeps that order (then relabelling, as in `model`,
        # permutes the window's ops alone); a warm start given by the user may not
        seen: dict[tuple[str, int], int] = {}
        self.in_mb_order = problem.mb_uniform
        for op in (op for prog in programs for op in prog):
            key = (op.kind, op.stage)
            self.in_mb_order = self.in_mb_order and seen.get(key, -1) < op.mb
            seen[key] = op.mb

    @property
    def current(self) -> int:
        """The step of the current order, in the model's units."""
        return max([self.const, *(self.start[w] + self.iz.occ[w] + self.tail[w]
                                  for w in self.ops)])

    def solve(self, *, time_limit: float, work_limit: float, workers: int, seed: int
              ) -> tuple[list[list[Op]], bool] | None:
        """The best order of the window found (the whole programs), and whether it is proven
        best; None if the solver found nothing."""
        iz, problem, occ = self.iz, self.iz.problem, self.iz.occ
        horizon = self.current
        m = cp_model.CpModel()
        s = {w: m.new_int_var(self.release[w], max(self.release[w],
                                                   horizon - occ[w] - self.tail[w]), "")
             for w in self.ops}
        by_rank: dict[int, list[Op]] = defaultdict(list)
        for w in self.ops:
            by_rank[problem.rank(w)].append(w)
        for ws in by_rank.values():
            m.add_no_overlap([m.new_fixed_size_interval_var(s[w], occ[w], "") for w in ws])
        for w in self.ops:
            for p, d in iz.preds[w]:
                if p in s:
                    m.add(s[w] >= s[p] + occ[p] + d)
            for p in iz.implied_preds[w] if self.in_mb_order else ():
                if p in s:
                    m.add(s[w] >= s[p] + occ[p])
        self._memory(m, s, horizon)
        span = m.new_int_var(self.const, horizon, "")
        finish = {r: m.new_int_var(0, horizon, "") for r in by_rank}
        for w in self.ops:
            m.add(finish[problem.rank(w)] >= s[w] + occ[w] + self.tail[w])
        for f in finish.values():
            m.add(span >= f)
        minimize(m, span, list(finish.values()), horizon)
        for w in self.ops:
            m.add_hint(s[w], self.start[w])
        solver, status = run(m, time_limit, workers, seed, work_limit)
        if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return None
        at = {w: solver.value(s[w]) for w in self.ops}
        runs = in_order(problem, [prog[a:b] for prog, (a, b) in zip(self.programs, self.runs)],
                        at, occ)
        progs = [[*prog[:a], *run, *prog[b:]]
                 for prog, (a, b), run in zip(self.programs, self.runs, runs)]
        return progs, status == cp_model.OPTIMAL

    def _memory(self, m: cp_model.CpModel, s: dict[Op, cp_model.IntVar], horizon: int) -> None:
        """Each rank's live activations inside the window, under the limit less what stays
        live across it."""
        problem, occ = self.iz.problem, self.iz.occ
        if problem.memory_limit is None:
            return
        c = problem.config
        ranks = {problem.rank(w) for w in self.ops}
        for r in ranks:
            free, alive, need = self.iz.cap, [], []
            for st, mb in ((st, mb) for st in c.stages_of(r) for mb in range(c.microbatches)):
                f = Op("F", st, mb)
                for rel, demand in self.iz.parts[st, mb]:  # (each part its own interval)
                    wf, wr = self.where[f], self.where[rel]
                    if wf == "P" and wr == "Q":
                        free -= demand
                        continue
                    if wf == "W" and wr == "W":
                        size = m.new_int_var(0, horizon, "")
                        alive.append(m.new_interval_var(s[f], size, s[rel] + occ[rel], ""))
                    elif wf == "W":
                        alive.append(m.new_interval_var(s[f], horizon - s[f], horizon, ""))
                    elif wf == "P" and wr == "W":
                        e = s[rel] + occ[rel]
                        alive.append(m.new_interval_var(0, e, e, ""))
                    else:
                        continue
                    need.append(demand)
            if sum(need) > free:
                m.add_cumulative(alive, need, free)


def improve(problem: Problem, schedule: Schedule, step: float, *, bound: float,
            time_limit: float, seed: int = 0, workers: int = 1,
            work_limit: float | None = None, progress: Progress | None = None) -> Improved:
    """Search windows of `schedule` (whose simulated step is `step`) for `time_limit` seconds
    (and, when given, `work_limit` deterministic seconds: then the result is reproducible),
    stopping early at `bound`."""
    t0 = time.perf_counter()
    rng = random.Random(seed)
    iz = Integral(problem)
    n = len(problem.ops)
    size, spent, windows = min(WINDOW_OPS, n / 4), 0.0, 0
    best, best_step = schedule, step
    programs = [list(p) for p in schedule.programs]
    timed = iz.times(schedule)
    while timed is not None and best_step > bound * (1 + 1e-9):
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0.05 or (work_limit is not None and spent + STEP_WORK > work_limit):
            break
        span = max(timed.start[op] + iz.occ[op] for op in timed.order)
        width = size / n * span
        lo = rng.uniform(-0.1 * width, span - 0.9 * width)
        window = Window(iz, programs, timed.start, timed.order, math.floor(lo),
                        math.floor(lo + width))
        got = window.solve(time_limit=left, work_limit=STEP_WORK, workers=workers,
                           seed=rng.randrange(1 << 30)) if window.ops else None
        spent += STEP_WORK
        windows += 1
        # closed: windows this wide are cheap; otherwise too wide for the limit
        closed = got is not None and got[1]
        size = min(MOST_OPS, size * 1.15) if closed else max(LEAST_OPS, size * 0.85)
        if got is None or got[0] == programs:
            continue
        sched = problem.build(got[0], schedule.name)
        new = iz.times(sched)
        if new is None or not problem.fits(sched):
            continue
        # NOTE: a window's model minimises the makespan; back to back (`steady`), a window
        # is kept when the steady step it gives is no worse
        step = new.step if problem.objective == "makespan" else problem.step_time(sched)
        if step > best_step:
            continue
        if step < best_step and progress is not None:
            progress(time.perf_counter() - t0, step, bound)
        best, best_step, programs, timed = sched, step, got[0], new
    return Improved(best, best_step, windows)
