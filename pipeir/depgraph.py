"""A schedule's dependency graph, numbered once: the index verify, timing and lowering read.

`Schedule.graph` (networkx) is the public, documented IR graph; this is its compact twin,
built once per schedule on first use (`Schedule.deps`) because every consumer wants the
same things: ops numbered 0..n-1 (program order, rank by rank), per-op predecessor and
successor numbers by edge kind, the waits that overlapped pairs add, and one topological
order. Numbers instead of ops matter at scale: hashing an `Op` is a Python-level call, and a
sweep over 65k ops would otherwise hash each a few dozen times.

NOTE (the order): `order` is exactly the sequence `graphlib.TopologicalSorter.static_order`
gives for the schedule's edges plus the pair waits, with nodes in graph order: a FIFO Kahn
sort whose first wave is in the order graphlib first meets each node. Lowering breaks ties
between events at one time by it, so its lowered programs (golden files) depend on it;
verify and the simulator only need some topological order (their results are longest paths
and reachability, which no valid order changes).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pipeir.ops import Op

T = TypeVar("T")


@dataclass(frozen=True, slots=True, eq=False)
class DepGraph:
    """Ops numbered 0..n-1 with their edges as number tuples, the pair waits, and one
    topological order (shorter than `ops` when the schedule deadlocks)."""

    #: every op, numbered in program order rank by rank
    ops: tuple[Op, ...]
    #: op -> its number
    index: Mapping[Op, int]
    #: per op, every predecessor (data or program order), in the graph's adjacency order
    preds: tuple[tuple[int, ...], ...]
    #: per op, its DATA predecessors (a subset of `preds`)
    data_preds: tuple[tuple[int, ...], ...]
    #: per op, every successor (data or program order)
    succs: tuple[tuple[int, ...], ...]
    #: what overlapped pairs add: (p, first, second) for every input p of a pair's second op
    #: other than its first, which the first must also wait for (the two start together)
    pair_waits: tuple[tuple[int, int, int], ...]
    #: a topological order of `preds` plus the pair waits (see the module NOTE)
    order: tuple[int, ...]

    @classmethod
    def number(cls, programs: Sequence[Sequence[Op]], where: Iterable[Op],
               pairs: Iterable[tuple[Op, Op]],
               inputs: Callable[[Op, Callable[[str, int, int], Op | None]], list[Op]]
               ) -> DepGraph:
        """Number a schedule given without its graph: `where` lists its ops in the graph's
        node order, `inputs(op, lookup)` gives each op's data inputs (looked up by kind,
        stage and micro-batch). The result equals `of` on the graph the schedule would build:
        each op's program-order predecessor first, then its data inputs in `inputs` order."""
        ops = tuple(op for prog in programs for op in prog)
        num = _numbers(len(ops))
        index = dict(zip(ops, num))
        lookup = _finder(ops)
        preds: list[tuple[int, ...]] = []
        data_preds: list[tuple[int, ...]] = []
        j = 0
        for prog in programs:
            for k, op in enumerate(prog):
                data = [index[p] for p in inputs(op, lookup)]
                if not k:
                    ps = ds = tuple(data)
                else:
                    before = num[j - 1]
                    if before in data:
                        ps = ds = (before, *[d for d in data if d != before])
                    else:
                        ps, ds = (before, *data), tuple(data)
                preds.append(ps)
                data_preds.append(ds)
                j += 1
        succs: list[list[int]] = [[] for _ in ops]
        for j, ps in zip(num, preds):
            for i in ps:
                succs[i].append(j)
        waits = tuple((p, index[first], index[second]) for first, second in pairs
                      for p in data_preds[index[second]] if p != index[first])
        return cls(ops, index, tuple(preds), tuple(data_preds),
                   tuple(map(tuple, succs)), waits,
                   _static_order([index[op] for op in where], preds, waits))

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def acyclic(self) -> bool:
        """Whether every op can run: the order reaches all of them."""
        return len(self.order) == len(self.ops)

    def blocked(self) -> list[int]:
        """The ops no topological order reaches (empty unless the schedule deadlocks)."""
        reached = bytearray(len(self.ops))
        for i in self.order:
            reached[i] = 1
        return [i for i, r in enumerate(reached) if not r]

    def joins(self) -> list[Sequence[tuple[int, int]]]:
        """Per op, the pair waits it has as a pair's first op: (input p, the partner). (Ops
        without any share one empty tuple: a list per op was 64 bytes of it.)"""
        out: list[Sequence[tuple[int, int]]] = [()] * len(self.ops)
        for p, first, second in self.pair_waits:
            out[first] = (*out[first], (p, second))
        return out

    def place(self) -> Sequence[int]:
        """Each op's position in `order`, by number (machine integers: an int object per op
        was 40 bytes of a large lowering's peak)."""
        out = array("q", bytes(8 * len(self.ops)))
        for k, i in enumerate(self.order):
            out[i] = k
        return out


def _finder(ops: Sequence[Op]) -> Callable[[str, int, int], Op | None]:
    """`lookup(kind, stage, mb)`: the op of `ops` with that kind, stage and micro-batch.

    NOTE (memory): per kind, a list by stage and micro-batch, not a dict keyed by
    (kind, stage, mb): those keys (64-byte tuples, made while the index's own tuples of that
    size are and then freed) left a large schedule's pools of that size a quarter empty for
    the rest of its compile. Ops outside the grid (a reduction's micro-batch, or stages a
    schedule that verify will reject names) are looked up in a dict."""
    stages = 1 + max((op.stage for op in ops), default=0)
    mbs = 1 + max((op.mb for op in ops), default=0)
    if stages * mbs > 4 * len(ops) + 1024:  # (sparse: a dict is smaller)
        stages = mbs = 0
    grid: dict[str, list[Op | None]] = {}
    odd: dict[tuple[str, int, int], Op] = {}
    for op in ops:
        s, m = op.stage, op.mb
        if 0 <= s < stages and 0 <= m < mbs:
            row = grid.get(op.kind)
            if row is None:
                row = grid[op.kind] = [None] * (stages * mbs)
            row[s * mbs + m] = op
        else:
            odd[op.kind, s, m] = op

    def lookup(kind: str, s: int, m: int) -> Op | None:
        if 0 <= s < stages and 0 <= m < mbs:
            row = grid.get(kind)
            return None if row is None else row[s * mbs + m]
        return odd.get((kind, s, m))
    return lookup


def _numbers(n: int) -> list[int]:
    """0..n-1 as one list of int objects, which every number in the index then shares.

    NOTE (memory): an int above 256 is an object of 32 bytes, and `enumerate`, `j - 1` and
    the like make a new one each time: the index of a large schedule held three or four
    objects per op for the same number (a fifth of its memory) until its tuples shared
    these."""
    return list(range(n))


def kahn_order(succs: Sequence[Iterable[int]], indeg: list[int],
               first: Iterable[int] | None = None) -> list[int]:
    """The numbers a FIFO Kahn sort reaches: each after all its predecessors. `indeg` (each
    node's predecessor count) is used up; `first` orders the initial wave (default: by
    number). Nodes on or behind a cycle are left out."""
    ready = [i for i in (range(len(indeg)) if first is None else first) if not indeg[i]]
    k = 0
    while k < len(ready):
        i = ready[k]
        k += 1
        for q in succs[i]:
            indeg[q] -= 1
            if not indeg[q]:
                ready.append(q)
    return ready


def topological_order(nodes: Sequence[T], edges: Iterable[tuple[T, T]]) -> list[T]:
    """`nodes` in an order that puts every edge's source before its target: the order
    networkx's `topological_sort` gives for a graph built from `nodes` then `edges` (FIFO
    Kahn, first wave in node order, successors in first-edge order). For graphs other than
    a schedule's (synth's problem edges); a cycle is a ValueError."""
    index = {x: i for i, x in enumerate(nodes)}
    succs: list[dict[int, None]] = [{} for _ in nodes]
    for src, dst in edges:
        succs[index[src]][index[dst]] = None
    indeg = [0] * len(nodes)
    for ss in succs:
        for j in ss:
            indeg[j] += 1
    order = kahn_order(succs, indeg)
    if len(order) < len(nodes):
        raise ValueError("the graph has a cycle")
    return [nodes[i] for i in order]


def _static_order(node_order: Sequence[int], preds: Sequence[tuple[int, ...]],
                  waits: Sequence[tuple[int, int, int]]) -> tuple[int, ...]:
    """graphlib's static_order of {node: preds (+ pair waits)} in `node_order`, reproduced
    on numbers (see the module NOTE): successors listed in the order graphlib adds them
    (by consumer, in node order), the first wave in the order it first meets each node."""
    extra: dict[int, list[int]] = {}
    for p, first, _ in waits:
        if p not in preds[first]:
            ws = extra.setdefault(first, [])
            if p not in ws:
                ws.append(p)
    n = len(preds)
    succs: list[list[int]] = [[] for _ in range(n)]
    indeg = [0] * n
    seen = bytearray(n)
    met: list[int] = []
    for i in node_order:
        if not seen[i]:
            seen[i] = 1
            met.append(i)
        deps = preds[i] if i not in extra else (*preds[i], *extra[i])
        indeg[i] = len(deps)
        for p in deps:
            succs[p].append(i)
            if not seen[p]:
                seen[p] = 1
                met.append(p)
    return tuple(kahn_order(succs, indeg, met))
