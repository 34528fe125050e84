"""`Schedule.deps` (pipeir.depgraph) against networkx's and graphlib's own answers.

The oracles are outside the code under test: the schedule's networkx graph (edges, kinds,
predecessors), networkx's cycle and reachability algorithms, graphlib's static_order (the
order lowering has always broken ties by) and networkx's topological_sort.
"""

from __future__ import annotations

from graphlib import TopologicalSorter

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeir import EdgeKind, Schedule, library
from pipeir.depgraph import topological_order
from pipeir.ops import Op
from pipeir.testing import configs, mutations, schedules

SMALL = configs(max_ranks=4, max_microbatches=6)


@st.composite
def paired(draw: st.DrawFn) -> Schedule:
    """A random schedule with some neighbours on a rank made overlapped pairs (pairs of ops
    that need each other included: the index must still answer, and verify reject them)."""
    s = draw(schedules(SMALL))
    progs: list[list[Op | tuple[Op, Op]]] = []
    for prog in s.programs:
        out: list[Op | tuple[Op, Op]] = []
        k = 0
        while k < len(prog):
            if k + 1 < len(prog) and draw(st.booleans()):
                out.append((prog[k], prog[k + 1]))
                k += 2
            else:
                out.append(prog[k])
                k += 1
        progs.append(out)
    return Schedule.from_programs(s.config, progs)


def _oracle_graph(s: Schedule) -> nx.DiGraph:
    """The schedule's edges plus, independently derived, the waits of its pairs."""
    g = nx.DiGraph(s.graph)
    for a, b in s.pairs:
        for p in s.graph.predecessors(b):
            if p != a and s.graph.edges[p, b]["kind"] & EdgeKind.DATA:
                g.add_edge(p, a)
    return g


def _check(s: Schedule) -> None:
    deps = s.deps  # numbered from the programs, before the graph exists
    g = s.graph
    twin = Schedule(s.config, g).deps  # numbered from the graph, as a graph-built one is
    for field in ("ops", "preds", "data_preds", "succs", "pair_waits", "order"):
        assert getattr(deps, field) == getattr(twin, field), field
    ops = deps.ops
    assert deps is s.deps  # built once
    assert ops == tuple(op for prog in s.programs for op in prog)
    assert set(ops) == set(g.nodes) and len(deps) == g.number_of_nodes()
    assert all(deps.index[op] == i for i, op in enumerate(ops))
    for i, op in enumerate(ops):
        assert [ops[j] for j in deps.preds[i]] == list(g.predecessors(op))
        assert {ops[j] for j in deps.succs[i]} == set(g.successors(op))
        assert {ops[j] for j in deps.data_preds[i]} == {
            p for p in g.predecessors(op) if g.edges[p, op]["kind"] & EdgeKind.DATA}
    want_waits = {(p, a, b) for a, b in s.pairs for p in g.predecessors(b)
                  if p != a and g.edges[p, b]["kind"] & EdgeKind.DATA}
    assert {(ops[p], ops[a], ops[b]) for p, a, b in deps.pair_waits} == want_waits
    h = _oracle_graph(s)
    order = [ops[i] for i in deps.order]
    assert len(set(order)) == len(order)
    if nx.is_directed_acyclic_graph(h):
        assert deps.acyclic and deps.blocked() == []
        place = deps.place()
        assert all(place[deps.index[u]] < place[deps.index[v]] for u, v in h.edges)
        sorter = TopologicalSorter({op: list(h.predecessors(op)) for op in g})
        assert order == list(sorter.static_order())
    else:
        assert not deps.acyclic
        on_cycle = {op for comp in nx.strongly_connected_components(h) if len(comp) > 1
                    for op in comp}
        behind = set(on_cycle)
        for op in on_cycle:
            behind |= nx.descendants(h, op)
        assert {ops[i] for i in deps.blocked()} == behind
        assert set(order) == set(g.nodes) - behind


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedules(SMALL))
def test_index_matches_networkx(s: Schedule) -> None:
    _check(s)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(paired())
def test_index_with_pairs_matches_networkx(s: Schedule) -> None:
    _check(s)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_index_of_deadlocked_schedules(data: st.DataObject) -> None:
    s = data.draw(schedules(SMALL))
    m = data.draw(mutations(s, kinds=("reorder-cycle",)))
    broken = Schedule.from_programs(m.config, m.programs)
    _check(broken)
    assert not broken.deps.acyclic, m.description


@pytest.mark.parametrize("name", library.names())
def test_library_schedules(name: str) -> None:
    _check(library.get(name, 4, 8))


@pytest.mark.parametrize("name, pipeline", [
    (name, pipeline) for name in ("1f1b", "interleaved-1f1b", "zb-v", "dualpipe-v")
    for pipeline in ("dp-reduce", "recompute{all=true}", "offload{budget=2}", "split-backward",
                     "split-backward,dp-reduce")
    if (name, pipeline) != ("zb-v", "offload{budget=2}")])  # (its rank 1 cannot fit 2)
def test_library_schedules_after_passes(name: str, pipeline: str) -> None:
    """Gradient reductions, memory ops and split backwards, numbered from the programs as
    from the graph."""
    from pipeir.passes import PassManager, parse_pipeline

    _check(PassManager(parse_pipeline(pipeline)).optimize(library.get(name, 2, 4)).schedule)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.permutations(range(n)),
    st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1)), max_size=3 * n))))
def test_topological_order_is_networkx_order(case: tuple[list[int], list[tuple[int, int]]]
                                             ) -> None:
    nodes, pairs = case
    edges = [(min(u, v), max(u, v)) for u, v in pairs if u != v]  # acyclic: low to high
    g: nx.DiGraph = nx.DiGraph()
    g.add_nodes_from(nodes)
    g.add_edges_from(edges)
    assert topological_order(nodes, edges) == list(nx.topological_sort(g))


def test_topological_order_rejects_a_cycle() -> None:
    with pytest.raises(ValueError, match="cycle"):
        topological_order(["a", "b", "c"], [("a", "b"), ("b", "c"), ("c", "b")])


def test_a_dropped_index_is_built_again_the_same() -> None:
    """`Schedule.drop_index` (lowering drops the index once it has what it needs, to lower
    and prove large programs in less memory) only forgets the cache: the next use builds
    an equal index, and a compiled schedule still simulates."""
    from pipeir.passes import PassContext, PassManager, parse_pipeline
    from pipeir.sim import CostModel, simulate

    s = library.get("interleaved-1f1b", 2, 4, v=2)
    before = s.deps
    fields = ("ops", "preds", "data_preds", "succs", "pair_waits", "order")
    s.drop_index()
    again = s.deps
    assert again is not before and again is s.deps
    assert all(getattr(again, f) == getattr(before, f) for f in fields)
    compiled = PassManager(parse_pipeline("overlap"),
                           context=PassContext(CostModel())).compile(s)
    assert simulate(compiled.schedule, CostModel()).makespan == simulate(s, CostModel()).makespan
