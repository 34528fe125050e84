"""Schedule synthesis: optimal on tiny instances (brute force over every valid order), on the
closed forms (1F1B, ZB-H1), agreeing with the simulator; the CLI, the pass and bad input.

Solver runs here are small (tens of ops) and single-threaded, so they are fast and
deterministic."""

from __future__ import annotations

import itertools
import math
import random
import re
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import pipeir
from pipeir.config import PipelineConfig
from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.search.synth import EXACT_OPS, Problem, _shapes, make_problem, synth, synthesize
from pipeir.search.synth.decompose import extend, short_problem
from pipeir.search.synth.greedy import greedy, reserve, variants, waves
from pipeir.search.synth.lns import Window, improve
from pipeir.search.synth.model import Integral, choose_scale, probe, solve
from pipeir.search.synth.problem import (
    _chain_work,
    _jackson,
    _memory_idle,
    _work_before,
    longest_paths,
)
from pipeir.search.synth.warmstart import Start, library, sequential, starts
from pipeir.search.synth.zb_greedy import zb_greedy
from pipeir.sim import CostModel, simulate
from pipeir.sim.engine import Timing
from pipeir.verify import live_activations, verify

REPO = Path(__file__).parent.parent
HETERO = CostModel.from_settings({"F": 1.0, "I": 1.5, "W": 0.5, "stage.0.F": 1.5,
                                  "stage.1.F": 2.0, "stage.1.I": 2.5, "stage.1.W": 0.5,
                                  "latency": 0.25})


def _orders(problem: Problem, rank: int) -> list[list[Op]]:
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
    `_step` (a tiny simulator of its own; the best is checked against pipeir's)."""
    best, arg = float("inf"), None
    limit = problem.memory_limit
    fitting = [[o for o in _orders(problem, r)
                if limit is None or max(x for _, x in live_activations(
                    o, lambda op: problem.weight(op.stage))) <= limit * (1 + 1e-9)]
               for r in range(problem.config.ranks)]  # memory is each rank's own
    step = _step(problem)
    for progs in itertools.product(*fitting):
        got = step(progs)
        if got < best:
            best, arg = got, progs
    if arg is not None:
        s = Schedule.from_programs(problem.config, arg)
        assert problem.fits(s) and problem.step_time(s) == pytest.approx(best, abs=1e-9)
    return best


def _step(problem: Problem) -> Callable[[tuple[list[Op], ...]], float]:
    """The step time of per-rank orders (inf when they deadlock), written out for these
    instances: each op starts when its rank is free and its inputs are there; a cross-rank
    input arrives the transfer time after its producer ends, and with blocking
    communication the producer's rank is busy until it has (one send per op here)."""
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
        end: dict[Op, float] = {}
        free = [0.0] * len(progs)
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
                return float("inf")
        return max(free)
    return step


@pytest.mark.parametrize(("m", "split", "limit", "comm"), [
    (2, False, None, "overlapped"), (3, False, None, "overlapped"), (3, False, 1, "overlapped"),
    (3, False, 2, "blocking"), (2, True, None, "overlapped"), (2, True, 1, "blocking"),
])
def test_optimal_on_every_order_of_two_ranks(m: int, split: bool, limit: int | None,
                                             comm: str) -> None:
    problem = Problem(PipelineConfig.make(2, m), HETERO, split, comm,  # type: ignore[arg-type]
                      None if limit is None else float(limit))
    want = brute_force(problem)
    got = synthesize(problem, time_limit=20, workers=1)
    assert got.optimal and got.gap == 0
    assert got.step == pytest.approx(want, abs=1e-9)
    verify(got.schedule)
    assert problem.fits(got.schedule)


@pytest.mark.parametrize("split", [False, True])
def test_fractional_byte_budgets_are_exact(split: bool) -> None:
    """Activations of a third of 1000 bytes and a budget of exactly two of them: from one
    micro-batch at a time, the full model and the window search each find the best of every
    order that fits (the brute force); rounding sizes up in the models once admitted one."""
    third = CostModel.from_settings({**HETERO.settings(), "memory_bytes": 1000 / 3})
    problem = make_problem(third, 2, 3, split=split, memory_bytes=2 * 1000 / 3)
    want = brute_force(problem)
    assert want < brute_force(make_problem(third, 2, 3, split=split, memory_limit=1))
    start = sequential(problem)
    slow = problem.step_time(start)
    assert slow > want
    solved = solve(problem, hint=start, upper=slow, time_limit=20)
    assert solved.optimal and solved.schedule is not None and problem.fits(solved.schedule)
    assert solved.step == pytest.approx(want, abs=1e-9)
    found = improve(problem, start, slow, bound=want, time_limit=20, seed=0)
    assert found.step == pytest.approx(want, abs=1e-9) and problem.fits(found.schedule)


@pytest.mark.parametrize(("m", "split", "limit", "comm"), [
    (3, False, 1, "overlapped"), (2, True, None, "overlapped"), (2, True, 1, "blocking"),
])
def test_probe_meets_the_optimum_and_proves_nothing_is_faster(m: int, split: bool,
                                                              limit: int | None,
                                                              comm: str) -> None:
    """Asked for the best step of every order (the brute force), the probe finds a schedule
    with it; asked for one unit less, it proves there is none and raises the bound to it."""
    problem = Problem(PipelineConfig.make(2, m), HETERO, split, comm,  # type: ignore[arg-type]
                      None if limit is None else float(limit))
    want = brute_force(problem)
    unit = 1 / Integral(problem).scale.factor
    found = probe(problem, want, time_limit=20)
    assert found.schedule is not None and found.step == pytest.approx(want, abs=1e-9)
    verify(found.schedule)
    assert problem.fits(found.schedule)
    below = probe(problem, want - unit, time_limit=20)
    assert below.schedule is None and below.status == "INFEASIBLE"
    assert below.bound == pytest.approx(want, abs=1e-9)
    assert probe(problem, problem.lower_bound() - unit, time_limit=20).bound == \
        pytest.approx(problem.lower_bound(), abs=1e-9)  # below the bound: nothing to solve


def test_shapes_add_the_other_placement_of_tunes_v_while_it_is_small() -> None:
    """At compute-bound's 64 activations (eight whole stages' memory at eight chunks) tune's
    best is an eight-chunk loop; synth also searches the eight-chunk V (where the bound is
    met), but not where the model would be too large to solve, and never a placement the
    user excluded."""
    costs = CostModel.load(REPO / "examples/costs/compute-bound.toml")
    candidates = library(costs, 4, 8, "overlapped", 8)
    shapes = _shapes(candidates, 4, None, "search", 64, 96)
    assert {(8, "loop"), (8, "vshape"), (4, "vshape")} <= set(shapes)
    assert all(shape == "loop" for _, shape in _shapes(candidates, 4, None, "loop", 64, 96))
    assert _shapes(candidates, 4, None, "search", 64, EXACT_OPS) == \
        [(1, "loop"), (2, "loop"), (2, "vshape"), (8, "loop")]


@pytest.mark.parametrize(("p", "m"), [(3, 4), (4, 6)])
def test_closed_forms_1f1b_and_zb_h1(p: int, m: int) -> None:
    """At 1F1B's memory with F = 1, B = 2 the best step is 1F1B's, (m + p - 1)(F + B); split
    into I = W = 1 it is ZB-H1's, m(F + I + W) + (p - 1)(F + I - W)."""
    costs = CostModel()
    fb = synthesize(make_problem(costs, p, m, memory_limit=p), time_limit=20)
    assert fb.step == (m + p - 1) * 3 and fb.optimal
    zb = synthesize(make_problem(costs, p, m, split=True, memory_limit=p), time_limit=20)
    assert zb.step == 3 * m + (p - 1) and zb.optimal
    assert max(verify(zb.schedule).peak_activations) <= p


@pytest.mark.parametrize("comm", ["overlapped", "blocking"])
def test_model_objective_is_the_simulated_step(comm: str) -> None:
    problem = make_problem(HETERO, 2, 4, split=True, comm=comm, memory_limit=2)  # type: ignore[arg-type]
    warm = starts(problem)[0]
    solved = solve(problem, hint=warm.schedule, upper=warm.step, time_limit=20)
    assert solved.optimal and solved.schedule is not None
    assert solved.step == pytest.approx(solved.objective, abs=1e-9)
    assert simulate(solved.schedule, problem.costs, comm=comm).makespan == solved.step


def test_any_solution_simulates_no_slower_than_the_model_says() -> None:
    problem = make_problem(HETERO, 3, 6, split=True, memory_limit=3)
    solved = solve(problem, time_limit=1, workers=1, work_limit=0.05)
    assert solved.schedule is not None and solved.objective is not None and solved.step is not None
    assert solved.step <= solved.objective + 1e-9


def _window_orders(problem: Problem, progs: list[list[Op]], runs: list[tuple[int, int]]
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


@pytest.mark.parametrize(("comm", "limit", "m", "seq", "lo", "width"), [
    ("overlapped", None, 5, True, 6.0, 6.0), ("overlapped", 3, 5, True, 6.0, 6.0),
    ("blocking", 2, 5, True, 6.0, 6.0), ("overlapped", None, 5, False, 3.0, 5.0),
    ("overlapped", 3, 6, False, 16.0, 4.0), ("blocking", 2, 6, False, 5.0, 7.0),
])
def test_window_model_finds_the_best_order_of_the_window(comm: str, limit: int | None, m: int,
                                                         seq: bool, lo: float, width: float
                                                         ) -> None:
    """Against every order of the window's runs, simulated: from one micro-batch at a time
    (the window can gain), from the best warm start (it may not), and where the memory limit
    rules out the order that would be fastest without it (the last two)."""
    problem = make_problem(HETERO, 3, m, split=True, comm=comm,  # type: ignore[arg-type]
                           memory_limit=limit)
    warm = sequential(problem) if seq else starts(problem)[0].schedule
    iz = Integral(problem)
    progs = [list(p) for p in warm.programs]
    timed = iz.times(problem.build(progs))
    assert timed is not None
    start, order = timed.start, timed.order
    f = iz.scale.factor
    window = Window(iz, progs, start, order, int(lo * f), int((lo + width) * f))
    assert window.current == round(problem.step_time(warm) * f)
    assert 4 <= len(window.ops) <= 10
    want = _window_orders(problem, progs, window.runs)
    if seq:
        assert want < problem.step_time(warm)
    if m == 6:
        free = make_problem(HETERO, 3, m, split=True, comm=comm)  # type: ignore[arg-type]
        assert _window_orders(free, progs, window.runs) < want
    got = window.solve(time_limit=20, work_limit=20, workers=1, seed=0)
    assert got is not None and got[1]  # closed
    for old, new, (a, b) in zip(progs, got[0], window.runs):
        assert new[:a] == old[:a] and new[b:] == old[b:]
        assert sorted(new[a:b]) == sorted(old[a:b])
    sched = problem.build(got[0])
    assert problem.fits(sched)
    assert problem.step_time(sched) == pytest.approx(want, abs=1e-9)


def _random_costs(data: st.DataObject, stages: int, m: int, every_stage: bool = False
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


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_window_model_is_exact_on_random_problems(data: st.DataObject) -> None:
    """Random costs (per stage and per micro-batch), communication, budgets in count or
    bytes, start orders and windows: the window's model finds the best of every reordering
    of the window, simulated."""
    p = data.draw(st.integers(2, 3), "ranks")
    m = data.draw(st.integers(2, 4), "microbatches")
    split = data.draw(st.booleans(), "split")
    costs = _random_costs(data, p, m)
    comm = data.draw(st.sampled_from(["overlapped", "blocking"]), "comm")
    unit = data.draw(st.sampled_from(["count", "bytes", "none"]), "budget")
    if unit == "count":
        problem = make_problem(costs, p, m, split=split, comm=comm,  # type: ignore[arg-type]
                               memory_limit=data.draw(st.integers(1, p)))
    elif unit == "bytes":
        least = max(costs.activation_memory(s) or 0.0 for s in range(p))
        problem = make_problem(costs, p, m, split=split, comm=comm,  # type: ignore[arg-type]
                               memory_bytes=least * data.draw(st.integers(1, 3)))
    else:
        problem = make_problem(costs, p, m, split=split, comm=comm)  # type: ignore[arg-type]
    warm = sequential(problem) if data.draw(st.booleans(), "sequential start") \
        else starts(problem)[0].schedule
    iz = Integral(problem)
    progs = [list(x) for x in warm.programs]
    timed = iz.times(problem.build(progs))
    assert timed is not None
    start, order = timed.start, timed.order
    span = max(start[op] + iz.occ[op] for op in order)
    lo = data.draw(st.integers(0, span), "lo")
    window = Window(iz, progs, start, order, lo, lo + data.draw(st.integers(1, span), "width"))
    assert window.current == round(problem.step_time(warm) * iz.scale.factor)
    orders = 1
    for a, b in window.runs:
        orders *= math.factorial(b - a)
    assume(window.ops and orders <= 1500)
    got = window.solve(time_limit=20, work_limit=20, workers=1, seed=0)
    assert got is not None and got[1]
    for old, new, (a, b) in zip(progs, got[0], window.runs):
        assert new[:a] == old[:a] and new[b:] == old[b:]
    sched = problem.build(got[0])
    assert problem.fits(sched)
    assert problem.step_time(sched) == pytest.approx(_window_orders(problem, progs, window.runs),
                                                     abs=1e-9)


def _whole_window(problem: Problem, progs: list[list[Op]], lo: float, hi: float) -> Window:
    iz = Integral(problem)
    timed = iz.times(problem.build(progs))
    assert timed is not None
    f = iz.scale.factor
    return Window(iz, progs, timed.start, timed.order, math.floor(lo * f), math.floor(hi * f))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_lower_bound_is_no_more_than_the_best_of_every_order(data: st.DataObject) -> None:
    """The bound (chain, Jackson with the implied precedences, the idle memory forces) on
    random costs (per stage and per micro-batch), communication, one stage per rank or two
    in a V, budgets in count or bytes: never above the best step of every valid order."""
    v = data.draw(st.sampled_from([1, 2]), "chunks")
    m = 2 if v == 2 else data.draw(st.integers(2, 3), "microbatches")
    split = v == 1 and m == 2 and data.draw(st.booleans(), "split")
    costs = _random_costs(data, 2, m, every_stage=True)
    comm = data.draw(st.sampled_from(["overlapped", "blocking"]), "comm")
    unit = data.draw(st.sampled_from(["count", "bytes"] + (["none"] if v == 1 else [])))
    shape = "vshape" if v == 2 else "loop"
    kw: dict[str, float] = {}
    if unit == "count":  # with two chunks, tight budgets only: the others take minutes
        kw["memory_limit"] = data.draw(st.integers(1, m if v == 1 else 1))
    elif unit == "bytes":
        least = make_problem(costs, 2, m, v, shape, split, memory_bytes=1.0).least_memory
        kw["memory_bytes"] = least * data.draw(st.sampled_from([1.0, 1.5, 2.0][:3 - 2 * (v - 1)]))
    problem = make_problem(costs, 2, m, v, shape, split, comm, **kw)  # type: ignore[arg-type]
    want = brute_force(problem)
    assume(want < float("inf"))
    assert problem.lower_bound() <= want + 1e-9


def _random_run(problem: Problem, rng: random.Random) -> Schedule | None:
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


def _timed_runs(problem: Problem, rng: random.Random, tries: int
                ) -> Iterator[tuple[Schedule, dict[Op, float], float]]:
    """Up to `tries` random schedules (`_random_run`), each with its ops' simulated starts
    and its step."""
    for _ in range(tries):
        run = _random_run(problem, rng)
        if run is None:
            continue
        timing = Timing(run, problem.costs, problem.comm)
        times = timing.sweep([problem.costs.cost(op) for op in timing.ops])
        yield run, dict(zip(timing.ops, times.start)), max(times.release)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_heads_and_tails_hold_in_every_schedule(data: st.DataObject) -> None:
    """The heads and tails every bound stands on, raised by the ranks' capacity: in random
    schedules that keep the implied order and the budget, simulated, no op starts before its
    head and none ends later than its tail allows."""
    v = data.draw(st.sampled_from([1, 2]), "chunks")
    p = 2 if v == 2 else data.draw(st.integers(2, 3), "ranks")
    m = data.draw(st.integers(2, 4), "microbatches")
    split = data.draw(st.booleans(), "split")
    costs = _random_costs(data, p, m, every_stage=True)
    comm = data.draw(st.sampled_from(["overlapped", "blocking"]), "comm")
    shape = data.draw(st.sampled_from(["loop", "vshape"]), "shape") if v == 2 else "loop"
    limit = data.draw(st.sampled_from([None, 1, 2]), "budget")
    problem = make_problem(costs, p, m, v, shape, split, comm,  # type: ignore[arg-type]
                           memory_limit=limit)
    head, tail = problem.heads_tails
    occ = problem.occupation
    for _, start, step in _timed_runs(problem, data.draw(st.randoms(use_true_random=False)), 20):
        for op, at in start.items():
            assert at >= head[op] - 1e-9, op
            assert at + occ[op] + tail[op] <= step + 1e-9, op


def test_memory_idle_and_sharper_heads_raise_the_bound() -> None:
    """Two chunks per rank in a V, one micro-batch's worth of memory: until the first
    release a rank can only run forwards, and the budget runs out before a backward is
    ready. On longest-path heads the memory idle says so (above Jackson's); heads that count
    each rank's capacity and budget (a forward waits for releases) raise the bound again,
    and it still holds."""
    costs = CostModel.from_settings({"F": 1.0, "I": 1.0, "W": 1.0, "stage.0.F": 2.0,
                                     "stage.1.F": 2.0, "latency": 0.25})
    problem = make_problem(costs, 2, 2, 2, "vshape", comm="blocking", memory_limit=2)
    occ = problem.occupation
    head, tail = longest_paths(problem.ops, [*problem.edges,
                                             *((p, q, 0.0) for p, q in problem.implied)], occ)
    mine = [[op for op in problem.ops if problem.rank(op) == r] for r in range(2)]
    jackson = max(_jackson(ops, head, occ, tail) for ops in mine)
    idle = max(_memory_idle(problem, ops, head, occ, tail) for ops in mine)
    assert jackson < idle < problem.lower_bound() <= brute_force(problem)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_chain_work_is_the_best_choice_of_chain_prefixes(data: st.DataObject) -> None:
    """The knapsack behind the memory idle on ranks with several chunks: the most work of at
    most `cap` forwards, each micro-batch's a prefix of its chain in stage order, equals the
    best over every choice of prefix lengths (enumerated), in ints and in floats."""
    whole = data.draw(st.booleans(), "ints")
    work = st.integers(0, 9) if whole else st.integers(0, 90).map(lambda x: x / 10)
    chains = [data.draw(st.permutations([(s, data.draw(work)) for s in
                                         data.draw(st.sets(st.integers(0, 7), max_size=4))]))
              for _ in range(data.draw(st.integers(0, 4), "micro-batches"))]
    cap = data.draw(st.integers(0, 10), "cap")
    ordered = [sorted(c) for c in chains]
    best = max(sum(sum(x for _, x in c[:k]) for c, k in zip(ordered, ks))
               for ks in itertools.product(*(range(len(c) + 1) for c in ordered))
               if sum(ks) <= cap)
    got = _chain_work(chains, cap, 0 if whole else 0.0)
    assert type(got) is (int if whole else float)
    assert got == pytest.approx(best, abs=1e-9)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_work_before_bounds_what_every_schedule_does(data: st.DataObject) -> None:
    """What the memory idle stands on: in random schedules (that keep the implied order and
    the budget; two to four chunks per rank in a loop or a V, so a micro-batch's forwards
    chain on every rank), simulated, a rank that has started c forwards by a time t has done
    no more work by t than `_work_before(t, ..., c)` allows."""
    v = data.draw(st.integers(2, 4), "chunks")
    m = data.draw(st.integers(2, 4), "microbatches")
    split = data.draw(st.booleans(), "split")
    costs = _random_costs(data, 2, m, every_stage=True)
    shape = data.draw(st.sampled_from(["loop", "vshape"]), "shape")
    problem = make_problem(costs, 2, m, v, shape, split,  # type: ignore[arg-type]
                           memory_limit=data.draw(st.sampled_from([None, 1, 2]), "budget"))
    head, _ = problem.heads_tails
    occ = problem.occupation
    ranked = {r: sorted(((op, op.kind == "F") for op in problem.ops if problem.rank(op) == r),
                        key=lambda x: head[x[0]]) for r in range(2)}
    for run, start, _ in _timed_runs(problem, data.draw(st.randoms(use_true_random=False)), 10):
        for r, prog in enumerate(run.programs):
            for t in {x for op in prog for x in (start[op], start[op] + occ[op])}:
                done = sum(min(occ[op], max(0.0, t - start[op])) for op in prog)
                fs = sum(op.kind == "F" and start[op] < t for op in prog)
                assert done <= _work_before(t, ranked[r], head, occ, fs) + 1e-9, (r, t)


def _fixture_step(problem: Problem, name: str) -> float:
    """The simulated step of a schedule kept in tests/fixtures, after checking that it
    verifies and fits `problem`'s budget (an upper bound on the optimum there)."""
    found = pipeir.parse(REPO / "tests/fixtures" / name)
    verify(found)
    schedule = problem.build(found.programs)
    assert problem.fits(schedule)
    return problem.step_time(schedule)


def test_chains_raise_the_bound_on_heavy_ends_four_chunk_v() -> None:
    """Heavy-ends at p = 4, m = 8 in a four-chunk V at K = 4 (sixteen activations of a
    chunk). Rank 3 holds stages 3, 4, 11 and 12; the forward of one micro-batch through all
    sixteen stages takes 4 x 0.325 + 8 x 0.25 + 4 x 0.45 = 5.1 plus 12 transfers of 0.1, and
    the first backward reaches rank 3 (I of stage 12) after three more input gradients of
    0.5 and three transfers: at 8.1. Until then the rank runs only forwards, each
    micro-batch's in stage order, at most sixteen: three whole chains (1.275 each) and four
    first chunks (0.325) are the most work, 5.125. So it idles 8.1 - 5.125 = 2.975 and runs
    27.6 of work: no schedule beats 30.575 (counting the sixteen largest forwards instead,
    6.2 of work, the bound was 30.3). The best schedule known (the fixture, 30.6) is one
    time unit above it, and any change that raises the bound above that is wrong."""
    costs = CostModel.load(REPO / "examples/costs/heavy-ends.toml")
    problem = make_problem(costs, 4, 8, 4, "vshape", split=True, memory_limit=16)
    load = sum(problem.occupation[op] for op in problem.ops if problem.rank(op) == 3)
    assert load == pytest.approx(27.6)
    assert problem.lower_bound() == pytest.approx(load + 8.1 - (3 * 1.275 + 4 * 0.325))
    step = _fixture_step(problem, "heavy-ends-k4.sched")
    assert step == pytest.approx(30.6, abs=1e-9)
    assert problem.lower_bound() <= step


def test_bound_is_met_by_a_schedule_found_on_compute_bound_at_k4() -> None:
    """The bound on a bench shape (384 ops: sharpened heads and tails, the memory idle) is
    the optimum there: a schedule a variant of the window search once found meets it (synth
    now reaches it too, from the list scheduler's warm start that lets early ranks take more:
    `bench/synth.py`). Any change that raises the bound above it is wrong."""
    costs = CostModel.load(REPO / "examples/costs/compute-bound.toml")
    problem = make_problem(costs, 4, 8, 4, "vshape", split=True, memory_limit=16)
    step = _fixture_step(problem, "compute-bound-k4.sched")
    assert step == pytest.approx(101.075, abs=1e-9)
    assert problem.lower_bound() == pytest.approx(step, abs=1e-9)


def test_window_model_is_exact_when_the_order_is_not_in_microbatch_order() -> None:
    """Taking a stage's ops in micro-batch order is safe only when the rest of the step does
    too; a user's warm start may not."""
    problem = make_problem(CostModel.from_settings({"F": 1.0, "B": 2.0}), 2, 2)
    f, b = (lambda s, m: Op("F", s, m)), (lambda s, m: Op("B", s, m))
    progs = [[f(0, 1), f(0, 0), b(0, 0), b(0, 1)], [f(1, 0), f(1, 1), b(1, 0), b(1, 1)]]
    window = _whole_window(problem, progs, 2.0, 7.0)
    want = _window_orders(problem, progs, window.runs)
    got = window.solve(time_limit=10, work_limit=10, workers=1, seed=0)
    assert got is not None and got[1]
    assert problem.step_time(problem.build(got[0])) == want == 9.0 < window.current


def test_zero_duration_ops_never_give_a_deadlocking_order() -> None:
    problem = make_problem(CostModel.from_settings({"F": 1.0, "B": 0.0}), 2, 2, v=2,
                           placement="vshape")
    seq = sequential(problem)
    got = _whole_window(problem, [list(p) for p in seq.programs], -1.0, 1e6).solve(
        time_limit=10, work_limit=10, workers=1, seed=0)
    assert got is not None
    assert Timing(problem.build(got[0]), problem.costs, problem.comm).complete
    solved = solve(problem, hint=seq, upper=problem.step_time(seq), time_limit=10)
    assert solved.schedule is not None
    verify(solved.schedule)


def test_long_steps_at_a_fine_scale_do_not_overflow_the_solver() -> None:
    problem = make_problem(CostModel.from_settings({"F": 1000 / 3, "B": 2000 / 3}), 2, 3)
    seq = sequential(problem)
    got = _whole_window(problem, [list(p) for p in seq.programs], -1.0, 1e6).solve(
        time_limit=10, work_limit=10, workers=1, seed=0)
    assert got is not None
    assert problem.step_time(problem.build(got[0])) == pytest.approx(4000)
    solved = solve(problem, hint=seq, upper=problem.step_time(seq), time_limit=10)
    assert solved.status == "OPTIMAL" and solved.step == pytest.approx(4000)


def test_window_search_never_worsens_and_emits_what_it_reports() -> None:
    problem = make_problem(HETERO, 3, 6, split=True, memory_limit=3)
    warm = starts(problem)[0]
    got = improve(problem, warm.schedule, warm.step, bound=problem.lower_bound(),
                  time_limit=10, work_limit=2.0)
    assert got.windows > 0 and got.step <= warm.step
    verify(got.schedule)
    assert problem.fits(got.schedule)
    assert simulate(got.schedule, problem.costs).makespan == got.step
    again = improve(problem, warm.schedule, warm.step, bound=problem.lower_bound(),
                    time_limit=10, work_limit=2.0)
    assert again.schedule.programs == got.schedule.programs  # reproducible with a work limit


def test_scale_is_exact_for_decimal_costs_and_rounds_down_otherwise() -> None:
    assert choose_scale([4.4, 0.005, 1.0]) == choose_scale([0.005])
    assert choose_scale([4.4, 0.005]).exact and choose_scale([4.4]).factor == 10
    assert not choose_scale([1000 / 3]).exact  # 333333333.33 at 10^6 is not whole
    odd = choose_scale([1 / 3])
    assert not odd.exact and odd.down(1 / 3) <= odd.factor / 3


def test_progress_reports_each_improvement_with_its_bound() -> None:
    problem = make_problem(HETERO, 3, 6, split=True, memory_limit=3)
    seen: list[tuple[float, float, float]] = []
    got = synthesize(problem, time_limit=20, progress=lambda *x: seen.append(x))
    assert seen, "the warm start is improved on here"
    assert all(bound <= best + 1e-9 for _, best, bound in seen)
    assert [best for _, best, _ in seen] == sorted((b for _, b, _ in seen), reverse=True)
    assert seen[-1][1] >= got.step - 1e-9  # the model's objective, >= the simulated step


def test_same_seed_same_schedule_with_one_worker() -> None:
    problem = make_problem(HETERO, 3, 5, split=True, memory_limit=3)
    a = synthesize(problem, time_limit=30, workers=1, seed=7)
    b = synthesize(problem, time_limit=30, workers=1, seed=7)
    assert a.schedule.programs == b.schedule.programs and a.step == b.step


def test_memory_budget_between_the_least_and_1f1b_holds() -> None:
    problem = make_problem(HETERO, 3, 6, memory_limit=2)
    got = synthesize(problem, time_limit=20)
    assert max(verify(got.schedule).peak_activations) <= 2
    assert got.step <= simulate(sequential(problem), HETERO).makespan


def test_too_short_a_time_limit_returns_the_warm_start_with_its_gap() -> None:
    problem = make_problem(HETERO, 4, 8, split=True, memory_limit=2)
    got = synthesize(problem, time_limit=1e-3)
    assert got.step == got.warm.step and got.gap > 0 and not got.optimal
    verify(got.schedule)


def test_synth_never_returns_a_slower_schedule_than_its_warm_start() -> None:
    """Here the two-chunk V's warm start (26.88) is the fastest and meets its own bound,
    while the four-chunk shapes have lower bounds but slower starts: with no time to search
    them, the result is still the fastest start (it once was the four-chunk V's 27.39)."""
    costs = CostModel.from_settings({"F": (1.0, None), "I": (1.0, None), "W": (1.0, None),
                                     "latency": (0.01, None), "bandwidth": (1e7, None),
                                     "activation_bytes": (1e5, None),
                                     "stage.1.F": (1.2, None)})
    got = synth(costs, 2, 8, memory_limit="1f1b", time_limit=1e-9)
    starts_ = [synthesize(make_problem(costs, 2, 8, v, shape, memory_limit="1f1b"),
                          tune_costs=costs, time_limit=1e-9).warm.step
               for v, shape in ((1, "loop"), (2, "loop"), (2, "vshape"), (4, "loop"),
                                (4, "vshape"))]
    assert got.step <= got.warm.step == min(starts_)
    assert simulate(got.schedule, got.problem.costs).makespan == got.step


def test_zb_greedy_is_valid_and_reaches_zb_h1_on_equal_costs() -> None:
    p, m = 4, 8
    problem = make_problem(CostModel(), p, m, split=True, memory_limit=p)
    s = zb_greedy(problem)
    assert s is not None and problem.fits(s)
    verify(s)
    assert simulate(s).makespan == 3 * m + p - 1
    assert zb_greedy(make_problem(CostModel(), p, m, memory_limit=p)) is None  # needs I + W


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_zb_greedy_is_valid_on_random_costs(data: st.DataObject) -> None:
    """On random stage costs (one dearer first stage once made a stage run a forward whose
    input the stage before had not run) every variant gives a schedule that verifies and
    keeps the budget."""
    p = data.draw(st.integers(2, 4), "ranks")
    m = data.draw(st.integers(2, 6), "microbatches")
    costs = _random_costs(data, p, m)
    assume(not costs.mb)
    limit = data.draw(st.sampled_from([None, *range(1, p + 1)]), "budget")
    problem = make_problem(costs, p, m, split=True, memory_limit=limit)
    s = zb_greedy(problem)
    if limit is None or limit >= p:
        assert s is not None
    if s is not None:
        verify(s)
        assert problem.fits(s)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_list_scheduler_never_gets_stuck(data: st.DataObject) -> None:
    """Every variant, including those that let in more micro-batches than a rank's memory
    holds whole, finishes (the banker's test keeps the oldest micro-batch movable) and keeps
    the budget, counted or in bytes (sizes that do not sum exactly, stages of size zero), on
    random costs, chunks, placements and budgets down to the least any schedule needs."""
    p = data.draw(st.integers(2, 4), "ranks")
    m = data.draw(st.integers(2, 6), "microbatches")
    v = data.draw(st.sampled_from([1, 2]), "chunks")
    costs = _random_costs(data, p, m)  # (make_problem cuts each stage in v)
    assume(not costs.mb)
    placement = data.draw(st.sampled_from(["loop", "vshape"]), "placement")
    split = data.draw(st.booleans(), "split")
    if data.draw(st.booleans(), "in bytes"):
        # sizes that do not sum exactly, and (with no default) stages that weigh nothing
        given_ = {k: x for k, x in costs.settings().items() if "memory_bytes" not in k}
        if data.draw(st.booleans(), "a default size"):
            given_["memory_bytes"] = 1e9 / 3
        sized = data.draw(st.sets(st.integers(0, p - 1), min_size=1), "sized stages")
        given_.update({f"stage.{s}.memory_bytes": data.draw(st.integers(1, 4)) * 1e9 / 3
                       for s in sized})
        costs = CostModel.from_settings(given_)
        least = make_problem(costs, p, m, v, placement, split, memory_bytes=0.0).least_memory
        problem = make_problem(costs, p, m, v, placement, split, memory_bytes=least * data.draw(
            st.sampled_from([1.0, 1.3, 2.0, 3.5])))
    else:
        problem = make_problem(costs, p, m, v, placement, split,
                               memory_limit=data.draw(st.sampled_from([None, *range(1, p + 2)])))
    assume(problem.memory_limit is None or problem.memory_limit >= problem.least_memory)
    runs = variants(problem, work=20_000)
    got = greedy(problem, work=20_000)
    assert len(got) == len(runs)
    for s in got:
        verify(s)
        assert problem.fits(s)


def test_list_scheduler_lets_early_ranks_take_more_than_they_hold_whole() -> None:
    """compute-bound at K = 4 in a four-chunk V: rank 0 of the optimum (the fixture) starts
    with six first-chunk forwards, more than its memory holds whole (four); the variant that
    lets in 6, 5, 5, 4 micro-batches has six in flight on rank 0, and keeps the budget."""
    costs = CostModel.load(REPO / "examples/costs/compute-bound.toml")
    problem = make_problem(costs, 4, 8, 4, "vshape", split=True, memory_limit=16)
    assert reserve(problem) == (4, 4, 4, 4)
    assert waves(problem)[1:] == [(5, 5, 4, 4), (6, 5, 5, 4), (7, 6, 5, 4)]
    optimum = pipeir.parse(REPO / "tests/fixtures/compute-bound-k4.sched")
    assert optimum.programs[0][:6] == tuple(Op("F", 0, mb) for mb in range(6))

    def in_flight(schedule: Schedule) -> int:
        """The most micro-batches rank 0 has started and not finished at once."""
        most, started, done = 0, set(), set()
        for op in schedule.programs[0]:
            if op.kind == "F" and op.stage == 0:
                started.add(op.mb)
            if op == problem.release_op(0, op.mb):
                done.add(op.mb)
            most = max(most, len(started - done))
        return most

    got = greedy(problem, work=0)
    assert len(got) == len(waves(problem)) * 3
    assert [max(in_flight(s) for s in got[3 * i:3 * i + 3]) for i in range(4)] == [4, 5, 6, 7]
    assert all(problem.fits(s) for s in got)


def test_zb_greedy_never_runs_a_forward_before_its_input() -> None:
    """The case that broke it: the first stage's forward twice the rest, free links."""
    costs = CostModel.from_settings({"F": 0.1, "I": 0.1, "W": 0.1, "latency": 0.0,
                                     "stage.0.F": 0.2})
    problem = make_problem(costs, 3, 3, split=True)
    s = zb_greedy(problem)
    assert s is not None
    verify(s)
    assert problem.step_time(s) <= problem.step_time(sequential(problem))


def test_decomposition_repeats_a_steady_round() -> None:
    problem = make_problem(CostModel(), 3, 12, split=True, memory_limit=3)
    small = short_problem(problem, 6)
    short = synthesize(small, time_limit=20).schedule
    grown = extend(problem, short)
    assert grown is not None and grown.rounds == 6
    verify(grown.schedule)
    assert problem.fits(grown.schedule)
    assert grown.step == 3 * 12 + 2  # still ZB-H1's closed form


def test_rounds_drop_shapes_that_cannot_win_and_continue_the_fastest_open_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shape by shape (a stand-in solver): the first, fastest warm start (two chunks in a V,
    20.0), is closed at 19.3; the four-chunk loop's bound (19.625) cannot beat that, so it is
    never searched; the second round goes to the fastest shape still open (four chunks in a
    V, bound 18.875), not to the closed one, then (the stand-in returns at once) to the
    two-chunk loop, whose bound, 19.25, is still below 19.3; the bound reported is the open
    shapes' least."""
    import pipeir.search.synth as synth_module

    calls: list[tuple[tuple[int, str], float]] = []

    def fake(problem: Problem, *, warm: Start, full_share: float = synth_module.FULL_SHARE,
             **_: object) -> synth_module.SynthResult:
        c = problem.config
        calls.append(((c.stages // c.ranks, c.placement_name), full_share))
        if len(calls) == 1:
            return synth_module.SynthResult(problem, warm.schedule, 19.3, 19.3, warm, "", True,
                                            0.0)
        return synth_module.SynthResult(problem, warm.schedule, warm.step,
                                        problem.lower_bound(), warm, "", False, 0.0)

    monkeypatch.setattr(synth_module, "synthesize", fake)
    got = synth_module.synth(HETERO, 2, 4, split=True, memory_limit="1f1b", time_limit=30)
    first_round = [shape for shape, share in calls if share != 0.0]
    assert first_round == [(2, "vshape"), (4, "vshape"), (2, "loop")]
    assert [shape for shape, share in calls if share == 0.0] == [(4, "vshape"), (2, "loop")]
    assert got.step == 19.3 and got.bound == pytest.approx(18.875) and not got.optimal


def test_second_round_goes_on_to_the_next_open_shape_when_its_lead_closes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shape by shape (a stand-in solver that never gains in the first round): the second
    round's lead, two chunks in a V (20.0, bound 19.0), closes at its bound; the time left
    goes to the four-chunk V, whose bound (18.875) is below that, and no further (the loops'
    bounds, 19.25 and 19.625, are not). Once it spent 32 s idle on compute-bound."""
    import pipeir.search.synth as synth_module

    second: list[tuple[int, str]] = []
    limits: list[float] = []
    given_bounds: list[float | None] = []

    def fake(problem: Problem, *, warm: Start, time_limit: float,
             full_share: float = synth_module.FULL_SHARE, bound: float | None = None,
             **_: object) -> synth_module.SynthResult:
        c = problem.config
        own = problem.lower_bound()
        if full_share == 0.0:
            second.append((c.stages // c.ranks, c.placement_name))
            limits.append(time_limit)
            given_bounds.append(bound)
            if len(second) == 1:
                time.sleep(0.2)  # closes, having used some of the time
                return synth_module.SynthResult(problem, warm.schedule, own, own, warm, "",
                                                True, 0.0)
        return synth_module.SynthResult(problem, warm.schedule, warm.step, own, warm, "",
                                        False, 0.0)

    monkeypatch.setattr(synth_module, "synthesize", fake)
    got = synth_module.synth(HETERO, 2, 4, split=True, memory_limit="1f1b", time_limit=30)
    assert second == [(2, "vshape"), (4, "vshape")]
    assert limits[1] <= limits[0] - 0.2  # what the first left
    assert given_bounds == pytest.approx([19.0, 18.875])  # each starts from its own bound
    assert got.step == pytest.approx(19.0) and got.bound == pytest.approx(18.875)
    assert not got.optimal


def test_large_problems_are_decomposed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Into a short pipeline of max(2 x stages, EXACT_OPS / ops per micro-batch) micro-batches
    (6 here), grown back; not where that is more than half of them (10 micro-batches: the
    short problem would be most of the long one)."""
    import pipeir.search.synth as synth

    problem = make_problem(HETERO, 3, 16, split=True, memory_limit=3)
    assert len(problem.ops) > 60
    monkeypatch.setattr(synth, "EXACT_OPS", 60)
    got = synth.synthesize(problem, time_limit=10)
    assert got.method.startswith("decomposed: solved 6 micro-batches")
    assert got.step <= got.warm.step and got.bound <= got.step
    verify(got.schedule)
    assert EXACT_OPS > 60
    ten = make_problem(HETERO, 3, 10, split=True, memory_limit=3)
    assert not synth.synthesize(ten, time_limit=2).method.startswith("decomposed")


def test_above_full_ops_the_full_model_gets_its_large_share(monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    import pipeir.search.synth as synth

    problem = make_problem(HETERO, 3, 8, split=True, memory_limit=3)
    limits: list[float] = []
    real = synth.solve

    def spy(*args: object, **kwargs: object) -> object:
        limits.append(kwargs["time_limit"])  # type: ignore[arg-type]
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(synth, "FULL_OPS", 10)
    monkeypatch.setattr(synth, "solve", spy)
    seq = sequential(problem)
    got = synth.synthesize(problem, warm=Start("seq", seq, problem.step_time(seq)),
                           time_limit=10)
    assert len(limits) == 1 and 1.5 < limits[0] <= 10 * synth.LARGE_SHARE
    verify(got.schedule)
    assert problem.fits(got.schedule) and problem.step_time(got.schedule) == got.step
    assert got.step < problem.step_time(seq)


def test_window_search_alone_improves_from_the_warm_start(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    import pipeir.search.synth as synth

    problem = make_problem(HETERO, 3, 8, split=True, memory_limit=3)
    monkeypatch.setattr(synth, "FULL_OPS", 10)
    monkeypatch.setattr(synth, "LARGE_SHARE", 0.0)
    monkeypatch.setattr(synth, "solve", None)  # the full model must not run
    seq = sequential(problem)
    got = synth.synthesize(problem, warm=Start("seq", seq, problem.step_time(seq)),
                           time_limit=10, work_limit=3.0)
    assert got.method.startswith("the warm start, then ") and got.step < got.warm.step
    # a window proves nothing: the bound is the problem's own, optimal only where it is met
    assert got.bound == problem.lower_bound()
    assert got.optimal == (got.step <= got.bound * (1 + 1e-9))
    verify(got.schedule)
    assert problem.fits(got.schedule) and problem.step_time(got.schedule) == got.step



def test_warm_start_labels_say_what_the_order_is() -> None:
    """A B-only problem takes tune's split candidates with their backwards merged, and says
    so: the order is not what split-backward{mode=h1} alone would run."""
    costs = CostModel.load(REPO / "examples" / "costs" / "heavy-ends.toml")
    problem = make_problem(costs, 4, 8, 2, "vshape", split=False, memory_limit=8)
    found = starts(problem, library(costs, 4, 8, "overlapped", 2))
    zbv = [st for st in found if st.label.startswith("zb-v")]
    assert [st.label for st in zbv] == ["zb-v v=2, backwards merged"]
    assert {op.kind for op in zbv[0].schedule} == {"F", "B"}
    split = make_problem(costs, 4, 8, 2, "vshape", split=True, memory_limit=8)
    assert "zb-v v=2" in [st.label for st in starts(split, library(costs, 4, 8, "overlapped",
                                                                   2))]


def test_a_warm_start_at_the_bound_is_not_decomposed(monkeypatch: pytest.MonkeyPatch) -> None:
    """1F1B meets the bound of uniform costs with one stage per rank: nothing to decompose
    (at p = 64, m = 256 that was 6 s of a 10 s limit)."""
    import pipeir.search.synth as synth

    costs = CostModel.load(REPO / "examples" / "costs" / "uniform.toml")
    problem = make_problem(costs, 8, 128, memory_limit=8)
    assert len(problem.ops) > EXACT_OPS
    monkeypatch.setattr(synth, "_decompose", None)  # must not be called
    got = synth.synthesize(problem, tune_costs=costs, time_limit=20)
    assert got.optimal and got.step == got.warm.step == problem.lower_bound()
    assert got.method == "the warm start meets the lower bound"


def test_the_library_search_and_the_bounds_stay_within_the_time(
        monkeypatch: pytest.MonkeyPatch, cli, tmp_path: Path) -> None:
    """tune's search gets a deadline of a third of the time limit; shapes whose bound is not
    reached by half of it are left out, and the output says so (a shape's bound took 5 s at
    p = 64, m = 256; simulated here by a slow bound). tune's best shape is bounded first, so
    its answer is never lost. Both wait for `FLOOR` seconds at least, so small problems do
    not depend on the machine's speed."""
    import pipeir.search.synth as synth
    import pipeir.search.tune

    deadlines: list[float] = []
    real_search, real_bound = pipeir.search.tune.search, Problem.lower_bound

    def search(*args: object, **kwargs: object) -> object:
        deadlines.append(kwargs["deadline"] - time.perf_counter())  # type: ignore[operator]
        return real_search(*args, **kwargs)  # type: ignore[arg-type]

    def slow(self: Problem) -> float:
        time.sleep(0.5)
        return real_bound(self)

    monkeypatch.setattr(pipeir.search.tune, "search", search)
    monkeypatch.setattr(Problem, "lower_bound", slow)
    monkeypatch.setattr(synth, "FLOOR", 0.0)  # (2 s, which small problems never reach)
    got = synth.synth(HETERO, 2, 4, split=True, time_limit=0.8)
    assert len(deadlines) == 1 and 0.2 < deadlines[0] <= 0.8 / 3
    tuned = real_search(HETERO, 2, [4], comms=("overlapped",), dp=1).best
    own = f"v={tuned.v} {tuned.schedule.config.placement_name or 'loop'}"
    assert got.shapes == (own,) and got.bound <= got.step <= tuned.step_time
    every = ("v=1 loop", "v=2 loop", "v=2 vshape", "v=4 loop", "v=4 vshape")
    assert got.unsearched == tuple(x for x in every if x != own)
    costs = tmp_path / "costs.toml"
    costs.write_text("F = 1.0\nI = 1.5\nW = 0.5\nlatency = 0.25\n")
    code, out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4,
                         "--split-backward", "--time-limit", 0.8)
    assert code == 0, err
    assert re.search(r"\nshapes searched: v=\d \w+; not reached within --time-limit 0\.8: "
                     r"v=\d \w+(, v=\d \w+){3} \(the bound does not cover them\)\n", out), out
    assert "(optimal)" not in out  # at most "optimal in the shapes searched"

# ---- the pass --------------------------------------------------------------------------------
def test_cost_driven_passes_without_costs_warn(cli, tmp_path: Path) -> None:
    """With no --costs, no costs block and no cost in --set, synth and reorder plan for the
    default unit costs: opt and compile say so on stderr and still run."""
    warn = ("warning: {} plans by cost, and there are no costs (give --costs FILE or a costs "
            "block): it plans for the defaults, F = 1, B = 2 and free links\n")
    out = tmp_path / "o.sched"
    code, _, err = cli("opt", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 2,
                       "--passes", "reorder,synth{time_limit=1}", "-o", out)
    assert code == 0 and err == warn.format("reorder") + warn.format("synth")
    code, _, err = cli("compile", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 2,
                       "--passes", "synth{time_limit=1}", "-o", tmp_path / "gen")
    assert code == 0 and err == warn.format("synth")
    for costs in (["--costs", REPO / "examples" / "costs" / "uniform.toml"], ["--set", "F=2"]):
        code, _, err = cli("opt", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 2,
                           "--passes", "synth{time_limit=1}", *costs, "-o", out)
        assert code == 0 and "warning" not in err, err
    code, _, err = cli("opt", "--schedule", "1f1b", "--ranks", 2, "--microbatches", 2,
                       "--passes", "split-backward", "-o", out)
    assert code == 0 and err == ""


def test_pass_is_never_slower_and_keeps_the_inputs_memory() -> None:
    costs = HETERO
    s = pipeir.compile(pipeir.library.get("1f1b", 2, 4), "split-backward").schedule
    before = simulate(s, costs).makespan
    out = pipeir.compile(s, "synth{time_limit=5},verify", costs=costs,
                         comm="overlapped").schedule
    assert simulate(out, costs).makespan <= before
    roomy = pipeir.compile(s, "synth{time_limit=5,memory_limit=4}", costs=costs).schedule
    assert simulate(roomy, costs).makespan < before
    assert max(verify(out).peak_activations) <= max(verify(s).peak_activations)
    assert out.name == s.name


@pytest.mark.parametrize(("spec", "column", "message"), [
    ("synth{time_limit=0}", 18,
     "synth: time_limit must be a finite number of seconds > 0, got 0"),
    ("synth{time_limit=nan}", 18,
     "option 'time_limit' of pass 'synth' must be a finite number, got 'nan'"),
    ("synth{time_limit=inf}", 18,
     "option 'time_limit' of pass 'synth' must be a finite number, got 'inf'"),
    ("synth{seed=2147483648}", 12, "synth: the seed must be a 32-bit integer"),
    ("synth{workers=0}", 15, "synth: workers must be 1 to 256, got 0"),
    ("synth{workers=99999999999}", 15, "synth: workers must be 1 to 256, got 99999999999"),
])
def test_pass_option_errors(spec: str, column: int, message: str) -> None:
    """Refused as the pipeline is read, at the option, not by the solver after the search."""
    with pytest.raises(pipeir.UsageError) as e:
        pipeir.compile(pipeir.library.get("1f1b", 2, 4), spec)
    assert e.value.render().startswith(f"<passes>:1:{column}: error: {message}"), \
        e.value.render()


@pytest.mark.parametrize(("before", "message"), [
    ("recompute{all=true}", "synth works on F/B/I/W schedules, but this one has FC"),
    ("dp-reduce", "the input has gradient reductions (R ops)"),
])
def test_pass_refuses_memory_ops_and_reductions(before: str, message: str) -> None:
    """The model orders F/B/I/W; memory ops and R ops are placed after it, never dropped."""
    s = pipeir.compile(pipeir.library.get("1f1b", 2, 4), before).schedule
    with pytest.raises(pipeir.UsageError, match=re.escape(message)):
        pipeir.compile(s, "synth{time_limit=1}", costs=CostModel())
    out = pipeir.compile(pipeir.library.get("1f1b", 2, 4),
                         f"synth{{time_limit=1}},{before}", costs=CostModel()).schedule
    assert any(op.kind in ("FC", "R") for op in out)


def test_pass_refuses_a_mix_of_whole_and_split_backwards() -> None:
    """Its model has one kind of backward; it once split every B of such an input, changing
    the ops a pass that reorders must keep."""
    s = pipeir.compile(pipeir.library.get("1f1b", 2, 4),
                       "split-backward,merge-backward{adjacent_only=true}").schedule
    assert {op.kind for op in s} == {"F", "B", "I", "W"}
    with pytest.raises(pipeir.UsageError, match=r"both whole backwards \(B\(0,0\)\) and split"):
        pipeir.compile(s, "synth{time_limit=1}", costs=CostModel())


def test_the_python_api_warns_when_synth_has_no_costs() -> None:
    """Without costs the pass plans for unit costs; the CLI says so on stderr, and the Python
    API with a UserWarning. Costs given (even the defaults, spelt out) silence it."""
    s = pipeir.library.get("1f1b", 2, 4)
    with pytest.warns(UserWarning, match=r"^synth plans by cost, and there are no costs"):
        pipeir.compile(s, "synth{time_limit=1}")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipeir.compile(s, "synth{time_limit=1}", costs=CostModel())
        pipeir.compile(s, "split-backward")


# ---- the command line ------------------------------------------------------------------------
def test_cli_writes_a_schedule_that_simulates_to_the_reported_step(cli, tmp_path: Path) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text('F = 1.0\nI = 1.5\nW = 0.5\nlatency = 0.25\nunit = "ms"\n'
                     '[stage.0]\nF = 1.5\n[stage.2]\nF = 2.0\n')
    out = tmp_path / "best.sched"
    code, text, err = cli("synth", "--costs", costs, "--ranks", 3, "--microbatches", 6,
                          "--split-backward", "--time-limit", 5, "--workers", 1, "-o", out)
    assert code == 0, err
    step = re.search(r"best: step (\S+) ms", text)
    bound = re.search(r"lower bound: (\S+) ms; gap (\S+)%", text)
    assert step and bound, text
    code, sim, err = cli("simulate", out)
    assert code == 0, err
    assert re.search(r"makespan (\S+) ms", sim).group(1) == step.group(1)  # type: ignore[union-attr]
    elab = pipeir.load(out)
    verify(elab.schedule)
    v = elab.schedule.config.stages // 3
    assert max(verify(elab.schedule).peak_activations) <= 3 * v  # the default budget: 1F1B's


def test_one_rank_is_one_shape_and_said_in_the_singular(cli, tmp_path: Path) -> None:
    """On one rank a V of chunks is the loop: one shape, solved once (it was listed and
    solved twice)."""
    costs = tmp_path / "c.toml"
    costs.write_text("F = 1.0\nB = 2.0\n")
    code, out, err = cli("synth", "--costs", costs, "--ranks", 1, "--microbatches", 1,
                         "--v", 4, "--time-limit", 1)
    assert code == 0, err
    assert out.startswith("synth: 1 rank, 1 micro-batch, v=4 (loop placement)"), out
    assert "shapes searched" not in out and "(optimal for v=4 loop)" in out


def test_tune_and_synth_infer_ranks_alike(cli, tmp_path: Path) -> None:
    """Without --ranks both read P off the highest stage with its own costs, and both refuse
    a file whose few named stages lie far apart (a typo such as [stage.99])."""
    sparse = tmp_path / "sparse.toml"
    sparse.write_text("F = 1.0\nB = 2.0\n[stage.0]\nF = 2.0\n[stage.7]\nB = 3.0\n")
    message = (f"error: {sparse}: per-stage costs for stages 0, 7 only, yet the highest, "
               "stage.7, would make the search cover 8 ranks; a typo? give --ranks P to "
               "search P ranks\n")
    assert cli("tune", "--costs", sparse)[1:] == ("", message)
    assert cli("synth", "--costs", sparse, "--microbatches", 8)[1:] == ("", message)
    code, out, err = cli("synth", "--costs", sparse, "--ranks", 8, "--microbatches", 8,
                         "--v", 1, "--time-limit", 1)
    assert code == 0 and out.startswith("synth: 8 ranks") and err == "", err
    # more ranks than the file describes: its last stage (often the LM head) becomes a middle
    # one, which both commands say
    warn = (f"warning: {sparse} describes 8 stages (stage.7.* is the last set) but --ranks is "
            "10: stages 8 to 9 take the file's defaults\n")
    assert cli("synth", "--costs", sparse, "--ranks", 10, "--microbatches", 10, "--v", 1,
               "--time-limit", 1)[2] == warn
    assert cli("tune", "--costs", sparse, "--ranks", 10, "--microbatches", 20, "--max-v", 1,
               "--top", 1)[2] == warn


def test_large_shapes_start_from_the_list_scheduler_while_time_allows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Above EXACT_OPS the list scheduler runs only before a deadline, its variants until
    then (at 8,192 ops it took one micro-batch at a time, 1,536, for the list scheduler's
    256)."""
    import pipeir.search.synth.warmstart as warmstart

    problem = make_problem(HETERO, 3, 8, split=True, memory_limit=3)
    monkeypatch.setattr(warmstart, "EXACT_OPS", 10)
    labels = [st.label for st in starts(problem)]
    assert not any(x.startswith("list scheduler") for x in labels)
    past = [st.label for st in starts(problem, deadline=time.perf_counter() - 1)]
    assert not any(x.startswith("list scheduler") for x in past)
    later = starts(problem, deadline=time.perf_counter() + 60)
    assert len([x for x in later if x.label.startswith("list scheduler")]) > 1
    assert later[0].step < min(st.step for st in later if st.label.startswith("one micro"))


def test_cli_says_what_optimal_covers(cli, tmp_path: Path) -> None:
    """Optimal is over the shapes searched: one shape names it; the default search (1, 2, 4
    chunks and tune's v) does not claim every v, since more chunks per rank can be faster
    within the same budget."""
    costs = tmp_path / "uniform.toml"
    costs.write_text("F = 1.0\nB = 2.0\n")
    code, out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4, "--v",
                         1, "--time-limit", 5)
    assert code == 0, err
    assert "lower bound: 15; gap 0.0% (optimal for v=1 loop);" in out, out
    code, out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4,
                         "--time-limit", 5)
    assert code == 0, err
    assert "(optimal in the shapes searched)" in out and "(optimal)" not in out, out
    assert re.search(r"\nshapes searched: v=\d \w+(, v=\d \w+)+\n", out), out


@pytest.mark.parametrize(("args", "message"), [
    (("--memory-limit", "0.5"), "smallest feasible limit is --memory-limit 1"),
    (("--memory-limit", "0.75", "--v", "2"), "smallest feasible limit is --memory-limit 2"),
    (("--memory-bytes", "1e9"), "needs activation sizes in the cost file"),
    (("--time-limit", "0"), "argument --time-limit: expected a positive number, got 0"),
    (("--time-limit", "nan"), "argument --time-limit: expected a positive number, got nan"),
    (("--ranks", "2"), "the costs describe 4 stages"),
    (("--v", "0"), "argument --v: expected a positive integer, got 0"),
    (("--workers", "x"), "argument --workers: expected a positive integer, got 'x'"),
    (("-o", "/nonexistent/dir/out.sched"), "-o /nonexistent/dir/out.sched: directory"),
    (("-o", ""), "error: -o: empty path"),
    (("--seed", "2147483648"), "the seed must be a 32-bit integer (at most 2,147,483,647)"),
    (("--workers", "99999999999"), "workers must be 1 to 256, got 99999999999"),
    (("--ranks", "1000000"), "8,000,000 ops (F and B) need 14.9 GiB"),
    (("--v", "10000000"), "--v 10000000: synth cuts a stage into at most 64 chunks"),
    (("--microbatches", "10000000"), "80,000,000 ops (F and B) need 149 GiB"),  # at once
])
def test_cli_errors_are_clear(cli, args: tuple[str, ...], message: str) -> None:
    code, _out, err = cli("synth", "--costs", REPO / "examples/costs/compute-bound.toml",
                         "--microbatches", 4, *args)
    assert code == 2 and message in err, err
    assert "Traceback" not in err


def test_cli_bytes_budget_names_the_least_bytes(cli, tmp_path: Path) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text("memory_bytes = 1000\n[stage.1]\nF = 2.0\n")
    code, _, err = cli("synth", "--costs", costs, "--microbatches", 4, "--memory-bytes", 999)
    assert code == 2 and "smallest feasible limit is --memory-bytes 1000" in err, err
    code, _out, err = cli("synth", "--costs", costs, "--microbatches", 4, "--memory-bytes",
                         1000, "--time-limit", 5)
    assert code == 0, err


def test_cli_bytes_budget_searches_the_shapes_it_fits(cli, tmp_path: Path) -> None:
    """With bytes, chunks change what a rank must hold: a budget one stage per rank cannot
    meet is met by two chunks per rank, so synth searches those instead of refusing; the
    least it names is the least over every shape, and is itself feasible when written out."""
    costs = tmp_path / "c.toml"
    costs.write_text("F = 1.0\nB = 2.0\nmemory_bytes = 1e9\n[stage.0]\nmemory_bytes = 4e9\n"
                     "[stage.1]\nF = 1.0\n")
    out = tmp_path / "out.sched"
    code, text, err = cli("synth", "--costs", costs, "--microbatches", 4, "--memory-bytes",
                          3e9, "--time-limit", 2, "--workers", 1, "-o", out)
    assert code == 0, err
    assert "v=1" not in text
    elab = pipeir.load(out)
    size = CostModel.from_settings(elab.costs).activation_memory
    for prog in elab.schedule.programs:  # bytes held, counted by hand: F holds, B frees
        held = peak = 0.0
        for op in prog:
            held += (size(op.stage) or 0.0) * {"F": 1, "B": -1}[op.kind]
            peak = max(peak, held)
        assert peak <= 3e9
    code, _, err = cli("synth", "--costs", costs, "--microbatches", 4, "--memory-bytes", 1e9)
    assert code == 2 and "smallest feasible limit is --memory-bytes 2.5e+09" in err, err
    odd = tmp_path / "odd.toml"
    odd.write_text("memory_bytes = 1234561234\n[stage.1]\nF = 1.0\n")
    code, _, err = cli("synth", "--costs", odd, "--microbatches", 4, "--v", 1,
                       "--memory-bytes", 1e9)
    assert code == 2 and "smallest feasible limit is --memory-bytes 1234561234" in err, err
    code, _, err = cli("synth", "--costs", odd, "--microbatches", 4, "--v", 1,
                       "--memory-bytes", 1234561234, "--time-limit", 1)
    assert code == 0, err
    # one byte short: refused, and printed so that it differs from the least (synth's slack
    # of 1e-9 let it through, and the schedule it wrote then failed `check`)
    code, _, err = cli("synth", "--costs", odd, "--microbatches", 4, "--v", 1,
                       "--memory-bytes", 1234561233, "--time-limit", 1)
    assert code == 2 and ("--memory-bytes 1234561233: no schedule fits; the smallest feasible "
                          "limit is --memory-bytes 1234561234") in err, err
    code, _, err = cli("check", REPO / "examples/1f1b.sched", "--costs", odd, "--memory-limit",
                       "4938244935B")
    assert code == 1 and ("makes 4,938,244,936 bytes of activations (memory_limit = "
                          "4,938,244,935 bytes; this rank peaks at 4,938,244,936)") in err, err


def test_cli_lengths_must_match_the_micro_batches(cli, tmp_path: Path) -> None:
    out = tmp_path / "out.sched"
    code, _, err = cli("synth", "--costs", REPO / "examples/costs/lengths.toml", "--ranks", 2,
                       "--microbatches", 10, "-o", out)
    assert code == 2 and not out.exists()
    assert "lengths.toml:12:1: error: lengths gives 8 micro-batch lengths but the schedule " \
        "has 10 micro-batches" in err, err


def test_cli_refuses_data_parallel_costs_before_searching(cli, tmp_path: Path) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text("F = 1.0\ndp = 2\n")
    out = tmp_path / "out.sched"
    code, _out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4,
                          "-o", out)
    assert code == 2 and "does not model gradient all-reduces" in err, err
    assert err.count("\n") <= 2 and not out.exists()


def test_cli_bad_cost_file_gets_the_cost_file_error(cli, tmp_path: Path) -> None:
    costs = tmp_path / "c.toml"
    costs.write_text("F = 1.0\nQ = 2\n")
    code, _out, err = cli("synth", "--costs", costs, "--ranks", 2, "--microbatches", 4)
    assert code == 2 and "unknown cost 'Q'" in err and "c.toml:2:1" in err, err
