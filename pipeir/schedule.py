"""The schedule IR: a pipeline config plus each rank's ops in order, viewed as a dependency
graph (a networkx DiGraph whose nodes are the ops).

Node attributes: ``rank`` (who runs it), ``pos`` (index in that rank's program) and ``span``
(where the user wrote it, or None); the two ops of an overlapped pair (run together, as in
DualPipe) are next to each other in program order and carry ``pair_next`` / ``pair_prev``.
Edge attribute ``kind`` is an `EdgeKind` flag set: DATA for a tensor dependency, ORDER for
"runs next on the same rank"; an edge can be both. A gradient reduction R(s) (data
parallelism) has a DATA edge from every weight-gradient op of its stage and none out: only
the optimizer step, outside the schedule, waits for it.

NOTE: the per-rank programs are the schedule; the dependency rules (`data_predecessors`)
derive its edges. Two views are built from them on first use and cached (so treat a built
Schedule as immutable: passes build new schedules): the numbered dependency index,
`Schedule.deps` (`pipeir.depgraph`), which the verifier, the simulator, lowering and synth
read, and the networkx graph, `Schedule.graph`, which compiling never builds (it is most of a
large schedule's memory). A schedule made from a graph (`Schedule(config, graph)`) reads its
programs, spans and pairs from the graph's nodes, and its edges must be the ones the rules
derive from those programs (`_read_graph`): an edge missing or added by hand is an error, not a
silently different simulation. A Schedule can never hold the same op twice: the builder
rejects duplicates.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from enum import IntFlag
from itertools import pairwise
from typing import Any

import networkx as nx

from pipeir import limits
from pipeir.config import PipelineConfig
from pipeir.depgraph import DepGraph
from pipeir.diagnostics import Diagnostic, Note, Span, VerifyError
from pipeir.ops import REDUCE, Op


class EdgeKind(IntFlag):
    DATA = 1  # the target consumes what the source produces
    ORDER = 2  # the target runs right after the source on the same rank


def data_predecessors(op: Op, present: Mapping[Op, Any] | set[Op], stages: int,
                      microbatches: int = 0) -> list[Op]:
    """The ops whose results `op` consumes, among those `present`.

    F(s) needs F(s-1); the first backward of the last stage needs its F; B/I(s) needs F(s) and
    the input-gradient of stage s+1 (from B(s+1) or I(s+1)); W(s) needs I(s) (or F(s) if the
    schedule has no I(s), which verification reports); R(s) needs the weight gradients of
    every micro-batch of stage s (each B(s, mb) or W(s, mb)). Memory ops: a checkpointed
    forward FC stands where F would; RC(s) needs FC(s), and B/I(s) needs RC(s) instead of the
    forward; OFF(s) needs F(s), RELOAD(s) needs OFF(s), and B/I(s) needs RELOAD(s) too. Every
    one of these is on the stage's rank, so the program order checks "RC before the backward".
    """
    def lookup(kind: str, s: int, m: int) -> Op | None:
        o = Op(kind, s, m)  # type: ignore[arg-type]
        return o if o in present else None
    return _predecessors(op, lookup, stages, microbatches)


def _predecessors(op: Op, lookup: Callable[[str, int, int], Op | None],
                  stages: int, microbatches: int) -> list[Op]:
    kind, s, m = op.kind, op.stage, op.mb
    if kind == "F" or kind == "FC":
        found = [lookup("F", s - 1, m) or lookup("FC", s - 1, m)] if s > 0 else []
    elif kind in ("B", "I"):
        found = [lookup("RC", s, m) or lookup("F", s, m) or lookup("FC", s, m),
                 lookup("RELOAD", s, m)]
        if s + 1 < stages:
            found.append(lookup("B", s + 1, m) or lookup("I", s + 1, m))
    elif kind == "R":
        found = [lookup("B", s, k) or lookup("W", s, k) for k in range(microbatches)]
    elif kind == "W":
        found = [lookup("I", s, m) or lookup("F", s, m) or lookup("FC", s, m)]
    elif kind == "RC":
        found = [lookup("FC", s, m)]
    elif kind == "OFF":
        found = [lookup("F", s, m)]
    else:  # RELOAD
        found = [lookup("OFF", s, m)]
    return [p for p in found if p is not None]


class Schedule:
    """A pipeline schedule: which rank runs which op, in what order.

    Build one with `Schedule.from_programs` (or `ScheduleBuilder`), from the language with
    `pipeir.parse`, or from the library with `pipeir.library.get`.
    """

    def __init__(self, config: PipelineConfig, graph: nx.DiGraph, name: str = "schedule",
                 span: Span | None = None):
        self.config = config
        self.name = name
        #: where the schedule is defined, for errors that no single op can carry
        self.span = span
        #: the library name and the place a file used this schedule by (`schedule = 1f1b`):
        #: findings that point into the library name that place too (`pipeir.verify`)
        self.used_as: tuple[str, Span] | None = None
        self._graph: nx.DiGraph | None = graph
        #: op -> its span, in the order the ops were added (the graph's). NOTE: the span
        #: alone, not (rank, position, span): a tuple and an int per op were a fifth of a
        #: large schedule's memory, held through its whole compile, while only error
        #: messages and views ask an op's rank or position (`_at`, made when first asked)
        self._where: dict[Op, Span | None] | None = None
        self._at: dict[Op, tuple[int, int]] | None = None
        self._programs: tuple[tuple[Op, ...], ...] | None = None
        self._pairs: tuple[tuple[Op, Op], ...] | None = None
        self._next: dict[Op, Op] | None = None
        self._prev: dict[Op, Op] | None = None
        self._deps: DepGraph | None = None
        if graph is not None:
            made = _read_graph(config, graph, name)
            self._graph = graph.copy()  # (checked once: a later edit of the caller's is not)
            self._where, self._programs = made._where, made._programs
            self._next, self._deps = made._next, made._deps

    @classmethod
    def _compact(cls, config: PipelineConfig, where: dict[Op, Span | None],
                 programs: tuple[tuple[Op, ...], ...], pairs: Sequence[tuple[Op, Op]],
                 name: str, span: Span | None) -> Schedule:
        """A schedule without its networkx graph, which is built on first use of `graph`.

        NOTE: at scale the graph is most of a schedule's memory (about 1.6 KB per op of
        node, adjacency and edge dicts) and a fifth of building it, while compiling reads
        only the programs and `deps`; `deps` is numbered straight from the programs, in the
        graph's own order (tests/test_depgraph.py holds it to the graph).
        """
        made = cls(config, None, name, span)  # type: ignore[arg-type]
        made._where, made._programs = where, programs
        made._next = dict(pairs)
        return made

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_programs(cls, config: PipelineConfig,
                      programs: Sequence[Iterable[Op | tuple[Op, Op]]],
                      name: str = "schedule",
                      spans: Mapping[Op, Span | None] | None = None) -> Schedule:
        """Build a schedule from one op list per rank (`programs[r]` runs on rank r).

        An item `(a, b)` is an overlapped pair: two ops the rank runs together.
        """
        b = ScheduleBuilder(config, name)  # (it checks the config and the name)
        if not isinstance(programs, Sequence) or \
                not all(isinstance(p, Iterable) and not isinstance(p, Op) for p in programs):
            raise TypeError(f"programs: expected one list of ops per rank, got "
                            f"{reprlib.repr(programs)}")
        if spans is not None and not isinstance(spans, Mapping):
            raise TypeError(f"spans: expected a mapping of ops to spans, got "
                            f"{type(spans).__name__}")
        if len(programs) != config.ranks:
            raise ValueError(f"expected {config.ranks} programs (one per rank), "
                             f"got {len(programs)}")
        for r, prog in enumerate(programs):
            for item in prog:
                if isinstance(item, tuple):
                    if len(item) != 2:
                        raise TypeError(f"rank {r}'s program: an overlapped pair is two ops, "
                                        f"got {len(item)} items {item!r}")
                    x, y = item
                    b.add_pair(r, x, y, None if spans is None else spans.get(x),
                               None if spans is None else spans.get(y))
                else:
                    b.add(r, item, None if spans is None else spans.get(item))
        return b.build()

    def with_programs(self, programs: Sequence[Iterable[Op | tuple[Op, Op]]],
                      name: str | None = None,
                      config: PipelineConfig | None = None) -> Schedule:
        """A new schedule with other programs. Spans of ops that survive are kept, and so are
        overlapped pairs whose two ops are still next to each other, in order, on one rank."""
        spans = self.spans()
        pairs = dict(self.pairs)
        if pairs:
            kept: list[list[Op | tuple[Op, Op]]] = []
            for prog in programs:
                out: list[Op | tuple[Op, Op]] = []
                for item in prog:
                    prev = out[-1] if out else None
                    if isinstance(prev, Op) and isinstance(item, Op) and pairs.get(prev) == item:
                        out[-1] = (prev, item)
                    else:
                        out.append(item)
                kept.append(out)
            programs = kept
        made = Schedule.from_programs(config or self.config, programs, name or self.name, spans)
        made.span, made.used_as = self.span, self.used_as
        return made

    # ---- views ------------------------------------------------------------------------------
    @property
    def graph(self) -> nx.DiGraph:
        """The dependency graph (networkx; see the module docstring), built on first use."""
        if self._graph is None:
            where = self._spans()
            self._graph = _digraph(where, self._places(),
                                   _edges(self.deps, where, self.programs), self.pairs)
        return self._graph

    def _spans(self) -> dict[Op, Span | None]:
        if self._where is None:
            self._where = {op: a["span"] for op, a in self.graph.nodes(data=True)}
        return self._where

    def _places(self) -> dict[Op, tuple[int, int]]:
        """op -> (rank, position in its program)."""
        if self._at is None:
            self._at = {op: (r, pos) for r, prog in enumerate(self.programs)
                        for pos, op in enumerate(prog)}
        return self._at

    @property
    def programs(self) -> tuple[tuple[Op, ...], ...]:
        """Each rank's ops in program order."""
        if self._programs is None:
            progs: list[list[tuple[int, Op]]] = [[] for _ in range(self.config.ranks)]
            for op, a in self.graph.nodes(data=True):
                progs[a["rank"]].append((a["pos"], op))
            self._programs = tuple(tuple(op for _, op in sorted(p, key=_first)) for p in progs)
        return self._programs

    def program(self, rank: int) -> tuple[Op, ...]:
        """The ops rank `rank` runs, in order."""
        if type(rank) is not int or not 0 <= rank < self.config.ranks:  # (-1 was the last)
            raise IndexError(f"no rank {rank!r}: ranks are 0 to {self.config.ranks - 1}")
        return self.programs[rank]

    def rank_of(self, op: Op) -> int:
        return self._place(op)[0]

    def position_of(self, op: Op) -> int:
        """`op`'s index in its rank's program."""
        return self._place(op)[1]

    def _place(self, op: Op) -> tuple[int, int]:
        found = self._places().get(op)
        if found is None:
            raise KeyError(f"{op!s} is not an op of schedule '{self.name}'")
        return found

    def _pair_next(self) -> dict[Op, Op]:
        if self._next is None:
            self._next = {op: p for op, p in self.graph.nodes(data="pair_next")
                          if p is not None}
        return self._next

    @property
    def pairs(self) -> tuple[tuple[Op, Op], ...]:
        """Overlapped pairs (first, second), in program order."""
        if self._pairs is None:
            nxt = self._pair_next()
            self._pairs = () if not nxt else tuple(
                (op, nxt[op]) for prog in self.programs for op in prog if op in nxt)
        return self._pairs

    @property
    def deps(self) -> DepGraph:
        """The dependency graph numbered once (`pipeir.depgraph`): what verify, timing,
        lowering and synth read, built on first use and cached with this schedule."""
        if self._deps is None:
            self._deps = DepGraph.number(
                self.programs, self._spans(), self.pairs,
                lambda op, lookup: _predecessors(op, lookup, self.config.stages,
                                                 self.config.microbatches))
        return self._deps

    def drop_index(self) -> None:
        """Forget the numbered index (`deps`); its next use builds it again. For the index's
        last user while the schedule lives on: lowering, after which compile holds the
        schedule while it proves the programs (at scale the index was a third of lowering's
        peak memory)."""
        self._deps = None

    def pair_of(self, op: Op) -> Op | None:
        """The op `op` runs together with, if it is half of an overlapped pair."""
        return self.pair_next(op) or self.pair_prev(op)

    def pair_next(self, op: Op) -> Op | None:
        """The second op of the overlapped pair `op` opens, if it opens one."""
        return self._pair_next().get(op)

    def pair_prev(self, op: Op) -> Op | None:
        """The first op of the overlapped pair `op` closes, if it closes one."""
        if not self._pair_next():
            return None
        if self._prev is None:
            self._prev = {b: a for a, b in self._pair_next().items()}
        return self._prev.get(op)

    def span_of(self, op: Op) -> Span | None:
        return self._spans()[op]

    def spans(self) -> dict[Op, Span | None]:
        """Every op's span (None where it has none), in graph order."""
        return dict(self._spans())

    def __contains__(self, op: object) -> bool:
        try:
            return op in self._spans()
        except TypeError:  # unhashable: not an op
            return False

    def __iter__(self) -> Iterator[Op]:
        for prog in self.programs:
            yield from prog

    def __len__(self) -> int:
        return len(self._spans())

    def data_edges(self) -> Iterator[tuple[Op, Op]]:
        for u, v, k in self.graph.edges(data="kind"):
            if k & EdgeKind.DATA:
                yield u, v

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Schedule):
            return NotImplemented
        return (self.config == other.config and self.programs == other.programs
                and self.pairs == other.pairs)

    def __hash__(self) -> int:
        return hash((self.config, self.programs))

    def __repr__(self) -> str:
        c = self.config
        return (f"<Schedule {self.name}: {c.ranks} ranks, {c.stages} stages, "
                f"{c.microbatches} micro-batches, {len(self)} ops>")


def expect_schedule(value: object, where: str) -> Schedule:
    """`value`, if it is a schedule; else a TypeError that says what it is and how to get a
    schedule. The API's functions that take one check it first, so that a wrong argument is
    named where it is given, not met as an AttributeError deep inside."""
    if isinstance(value, Schedule):
        return value
    hint = ""
    if isinstance(getattr(value, "schedule", None), Schedule):  # (pipeir.load's, compile's)
        hint = ": give its .schedule"
    elif isinstance(value, str | os.PathLike):
        hint = (": read a .sched file or text with pipeir.parse(...), or take a library "
                "schedule with pipeir.library.get(name, ranks, microbatches)")
    raise TypeError(f"{where}: expected a Schedule, got {type(value).__name__}{hint}")


def _expect_span(span: object, what: str) -> None:
    """Spans are where errors point (a line of a file): anything else fails there, far from
    the call that gave it."""
    if span is not None and not isinstance(span, Span):
        raise TypeError(f"{what}: expected a pipeir.diagnostics.Span or None, got "
                        f"{type(span).__name__} {span!r}")


def _first(pair: tuple[int, Op]) -> int:
    return pair[0]


class ScheduleBuilder:
    """Collects ops rank by rank, then builds the schedule in one go.

    >>> from pipeir.ops import F, B
    >>> b = ScheduleBuilder(PipelineConfig.make(ranks=1, microbatches=1))
    >>> b.add(0, F(0, 0)); b.add(0, B(0, 0))
    >>> b.build().program(0)
    (Op(kind='F', stage=0, mb=0), Op(kind='B', stage=0, mb=0))
    """

    def __init__(self, config: PipelineConfig, name: str = "schedule",
                 span: Span | None = None):
        if not isinstance(config, PipelineConfig):
            raise TypeError(f"expected a PipelineConfig (PipelineConfig.make(ranks, "
                            f"microbatches, ...)), got {type(config).__name__}")
        if not isinstance(name, str):
            raise TypeError(f"a schedule's name is a string, got {name!r}")
        _expect_span(span, "the schedule's span")
        self.span = span
        self.config = config
        self.name = name
        self._programs: list[list[Op]] = [[] for _ in range(config.ranks)]
        self._where: dict[Op, Span | None] = {}  # (as `Schedule._where`)
        self._pairs: list[tuple[Op, Op]] = []
        self._max_ops = limits.max_ops()

    def add(self, rank: int, op: Op, span: Span | None = None) -> None:
        """Append `op` to rank `rank`'s program. A duplicate op is a VerifyError."""
        if not isinstance(op, Op):  # (else an error far from here, in verify)
            raise TypeError(f"rank {rank}'s program: expected an op (e.g. pipeir.F(0, 0)) or "
                            f"an overlapped pair of two, got {type(op).__name__} {op!r}")
        if type(rank) is not int:  # (numpy's integers are taken as ints)
            if isinstance(rank, bool) or not hasattr(rank, "__index__"):
                raise TypeError(f"{op}: a rank is an integer, got {rank!r}")
            rank = rank.__index__()
        if span is not None and type(span) is not Span:
            _expect_span(span, f"{op}'s span")
        if not 0 <= rank < self.config.ranks:
            raise VerifyError(Diagnostic(
                f"{op} is placed on rank {rank}, but ranks are 0 to {self.config.ranks - 1}",
                span), check="range")
        where = self._where
        n = len(where)
        where.setdefault(op, span)  # (one look-up: it was new if it made the dict longer)
        if len(where) == n:
            # written inside `rank r { ... }`, an op of a missing stage is added by every
            # rank: say what is wrong with it, not that it repeats; of another rank's stage,
            # say whose it is
            c = self.config
            why = c.out_of_range(op.stage, None if op.kind == REDUCE else op.mb)
            if why is not None:
                raise VerifyError(Diagnostic(f"{op}: {why}", span), check="range")
            first = where[op]
            notes = [Note(f"first {op} is here", first)] if first is not None else []
            owner = c.placement[op.stage]
            if owner != rank:
                notes.append(Note(f"stage {op.stage} lives on rank {owner}, so rank {rank} "
                                  f"should not run {op}"))
            raise VerifyError(Diagnostic(
                f"duplicate op {op}: it already runs on rank "
                f"{next(r for r, p in enumerate(self._programs) if op in p)}", span,
                tuple(notes)), check="duplicate")
        if n >= self._max_ops:  # before the memory is spent (pipeir.limits)
            del where[op]  # (not added unless the budget allows it after all)
            limits.check_ops(f"schedule '{self.name}'", n + 1)
            where[op] = span
        self._programs[rank].append(op)

    def add_pair(self, rank: int, first: Op, second: Op, first_span: Span | None = None,
                 second_span: Span | None = None) -> None:
        """Append two ops that rank `rank` runs together (an overlapped pair)."""
        self.add(rank, first, first_span)
        self.add(rank, second, second_span)
        self._pairs.append((first, second))

    def build(self) -> Schedule:
        # (copies: the builder may go on adding and build again)
        return Schedule._compact(self.config, dict(self._where),
                                 tuple(tuple(p) for p in self._programs), tuple(self._pairs),
                                 self.name, self.span)


def _edges(deps: DepGraph, where: Iterable[Op], programs: Sequence[Sequence[Op]]
           ) -> dict[tuple[Op, Op], int]:
    """Every edge with its kind, read off `deps`: program order rank by rank, then each op's
    data inputs in graph order (the order the graph has always been built in)."""
    # Plain ints, not EdgeKind members: IntFlag arithmetic is slow at this scale, and
    # `kind & EdgeKind.DATA` reads the same either way.
    edges: dict[tuple[Op, Op], int] = {}
    order, data = int(EdgeKind.ORDER), int(EdgeKind.DATA)
    for prog in programs:
        for a, b in pairwise(prog):
            edges[a, b] = order
    ops, index, data_preds = deps.ops, deps.index, deps.data_preds
    get = edges.get
    for op in where:
        for i in data_preds[index[op]]:
            key = (ops[i], op)
            edges[key] = get(key, 0) | data
    return edges


def _read_graph(config: PipelineConfig, graph: object, name: str) -> Schedule:
    """The schedule a graph describes (`Schedule(config, graph)`), built from its nodes'
    `rank`, `pos`, `span` and `pair_next` as `from_programs` builds one (so with its checks),
    and held to the graph's edges: they must be exactly the edges its programs imply."""
    if not isinstance(graph, nx.DiGraph):
        raise TypeError(f"Schedule(config, graph): expected a networkx DiGraph of ops, got "
                        f"{type(graph).__name__}; build a schedule from its programs with "
                        f"Schedule.from_programs(config, programs)")
    placed: dict[int, list[tuple[int, Op]]] = {}
    spans: dict[Op, Span | None] = {}
    for op, a in graph.nodes(data=True):
        rank, pos = a.get("rank"), a.get("pos")
        if type(rank) is not int or type(pos) is not int:
            raise ValueError(f"graph node {_node(op)}: expected integer 'rank' and 'pos' "
                             f"attributes (its rank and its place in that rank's program), got "
                             f"rank={rank!r}, pos={pos!r}")
        if not 0 <= rank < config.ranks:
            raise ValueError(f"graph node {_node(op)} is on rank {rank}, but ranks are 0 to "
                             f"{config.ranks - 1}")
        placed.setdefault(rank, []).append((pos, op))
        spans[op] = a.get("span")
    programs: list[list[Op | tuple[Op, Op]]] = []
    for r in range(config.ranks):
        prog = sorted(placed.get(r, ()), key=_first)
        for i, (p, op) in enumerate(prog):
            if p != i:
                why = (f"two ops have pos {p}" if i and p == prog[i - 1][0] else
                       f"{_node(op)} has pos {p}" if p < i else f"no op has pos {i}")
                raise ValueError(f"graph: rank {r}'s 'pos' attributes must number its ops 0 to "
                                 f"{len(prog) - 1}, each once, but {why}")
        items: list[Op | tuple[Op, Op]] = []
        ops = [op for _, op in prog]
        k = 0
        while k < len(ops):
            nxt = graph.nodes[ops[k]].get("pair_next")
            if nxt is None:
                items.append(ops[k])
                k += 1
                continue
            if k + 1 >= len(ops) or ops[k + 1] != nxt:
                raise ValueError(f"graph node {_node(ops[k])}: its pair_next {_node(nxt)} is "
                                 f"not the next op of rank {r}'s program")
            items.append((ops[k], nxt))
            k += 2
        programs.append(items)
    made = Schedule.from_programs(config, programs, name, spans)
    want = _edges(made.deps, made._spans(), made.programs)
    for u, v, kind in graph.edges(data="kind"):
        implied = want.pop((u, v), None)
        if implied != kind:
            given = _kind_text(kind) if isinstance(kind, int) else f"kind {kind!r}"
            raise ValueError(f"graph edge {u} -> {v} is {given}, but its programs imply "
                             f"{_kind_text(implied)}: a schedule's edges follow from "
                             f"its programs (program order and the data rules)")
    if want:
        (u, v), kind = next(iter(want.items()))
        raise ValueError(f"graph lacks the edge {u} -> {v} ({_kind_text(kind)}) that its "
                         f"programs imply: a schedule's edges follow from its programs "
                         f"(program order and the data rules)")
    return made


def _node(op: object) -> str:
    return str(op) if isinstance(op, Op) else repr(op)


def _kind_text(kind: int | None) -> str:
    if not kind:
        return "no edge"
    return " | ".join(f"EdgeKind.{k.name}" for k in EdgeKind if k & kind)


def _digraph(where: dict[Op, Span | None], places: dict[Op, tuple[int, int]],
             edges: dict[tuple[Op, Op], int], pairs: Iterable[tuple[Op, Op]]) -> nx.DiGraph:
    """The graph, filled in through networkx's adjacency dicts.

    NOTE: `add_edges_from` spends ~1 µs per edge on checks and attribute merging that a fresh
    graph does not need; filling `_node`, `_succ` and `_pred` directly (the layout networkx
    documents for DiGraph subclasses) builds the same graph ~3x faster. tests/test_schedule.py
    checks it equals the graph the public API builds.
    """
    g: nx.DiGraph = nx.DiGraph()
    node, succ, pred = g._node, g._succ, g._pred
    for op, sp in where.items():
        r, p = places[op]
        node[op] = {"rank": r, "pos": p, "span": sp}
        succ[op] = {}
        pred[op] = {}
    for a, b in pairs:
        node[a]["pair_next"] = b
        node[b]["pair_prev"] = a
    for (u, v), k in edges.items():
        d = {"kind": k}
        succ[u][v] = d
        pred[v][u] = d
    return g
