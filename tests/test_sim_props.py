"""Hypothesis properties of the simulator over library schedules (p <= 16, m <= 64) and over
random valid schedules from `pipeir.testing`, with random per-op costs."""

from __future__ import annotations

import itertools
import math
import random

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeir
from pipeir import Op, Schedule
from pipeir.sim import CostModel, SimResult, simulate
from pipeir.sim.analytic import interleaved_bubble, one_f_one_b_bubble
from pipeir.testing import configs, schedules

EPS = 1e-9


@st.composite
def library_schedules(draw: st.DrawFn, max_ranks: int = 16, max_mb: int = 64) -> Schedule:
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b"]))
    p = draw(st.integers(1, max_ranks))
    if name == "interleaved-1f1b":
        v = draw(st.integers(1, 4))
        m = p * draw(st.integers(1, max(1, max_mb // p)))
        return pipeir.library.get(name, p, m, v=v)
    return pipeir.library.get(name, p, draw(st.integers(1, max_mb)))


@st.composite
def random_costs(draw: st.DrawFn, s: Schedule) -> CostModel:
    """A different time for every op (some zero), and sometimes latency and bandwidth."""
    rnd = random.Random(draw(st.integers(0, 2**32 - 1)))
    per_op: dict[tuple[int, int], dict[str, float]] = {}
    for op in s:
        t = 0.0 if rnd.random() < 0.05 else rnd.uniform(0.1, 3.0)
        per_op.setdefault((op.stage, op.mb), {})[op.kind] = t
    latency = draw(st.sampled_from([0.0, 0.0, 0.1, 1.5]))
    return CostModel(stage_mb=per_op, latency=latency, bandwidth=draw(st.sampled_from(
        [None, 1000.0])), activation_bytes=draw(st.sampled_from([0.0, 250.0])))


def check_bounds(s: Schedule, r: SimResult) -> None:
    assert set(r.start) == set(s)
    assert all(r.makespan >= b - EPS for b in r.busy)
    assert r.makespan >= r.critical_path_time - EPS
    assert 0.0 <= r.bubble < 1.0 or r.makespan == 0
    assert r.bubble_vs_ideal >= 0
    for prog in s.programs:  # program order, no overlap on a rank
        for a, b in itertools.pairwise(prog):
            assert r.end[a] <= r.start[b] + EPS
    for u, v in s.data_edges():
        assert r.end[u] <= r.start[v] + EPS
    for t in r.transfers:
        assert t.end >= t.start >= r.end[t.src] - EPS and t.end <= r.start[t.dst] + EPS
    assert r.peak_activations == pipeir.verify(s).peak_activations


def reference_makespan(s: Schedule, costs: CostModel) -> float:
    """The overlapped model's definition, via networkx's public API only."""
    end: dict[Op, float] = {}
    for op in nx.topological_sort(s.graph):
        t = 0.0
        for p in s.graph.predecessors(op):
            same = s.rank_of(p) == s.rank_of(op)
            t = max(t, end[p] + costs.transfer_time(p.stage, op.stage, same_rank=same))
        end[op] = t + costs.cost(op)
    return max(end.values(), default=0.0)


@settings(max_examples=25)
@given(st.data())
def test_bounds_and_reference_on_library_schedules(data: st.DataObject) -> None:
    s = data.draw(library_schedules())
    costs = data.draw(random_costs(s))
    over = simulate(s, costs)
    check_bounds(s, over)
    assert math.isclose(over.makespan, reference_makespan(s, costs), rel_tol=1e-9,
                        abs_tol=1e-9)
    block = simulate(s, costs, comm="blocking")
    check_bounds(s, block)
    assert block.makespan >= over.makespan - EPS


@settings(max_examples=25)
@given(st.data())
def test_slowing_one_op_never_shortens_the_step(data: st.DataObject) -> None:
    s = data.draw(library_schedules(max_ranks=8, max_mb=32))
    costs = data.draw(random_costs(s))
    ops = list(s)
    op = ops[data.draw(st.integers(0, len(ops) - 1))]
    extra = data.draw(st.floats(0.01, 5.0))
    level = {k: dict(v) for k, v in costs.stage_mb.items()}
    level[op.stage, op.mb][op.kind] += extra
    slower = CostModel(stage_mb=level, latency=costs.latency, bandwidth=costs.bandwidth,
                       activation_bytes=costs.activation_bytes)
    for comm in ("overlapped", "blocking"):
        before, after = simulate(s, costs, comm), simulate(s, slower, comm)
        assert after.makespan >= before.makespan - EPS
        assert all(after.end[o] >= before.end[o] - EPS for o in ops)  # no op finishes sooner


@settings(max_examples=30)
@given(st.data())
def test_bounds_on_random_valid_schedules(data: st.DataObject) -> None:
    s = data.draw(schedules(configs(max_ranks=6, max_microbatches=8, max_chunks=3)))
    costs = data.draw(random_costs(s))
    for comm in ("overlapped", "blocking"):
        check_bounds(s, simulate(s, costs, comm))
    assert math.isclose(simulate(s, costs).makespan, reference_makespan(s, costs),
                        rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=30)
@given(p=st.integers(1, 16), m=st.integers(1, 64), f=st.floats(0.1, 4.0),
       b=st.floats(0.1, 4.0))
def test_1f1b_and_gpipe_formula(p: int, m: int, f: float, b: float) -> None:
    costs = CostModel(F=f, B=b)
    one = simulate(pipeir.library.get("1f1b", p, m), costs)
    gpipe = simulate(pipeir.library.get("gpipe", p, m), costs)
    assert math.isclose(one.bubble, one_f_one_b_bubble(p, m), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(gpipe.bubble, one_f_one_b_bubble(p, m), rel_tol=1e-9, abs_tol=1e-12)
    assert max(gpipe.peak_activations) == m
    assert max(one.peak_activations) == min(p, m)


@settings(max_examples=20)
@given(p=st.integers(1, 16), k=st.integers(1, 4), v=st.integers(1, 4))
def test_interleaved_formula(p: int, k: int, v: int) -> None:
    m = p * k
    r = simulate(pipeir.library.get("interleaved-1f1b", p, m, v=v),
                 CostModel(F=1 / v, B=2 / v))
    assert math.isclose(r.bubble, interleaved_bubble(p, m, v), rel_tol=1e-9, abs_tol=1e-12)
