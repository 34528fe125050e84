"""Shared helpers of the synthesis tests: the oracles that do not use pipeir's solver.

`brute_force` times every valid combination of per-rank orders with `oracle_step`, a tiny
simulator of its own; `window_orders` does the same for one window of the LNS; the random
costs, runs and timings feed the hypothesis tests of the bounds and the greedy schedulers.
"""

from __future__ import annotations

import itertools
import math
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import strategies as st

import pipeir
from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.search.synth import Problem
from pipeir.search.synth.lns import Window
from pipeir.search.synth.model import Integral
from pipeir.sim import CostModel
from pipeir.sim.engine import Timing
from pipeir.verify import verify

REPO = Path(__file__).parent.parent

#: Uneven stages (stage 1 the heaviest), split backwards and a latency: no order ties by luck
HETERO = CostModel.from_settings({"F": 1.0, "I": 1.5, "W": 0.5, "stage.0.F": 1.5,
                                  "stage.1.F": 2.0, "stage.1.I": 2.5, "stage.1.W": 0.5,
                                  "latency": 0.25})


def orders(problem: Problem, rank: int) -> list[list[Op]]:
    """Every order of a rank's ops in which each op comes after its same-rank inputs."""
    mine = [op for op in problem.ops if problem.rank(op) == rank]
    local = {op: [p for p in problem.preds[op] if problem.rank(p) == rank] for op in mine}
    out: list[list[Op]] = []

    def grow(prefix: list[Op], left: set[Op]) -> None:
        if not left:
            out.append(list(prefix))
            return
        done = set(prefix)
        for op in sorted(left):
            if all(p in done for p in local[op]):
                prefix.append(op)
                grow(prefix, left - {op})
                prefix.pop()
    grow([], set(mine))
    return out


def brute_force(problem: Problem) -> float:
    """The least step over every valid combination of per-rank orders, each timed by
    `oracle_step` (a tiny simulator of its own; the best is checked against pipeir's)."""
    best, arg = float("inf"), None
    limit = problem.memory_limit
    fitting = [[o for o in orders(problem, r)
                if limit is None or held(problem, o) <= limit * (1 + 1e-9)]
               for r in range(problem.config.ranks)]  # memory is each rank's own
    step = oracle_step(problem) if problem.objective == "makespan" else oracle_steady(problem)
    for progs in itertools.product(*fitting):
        got = step(progs)
        if got < best:
            best, arg = got, progs
    if arg is not None:
        s = Schedule.from_programs(problem.config, arg)
        assert problem.fits(s) and problem.step_time(s) == pytest.approx(best, abs=1e-9)
    return best


def held(problem: Problem, order: list[Op]) -> float:
    """The most memory `order` holds, by the rule written out here: a forward takes its
    stage's activation; a B frees it, an I frees all but what W needs (`memory_w_bytes`, in
    bytes or as a fraction of one counted activation), a W that rest."""
    costs, most, live = problem.costs, 0.0, 0.0
    for op in order:
        saved = (costs.activation_memory(op.stage) or 0.0) if problem.memory_bytes else 1.0
        w_bytes = costs.weight_memory(op.stage)
        kept = saved if w_bytes is None else \
            (w_bytes if problem.memory_bytes else w_bytes / (costs.activation_memory(op.stage)
                                                             or 1.0))
        live += {"F": saved, "B": -saved, "I": kept - saved, "W": -kept}[op.kind]
        most = max(most, live)
    return most


def oracle_steady(problem: Problem, steps: int = 60
                  ) -> Callable[[tuple[list[Op], ...]], float]:
    """The time per step of per-rank orders run back to back: the growth of the end of
    `oracle_step`'s steps from `steps` to 2 x `steps` of them (exact once the increments
    repeat, every c steps for c dividing `steps`)."""
    few, many = oracle_step(problem, steps), oracle_step(problem, 2 * steps)

    def step(progs: tuple[list[Op], ...]) -> float:
        return (many(progs) - few(progs)) / steps
    return step


def oracle_step(problem: Problem, steps: int = 1) -> Callable[[tuple[list[Op], ...]], float]:
    """The step time of per-rank orders (inf when they deadlock), written out for these
    instances: each op starts when its rank is free and its inputs are there; a cross-rank
    input arrives the transfer time after its producer ends, and with blocking
    communication the producer's rank is busy until it has (one send per op here). With
    `steps` > 1, when that many steps run back to back end: each rank starts its next step
    once it is free, with nothing else between steps."""
    costs, rank = problem.costs, problem.rank
    dur = {op: costs.cost(op) for op in problem.ops}
    send = dict.fromkeys(problem.ops, 0.0)  # the transfer each op's output makes
    for op, ps in problem.preds.items():
        for q in ps:
            if rank(q) != rank(op):
                assert send[q] == 0.0, "one cross-rank consumer per op"
                send[q] = costs.transfer_time(min(q.stage, op.stage), max(q.stage, op.stage))
    blocking = problem.comm == "blocking"
    # (op, duration, its rank's busy time after it ends, [(input, delay after its end)])
    info = {op: (dur[op], send[op] if blocking else 0.0,
                 [(q, (send[q] if rank(q) != rank(op) else 0.0)) for q in problem.preds[op]])
            for op in problem.ops}

    def step(progs: tuple[list[Op], ...]) -> float:
        free = [0.0] * len(progs)
        for _ in range(steps):
            if not one(progs, free):
                return float("inf")
        return max(free)

    def one(progs: tuple[list[Op], ...], free: list[float]) -> bool:
        end: dict[Op, float] = {}
        at = [0] * len(progs)
        left = sum(map(len, progs))
        while left:
            moved = False
            for r, prog in enumerate(progs):
                while at[r] < len(prog):
                    op = prog[at[r]]
                    d, busy, ins = info[op]
                    t = free[r]
                    for q, h in ins:
                        e = end.get(q)
                        if e is None:
                            break
                        t = max(t, e + h)
                    else:
                        end[op] = t + d
                        free[r] = t + d + busy
                        at[r] += 1
                        left -= 1
                        moved = True
                        continue
                    break
            if not moved:
                return False
        return True
    return step


def window_orders(problem: Problem, progs: list[list[Op]], runs: list[tuple[int, int]]
                   ) -> float:
    """The least simulated step over every reordering of each rank's run [a, b), the rest
    in place, within the memory limit (the oracle for one window)."""
    best = float("inf")
    perms = [itertools.permutations(prog[a:b]) for prog, (a, b) in zip(progs, runs)]
    for choice in itertools.product(*(list(p) for p in perms)):
        new = [[*prog[:a], *run, *prog[b:]] for prog, (a, b), run in zip(progs, runs, choice)]
        s = Schedule.from_programs(problem.config, new)
        timing = Timing(s, problem.costs, problem.comm)
        if timing.complete and problem.fits(s):
            best = min(best, problem.step_time(s))
    return best


def random_costs(data: st.DataObject, stages: int, m: int, every_stage: bool = False
                  ) -> CostModel:
    """Costs in tenths: per kind (F, B, I, W), per stage (F and activation bytes; on some
    stages, or with `every_stage` on all), and on some draws a dearer last micro-batch."""
    tenth = st.integers(1, 30).map(lambda x: x / 10)
    given_: dict[str, float] = {"F": data.draw(tenth), "I": data.draw(tenth),
                                "W": data.draw(tenth), "B": data.draw(tenth),
                                "latency": data.draw(st.integers(0, 10)) / 10,
                                "memory_bytes": 1.0e3}
    for s in range(stages):
        if every_stage or data.draw(st.booleans()):
            given_[f"stage.{s}.F"] = data.draw(tenth)
            given_[f"stage.{s}.memory_bytes"] = data.draw(st.integers(1, 3)) * 1.0e3
    if data.draw(st.booleans(), "per-micro-batch costs"):
        given_[f"mb.{m - 1}.F"] = data.draw(tenth)
    return CostModel.from_settings(given_)


def whole_window(problem: Problem, progs: list[list[Op]], lo: float, hi: float) -> Window:
    iz = Integral(problem)
    timed = iz.times(problem.build(progs))
    assert timed is not None
    f = iz.scale.factor
    return Window(iz, progs, timed.start, timed.order, math.floor(lo * f), math.floor(hi * f))


def random_run(problem: Problem, rng: random.Random) -> Schedule | None:
    """A random schedule that keeps the implied precedences and the budget: ops taken one at
    a time in a random order that runs every producer first (so it cannot deadlock), an F
    only while its activation fits its rank; None at a dead end (the budget is full and no
    release is ready)."""
    before = {op: set(problem.preds[op]) for op in problem.ops}
    for p, q in problem.implied:
        before[q].add(p)
    size = {op: problem.weight(op.stage) for op in problem.ops}
    limit = math.inf if problem.memory_limit is None else problem.memory_limit * (1 + 1e-9)
    live = [0.0] * problem.config.ranks
    done: set[Op] = set()
    progs: list[list[Op]] = [[] for _ in range(problem.config.ranks)]
    while len(done) < len(problem.ops):
        ready = [op for op in problem.ops if op not in done and before[op] <= done
                 and (op.kind != "F" or live[problem.rank(op)] + size[op] <= limit)]
        if not ready:
            return None
        op = rng.choice(ready)
        done.add(op)
        progs[problem.rank(op)].append(op)
        if op.kind == "F":
            live[problem.rank(op)] += size[op]
        elif op == problem.release_op(op.stage, op.mb):
            live[problem.rank(op)] -= size[op]
    return problem.build(progs)


def timed_runs(problem: Problem, rng: random.Random, tries: int
                ) -> Iterator[tuple[Schedule, dict[Op, float], float]]:
    """Up to `tries` random schedules (`random_run`), each with its ops' simulated starts
    and its step."""
    for _ in range(tries):
        run = random_run(problem, rng)
        if run is None:
            continue
        timing = Timing(run, problem.costs, problem.comm)
        times = timing.sweep([problem.costs.cost(op) for op in timing.ops])
        yield run, dict(zip(timing.ops, times.start)), max(times.release)


def fixture_step(problem: Problem, name: str) -> float:
    """The simulated step of a schedule kept in tests/fixtures, after checking that it
    verifies and fits `problem`'s budget (an upper bound on the optimum there)."""
    found = pipeir.parse(REPO / "tests/fixtures" / name)
    verify(found)
    schedule = problem.build(found.programs)
    assert problem.fits(schedule)
    return problem.step_time(schedule)


class Clock:
    """A stand-in for the `time` module of `pipeir.search.synth`: the real clock plus `spent`, the
    seconds a stand-in solver or bound says it used (no sleeping). `first` is the first
    reading, synth's start, so a deadline it sets can be checked exactly: the real time
    that passes in between only makes the readings later, never earlier."""

    def __init__(self) -> None:
        self.spent = 0.0
        self.first: float | None = None

    def perf_counter(self) -> float:
        now = time.perf_counter() + self.spent
        if self.first is None:
            self.first = now
        return now
