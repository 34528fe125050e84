"""The list schedulers (`pipeir.search.synth.greedy`, `pipeir.search.synth.zb_greedy`): valid on
random costs, never stuck, and at ZB-H1's closed form on equal costs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from synth_fixtures import REPO, random_costs

import pipeir
from pipeir.ops import Op
from pipeir.schedule import Schedule
from pipeir.search.synth import make_problem
from pipeir.search.synth.greedy import greedy, reserve, variants, waves
from pipeir.search.synth.warmstart import sequential
from pipeir.search.synth.zb_greedy import zb_greedy
from pipeir.sim import CostModel, simulate
from pipeir.verify import verify


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
    costs = random_costs(data, p, m)
    assume(not costs.mb)
    limit = data.draw(st.sampled_from([None, *range(1, p + 1)]), "budget")
    problem = make_problem(costs, p, m, split=True, memory_limit=limit)
    s = zb_greedy(problem)
    if limit is None or limit >= p:
        assert s is not None
    if s is not None:
        verify(s)
        assert problem.fits(s)


@pytest.mark.slow
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
    costs = random_costs(data, p, m)  # (make_problem cuts each stage in v)
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
    problem = make_problem(costs, 4, 8, 4, "vshape", split=True, memory_limit=4)
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
