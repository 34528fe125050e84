"""The constraint model (`pipeir.search.synth.model`) and the window model
(`pipeir.search.synth.lns`): optimal on tiny instances against the brute force over every
valid order, on the closed forms (1F1B, ZB-H1), and agreeing with the simulator.

Solver runs here are small (tens of ops) and single-threaded, so they are deterministic."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from synth_fixtures import HETERO, brute_force, random_costs, whole_window, window_orders

from pipeir.config import PipelineConfig
from pipeir.ops import Op
from pipeir.search.synth import Problem, make_problem, synthesize
from pipeir.search.synth.lns import Window, improve
from pipeir.search.synth.model import Integral, choose_scale, probe, solve
from pipeir.search.synth.warmstart import sequential, starts
from pipeir.sim import CostModel, simulate
from pipeir.sim.engine import Timing
from pipeir.verify import verify


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


@pytest.mark.solver
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


@pytest.mark.solver
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
    want = window_orders(problem, progs, window.runs)
    if seq:
        assert want < problem.step_time(warm)
    if m == 6:
        free = make_problem(HETERO, 3, m, split=True, comm=comm)  # type: ignore[arg-type]
        assert window_orders(free, progs, window.runs) < want
    got = window.solve(time_limit=20, work_limit=20, workers=1, seed=0)
    assert got is not None and got[1]  # closed
    for old, new, (a, b) in zip(progs, got[0], window.runs):
        assert new[:a] == old[:a] and new[b:] == old[b:]
        assert sorted(new[a:b]) == sorted(old[a:b])
    sched = problem.build(got[0])
    assert problem.fits(sched)
    assert problem.step_time(sched) == pytest.approx(want, abs=1e-9)


@pytest.mark.solver
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_window_model_is_exact_on_random_problems(data: st.DataObject) -> None:
    """Random costs (per stage and per micro-batch), communication, budgets in count or
    bytes, start orders and windows: the window's model finds the best of every reordering
    of the window, simulated."""
    p = data.draw(st.integers(2, 3), "ranks")
    m = data.draw(st.integers(2, 4), "microbatches")
    split = data.draw(st.booleans(), "split")
    costs = random_costs(data, p, m)
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
    assert problem.step_time(sched) == pytest.approx(window_orders(problem, progs, window.runs),
                                                     abs=1e-9)


def test_window_model_is_exact_when_the_order_is_not_in_microbatch_order() -> None:
    """Taking a stage's ops in micro-batch order is safe only when the rest of the step does
    too; a user's warm start may not."""
    problem = make_problem(CostModel.from_settings({"F": 1.0, "B": 2.0}), 2, 2)
    f, b = (lambda s, m: Op("F", s, m)), (lambda s, m: Op("B", s, m))
    progs = [[f(0, 1), f(0, 0), b(0, 0), b(0, 1)], [f(1, 0), f(1, 1), b(1, 0), b(1, 1)]]
    window = whole_window(problem, progs, 2.0, 7.0)
    want = window_orders(problem, progs, window.runs)
    got = window.solve(time_limit=10, work_limit=10, workers=1, seed=0)
    assert got is not None and got[1]
    assert problem.step_time(problem.build(got[0])) == want == 9.0 < window.current


def test_zero_duration_ops_never_give_a_deadlocking_order() -> None:
    problem = make_problem(CostModel.from_settings({"F": 1.0, "B": 0.0}), 2, 2, v=2,
                           placement="vshape")
    seq = sequential(problem)
    got = whole_window(problem, [list(p) for p in seq.programs], -1.0, 1e6).solve(
        time_limit=10, work_limit=10, workers=1, seed=0)
    assert got is not None
    assert Timing(problem.build(got[0]), problem.costs, problem.comm).complete
    solved = solve(problem, hint=seq, upper=problem.step_time(seq), time_limit=10)
    assert solved.schedule is not None
    verify(solved.schedule)


def test_long_steps_at_a_fine_scale_do_not_overflow_the_solver() -> None:
    problem = make_problem(CostModel.from_settings({"F": 1000 / 3, "B": 2000 / 3}), 2, 3)
    seq = sequential(problem)
    got = whole_window(problem, [list(p) for p in seq.programs], -1.0, 1e6).solve(
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
