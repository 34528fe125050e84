"""The IR itself: the graph the builder makes, checked against the dependency rules written out
by hand here (not through `data_predecessors`, which the builder uses)."""

from __future__ import annotations

import re
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import networkx as nx
import pytest

import pipeir
from pipeir import B, F, I, W
from pipeir.diagnostics import Source, Span
from pipeir.schedule import EdgeKind, ScheduleBuilder

EXAMPLE = Path(__file__).parent.parent / "examples" / "interleaved.sched"


def _expected_data_edges(s: pipeir.Schedule) -> set[tuple[pipeir.Op, pipeir.Op]]:
    ops = set(s.graph)
    last = s.config.stages - 1
    want = set()
    for o in ops:
        st, m = o.stage, o.mb
        if o.kind == "F" and st > 0:
            want.add((F(st - 1, m), o))
        if o.kind in "BI":
            want.add((F(st, m), o))
            if st < last:
                want.add((B(st + 1, m) if B(st + 1, m) in ops else I(st + 1, m), o))
        if o.kind == "W":
            want.add((I(st, m), o))
    return want


@pytest.mark.parametrize("s", [
    pipeir.library.get("interleaved-1f1b", 3, 6, v=2),
    pipeir.library.get("zb-v", 2, 4),
    pipeir.library.get("dualpipe-v", 2, 4),
], ids=["interleaved", "zb-v", "dualpipe-v"])
def test_graph_is_the_dependency_rules_plus_program_order(s: pipeir.Schedule) -> None:
    data = {(u, v) for u, v, k in s.graph.edges(data="kind") if k & EdgeKind.DATA}
    order = {(u, v) for u, v, k in s.graph.edges(data="kind") if k & EdgeKind.ORDER}
    assert data == _expected_data_edges(s)
    assert order == {e for prog in s.programs for e in pairwise(prog)}
    assert set(s.graph.edges) == data | order
    ref = nx.DiGraph()  # the same graph through networkx's public API
    ref.add_nodes_from((op, {"rank": r, "pos": i, "span": s.span_of(op)})
                       for r, prog in enumerate(s.programs) for i, op in enumerate(prog))
    ref.add_edges_from((u, v, {"kind": (EdgeKind.DATA if (u, v) in data else 0)
                                | (EdgeKind.ORDER if (u, v) in order else 0)})
                       for u, v in data | order)
    for a, b in s.pairs:
        ref.nodes[a]["pair_next"], ref.nodes[b]["pair_prev"] = b, a
    assert nx.utils.graphs_equal(ref, s.graph)
    assert nx.is_directed_acyclic_graph(s.graph)
    built = pipeir.Schedule(s.config, ref)  # a schedule made from a hand-built graph
    assert built == s and built.pairs == s.pairs and built.spans() == s.spans()
    ref.remove_edges_from(list(ref.edges))  # (checked when made: the caller's later edit
    assert nx.utils.graphs_equal(built.graph, s.graph)  # is not the schedule's)
    assert built.deps.order == s.deps.order and built.deps.pair_waits == s.deps.pair_waits


def _bent(edit: Callable[[nx.DiGraph], object]) -> nx.DiGraph:
    g = nx.DiGraph(pipeir.library.get("dualpipe-v", 2, 4).graph)
    edit(g)
    return g


@pytest.mark.parametrize(("graph", "kind", "message"), [
    (_bent(lambda g: g.remove_edge(F(0, 0), F(1, 0))), ValueError,
     "graph lacks the edge F(0,0) -> F(1,0) (EdgeKind.DATA) that its programs imply: a "
     "schedule's edges follow from its programs (program order and the data rules)"),
    (_bent(lambda g: g.add_edge(F(0, 3), F(1, 0), kind=EdgeKind.DATA)), ValueError,
     "graph edge F(0,3) -> F(1,0) is EdgeKind.DATA, but its programs imply no edge"),
    (_bent(lambda g: g.edges[F(0, 0), F(1, 0)].update(kind=EdgeKind.ORDER)), ValueError,
     "graph edge F(0,0) -> F(1,0) is EdgeKind.ORDER, but its programs imply EdgeKind.DATA"),
    (_bent(lambda g: g.edges[F(0, 0), F(1, 0)].pop("kind")), ValueError,
     "graph edge F(0,0) -> F(1,0) is kind None, but its programs imply EdgeKind.DATA"),
    (_bent(lambda g: g.nodes[F(0, 0)].update(pos=5)), ValueError,
     "graph: rank 0's 'pos' attributes must number its ops 0 to 18, each once, but no op "
     "has pos 0"),
    (_bent(lambda g: g.nodes[F(0, 0)].update(pos=-1)), ValueError,
     "graph: rank 0's 'pos' attributes must number its ops 0 to 18, each once, but F(0,0) "
     "has pos -1"),
    (_bent(lambda g: g.nodes[F(0, 1)].update(pos=0)), ValueError,
     "graph: rank 0's 'pos' attributes must number its ops 0 to 18, each once, but two ops "
     "have pos 0"),
    (_bent(lambda g: g.nodes[F(0, 0)].update(rank=2)), ValueError,
     "graph node F(0,0) is on rank 2, but ranks are 0 to 1"),
    (_bent(lambda g: g.add_node("x")), ValueError,
     "graph node 'x': expected integer 'rank' and 'pos' attributes"),
    (_bent(lambda g: g.nodes[F(0, 3)].update(pair_next=F(0, 0))), ValueError,
     "graph node F(0,3): its pair_next F(0,0) is not the next op of rank 0's program"),
    ({}, TypeError, "Schedule(config, graph): expected a networkx DiGraph of ops, got dict"),
], ids=["missing-edge", "extra-edge", "wrong-kind", "no-kind", "pos", "pos-negative",
                       "pos-twice", "rank", "not-an-op",
        "pair", "not-a-graph"])
def test_a_graph_is_held_to_the_edges_its_programs_imply(graph: object, kind: type,
                                                          message: str) -> None:
    """A schedule made from a graph does not trust its edges: the verifier, simulator and
    lowering read edges derived from the programs, so a graph whose edges differ would be
    checked and timed as another schedule than it shows."""
    config = pipeir.library.get("dualpipe-v", 2, 4).config
    with pytest.raises(kind) as e:
        pipeir.Schedule(config, graph)  # type: ignore[arg-type]
    assert str(e.value).startswith(message), str(e.value)


def test_w_without_i_still_depends_on_f() -> None:
    cfg = pipeir.PipelineConfig.make(ranks=1, microbatches=1)
    s = pipeir.Schedule.from_programs(cfg, [[F(0, 0), W(0, 0)]])
    assert (F(0, 0), W(0, 0)) in set(s.data_edges())
    with pytest.raises(pipeir.VerifyError) as e:
        pipeir.verify(s)
    assert e.value.check == "completeness" and "missing I(0,0)" in e.value.render()


def test_a_schedule_pickled_in_one_process_works_in_another(tmp_path: Path) -> None:
    """Spawned ranks and caches unpickle ops in a process whose string hashes differ: the
    ops must still be found in the graph's dicts there (a cached hash once travelled)."""
    import os
    import subprocess
    import sys

    path = tmp_path / "s.pkl"
    dump = ("import pickle, sys, pipeir\n"
            "s = pipeir.parse(sys.argv[2])\n"
            "pickle.dump((s, pipeir.simulate(s).makespan), open(sys.argv[1], 'wb'))\n")
    load = ("import pickle, sys, pipeir\n"
            "s, step = pickle.load(open(sys.argv[1], 'rb'))\n"
            "assert pipeir.F(0, 0) in s.graph and pipeir.F(0, 0) in set(s.programs[0])\n"
            "pipeir.verify(s)\n"
            "assert pipeir.simulate(s).makespan == step\n")
    for code, seed in ((dump, "1"), (load, "2")):
        subprocess.run([sys.executable, "-c", code, str(path), str(EXAMPLE)], check=True,
                       timeout=120,
                       env={**os.environ, "PYTHONHASHSEED": seed})


def test_a_builder_that_goes_on_after_build_leaves_the_built_schedule_alone() -> None:
    """A built schedule keeps what the builder held then (it shares none of its state)."""
    from pipeir.schedule import ScheduleBuilder

    b = ScheduleBuilder(pipeir.PipelineConfig.make(ranks=1, microbatches=2))
    b.add(0, F(0, 0))
    b.add(0, B(0, 0))
    first = b.build()
    b.add(0, F(0, 1))
    b.add(0, B(0, 1))
    second = b.build()
    assert (len(first), len(second)) == (2, 4)
    assert F(0, 1) not in first and first.program(0) == (F(0, 0), B(0, 0))
    assert set(first.graph) == {F(0, 0), B(0, 0)}


def test_anything_not_an_op_is_not_in_a_schedule() -> None:
    s = pipeir.library.get("1f1b", 2, 2)
    assert F(0, 0) in s and F(0, 5) not in s
    assert [1] not in s and "F(0,0)" not in s and None not in s  # (unhashable: no TypeError)


def test_a_duplicate_names_the_rank_and_place_of_the_first() -> None:
    """The builder keeps only each op's span; the rank of the first occurrence is found
    when a duplicate is reported, and the refused op leaves the builder as it was."""
    b = ScheduleBuilder(pipeir.PipelineConfig.make(ranks=2, microbatches=1))
    src = Source("s.sched", "\n" * 5)
    first = Span(src, 3, 5, 3, 11)
    b.add(1, F(1, 0), first)
    b.add(0, F(0, 0))
    with pytest.raises(pipeir.VerifyError) as e:
        b.add(0, F(1, 0), Span(src, 4, 5, 4, 11))
    d = e.value.diagnostics[0]
    assert d.message == "duplicate op F(1,0): it already runs on rank 1"
    assert [n.message for n in d.notes] == [
        "first F(1,0) is here", "stage 1 lives on rank 1, so rank 0 should not run F(1,0)"]
    assert d.notes[0].span == first
    for rank, op in ((1, B(1, 0)), (0, B(0, 0))):
        b.add(rank, op)
    s = b.build()
    assert s.programs == ((F(0, 0), B(0, 0)), (F(1, 0), B(1, 0)))
    assert s.span_of(F(1, 0)) == first and s.span_of(F(0, 0)) is None
    assert (s.rank_of(F(1, 0)), s.position_of(B(1, 0))) == (1, 1)


@pytest.mark.parametrize(("program", "message"), [
    (["F(0,0)"], "rank 0's program: expected an op (e.g. pipeir.F(0, 0)) or an overlapped "
                 "pair of two, got str 'F(0,0)'"),
    ([(F(0, 0), 1)], "got int 1"),
    ([(F(0, 0), B(0, 0), W(0, 0))], "rank 0's program: an overlapped pair is two ops, got 3"),
])
def test_programs_of_other_things_than_ops_are_refused_up_front(program: list[object],
                                                                message: str) -> None:
    """Not an AttributeError from deep inside verify, later."""
    cfg = pipeir.PipelineConfig.make(ranks=1, microbatches=1)
    with pytest.raises(TypeError, match=re.escape(message)):
        pipeir.Schedule.from_programs(cfg, [program])  # type: ignore[list-item]
