"""The IR itself: the graph built by the fast path equals the one networkx's API builds."""

from __future__ import annotations

from itertools import pairwise

import networkx as nx

import pipeir
from pipeir.schedule import data_predecessors


def test_fast_graph_equals_public_api_graph() -> None:
    s = pipeir.library.get("interleaved-1f1b", 3, 6, v=2)
    ref = nx.DiGraph()
    ref.add_nodes_from(s.graph.nodes(data=True))
    ref.add_edges_from(s.graph.edges(data=True))
    assert nx.utils.graphs_equal(ref, s.graph)
    # the derived data edges are exactly the dependency rule
    present = set(s.graph)
    want = {(p, op) for op in present for p in data_predecessors(op, present, s.config.stages)}
    assert set(s.data_edges()) == want
    assert nx.is_directed_acyclic_graph(s.graph)
    assert s.graph.number_of_edges() == len(want | {
        (a, b) for prog in s.programs for a, b in pairwise(prog)})
