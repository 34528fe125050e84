"""What synthesis solves: the ops of a pipeline, their durations and dependencies under a cost
model and a communication model, and the per-rank memory budget.

The time semantics are the simulator's (`pipeir.sim.engine`), restated as constraints so the
solver's model and `simulate` agree: an op starts once its rank is free and every input has
arrived; a cross-rank input arrives `transfer_time` after its producer ends (overlapped) or
the producer's rank is busy sending it (blocking: the send is part of the producer's time on
its rank). An op's *occupation* is its cost plus, with blocking sends, its cross-rank sends.

The objective (`Problem.objective`) is the step of one step on its own (the makespan:
steps separated by a synchronised optimizer step) or the step with steps back to back (the
steady state of `pipeir.sim.steady`: each rank starts its next step once it has finished
this one). Every schedule is timed by the simulator either way.

Memory is counted as `pipeir.verify` does (`pipeir.memmodel`): an activation is live on its
rank from its F; a B frees it, or an I the part that W does not need and W the rest (all of
it held until W where the costs give no split). Since a rank runs one op at a time, "live
after each op in program order" equals "live at each instant", which is how the model counts.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, TypeVar

import numpy as np
import numpy.typing as npt

from pipeir.config import PipelineConfig
from pipeir.depgraph import topological_order
from pipeir.diagnostics import UsageError
from pipeir.memmodel import StageMemory, live_memory
from pipeir.ops import Op
from pipeir.passes.context import CommModel
from pipeir.schedule import Schedule, data_predecessors
from pipeir.sim import CostModel, simulate
from pipeir.sim.steady import steady_state
from pipeir.verify import MEMORY_SLACK

T = TypeVar("T", int, float)

#: What synthesis minimises: one step on its own, or the time per step back to back.
Objective = Literal["makespan", "steady"]
OBJECTIVES: tuple[Objective, ...] = ("makespan", "steady")
Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class Problem:
    """One synthesis instance: `config` fixes ranks, micro-batches, stages and placement;
    `costs` describe its stages (already cut into chunks); `split` asks for I + W instead of
    B; `memory_limit` bounds each rank's live activations, counted (one per stage and
    micro-batch) or, with `memory_bytes`, in the cost model's bytes (None: no bound);
    `objective` what a schedule's step is (see the module docstring)."""

    config: PipelineConfig
    costs: CostModel
    split: bool = False
    comm: CommModel = "overlapped"
    memory_limit: float | None = None
    memory_bytes: bool = False
    objective: Objective = "makespan"

    def __post_init__(self) -> None:
        if self.memory_bytes and not self.costs.knows_memory:
            raise UsageError("--memory-bytes needs activation sizes in the cost file "
                             "(memory_bytes or stage.S.memory_bytes)")

    # ---- ops and their relations ---------------------------------------------------------
    @cached_property
    def ops(self) -> tuple[Op, ...]:
        """Every op, stage by stage, micro-batch by micro-batch."""
        kinds = ("F", "I", "W") if self.split else ("F", "B")
        return tuple(Op(k, s, m) for s in range(self.config.stages)  # type: ignore[arg-type]
                     for m in range(self.config.microbatches) for k in kinds)

    def rank(self, op: Op) -> int:
        return self.config.placement[op.stage]

    @cached_property
    def preds(self) -> dict[Op, tuple[Op, ...]]:
        """The data predecessors of every op."""
        present = set(self.ops)
        return {op: tuple(data_predecessors(op, present, self.config.stages)) for op in self.ops}

    @cached_property
    def edges(self) -> tuple[tuple[Op, Op, float], ...]:
        """(producer, consumer, delay from the producer's occupation end to the consumer's
        earliest start): the transfer time for a cross-rank edge with overlapped
        communication, else 0 (same rank: free; blocking: paid inside the occupation)."""
        out = []
        for op, ps in self.preds.items():
            for p in ps:
                cross = self.rank(p) != self.rank(op)
                h = self.costs.transfer_time(p.stage, op.stage) if cross else 0.0
                out.append((p, op, h if self.comm == "overlapped" else 0.0))
        return tuple(out)

    @cached_property
    def occupation(self) -> dict[Op, float]:
        """How long each op keeps its rank busy (cost, plus blocking sends)."""
        out = {op: self.costs.cost(op) for op in self.ops}
        if self.comm == "blocking":
            for op, ps in self.preds.items():
                for p in ps:
                    if self.rank(p) != self.rank(op):
                        out[p] += self.costs.transfer_time(p.stage, op.stage)
        return out

    @property
    def mb_uniform(self) -> bool:
        """Whether every micro-batch costs the same: then ops of one kind on one stage can be
        taken in micro-batch order without losing any schedule (see `model`)."""
        return not (self.costs.mb or self.costs.stage_mb)

    def release_op(self, stage: int, mb: int) -> Op:
        """The op that frees the activation of (stage, mb): its B, or its W."""
        return Op("W" if self.split else "B", stage, mb)

    def memory(self, stage: int) -> StageMemory:
        """One activation of `stage` in the problem's unit (`pipeir.memmodel`): what its F
        holds, and of that what W still needs after I (I frees the rest; a B frees all)."""
        if self.memory_bytes:
            m = self.costs.stage_memory(stage)
            return StageMemory(m.saved, m.kept_for_w)
        return self.costs.counted_memory(stage)

    def weight(self, stage: int) -> float:
        """What one activation of `stage` counts against the memory limit."""
        return self.memory(stage).saved

    def releases(self, stage: int, mb: int) -> tuple[tuple[Op, float], ...]:
        """The ops that free the activation of (stage, mb), each with what it frees: its B
        (all of it), or its I (what W does not need) and its W (the rest); parts of size 0
        left out."""
        m = self.memory(stage)
        if not self.split:
            return ((Op("B", stage, mb), m.saved),) if m.saved > 0 else ()
        return tuple((Op(k, stage, mb), x)  # type: ignore[arg-type]
                     for k, x in (("I", m.freed_by_i), ("W", m.kept_for_w)) if x > 0)

    def freed(self, op: Op) -> float:
        """What `op` frees (0 for a forward)."""
        return next((x for rel, x in self.releases(op.stage, op.mb) if rel == op), 0.0)

    # ---- memory --------------------------------------------------------------------------
    def peak(self, schedule: Schedule) -> float:
        """The largest per-rank live memory of `schedule`, in this problem's unit."""
        def memory(op: Op) -> StageMemory:
            return self.memory(op.stage)
        return max((live for prog in schedule.programs
                    for _, live in live_memory(prog, memory)), default=0.0)

    @property
    def budget(self) -> float:
        """The memory limit with the slack every comparison against it allows (sums of
        activation sizes in bytes are not exact), or infinity without one."""
        return float("inf") if self.memory_limit is None else \
            self.memory_limit * (1 + MEMORY_SLACK)

    def fits(self, schedule: Schedule) -> bool:
        return self.memory_limit is None or self.peak(schedule) <= self.budget

    def mb_memory(self, rank: int) -> float:
        """What one micro-batch holds on `rank` after the F of its highest stage there: all of
        the rank's stages (their backwards come later)."""
        return sum(self.weight(s) for s in self.config.stages_of(rank))

    @property
    def least_memory(self) -> float:
        """The smallest limit any schedule meets: each rank's `mb_memory`, and running one
        micro-batch at a time holds no more."""
        return max(self.mb_memory(r) for r in range(self.config.ranks))

    # ---- time ----------------------------------------------------------------------------
    def step_time(self, schedule: Schedule) -> float:
        """The simulator's step time of `schedule` under the objective (the number synth
        reports): its makespan, or its steady step."""
        if self.objective == "steady":
            return steady_state(schedule, self.costs, self.comm).step
        return simulate(schedule, self.costs, comm=self.comm).makespan

    def build(self, programs: Sequence[Sequence[Op]], name: str = "synth") -> Schedule:
        return Schedule.from_programs(self.config, programs, name)

    @cached_property
    def implied(self) -> tuple[tuple[Op, Op], ...]:
        """Precedences (p, q: q starts after p ends) that some best schedule keeps, so the
        model may impose them and bounds may assume them. With equal micro-batch costs: ops of
        one kind on one stage run in micro-batch order (see `model`); then a stage that alone
        can hold only k activations starts F(s, mb) after the release of mb - k."""
        if not self.mb_uniform:
            return ()
        out = [(Op(op.kind, op.stage, op.mb - 1), op) for op in self.ops if op.mb > 0]
        limit, m = self.memory_limit, self.config.microbatches
        if limit is not None:
            for s in range(self.config.stages):
                # each activation in flight (its F run, its last release not) holds at
                # least what the last release frees
                w = self.memory(s).kept_for_w if self.split else self.weight(s)
                k = math.floor(limit / w + 1e-9) if w > 0 else m
                out.extend((self.release_op(s, mb - k), Op("F", s, mb))
                           for mb in range(max(k, 1), m))
        return tuple(out)

    @cached_property
    def heads_tails(self) -> tuple[dict[Op, float], dict[Op, float]]:
        """Per op, the earliest start and the least time that must follow its end, over the
        data edges and the implied ones (`heads_tails`)."""
        return heads_tails(self, [*self.edges, *((p, q, 0.0) for p, q in self.implied)],
                           self.occupation)

    @cached_property
    def topological(self) -> dict[Op, int]:
        """Each op's position in one order that runs every producer before its consumers."""
        order = topological_order(self.ops, ((p, q) for p, q, _ in self.edges))
        return {op: i for i, op in enumerate(order)}

    def lower_bound(self) -> float:
        """A step time no schedule beats under the objective (see `lower_bound`; back to
        back, `busiest`)."""
        return self._bound[0]

    @property
    def bound_seconds(self) -> float:
        """How long `lower_bound` took. Building the exact model costs about as much again
        (its heads and tails in integer units), which `synthesize` must leave time for."""
        return self._bound[1]

    @cached_property
    def _bound(self) -> tuple[float, float]:  # synth asks per shape, then synthesize again
        t0 = time.perf_counter()
        if self.objective == "steady":
            return busiest(self, self.occupation), time.perf_counter() - t0
        head, tail = self.heads_tails
        return lower_bound(self, head, self.occupation, tail), time.perf_counter() - t0


def busiest(problem: Problem, occ: Mapping[Op, T]) -> T:
    """The steady step's bound: every rank runs all of its ops once per step, so no step is
    shorter than the busiest rank's occupation."""
    total = [occ[problem.ops[0]] * 0 for _ in range(problem.config.ranks)]
    for op in problem.ops:
        total[problem.rank(op)] += occ[op]
    return max(total)


def lower_bound(problem: Problem, head: Mapping[Op, T], occ: Mapping[Op, T],
                tail: Mapping[Op, T]) -> T:
    """The longest dependency chain, and per rank two one-machine bounds: Jackson's
    preemptive schedule with heads and tails (a rank cannot start an op before its head, and
    after each op its tail must still run elsewhere), and the idle the memory limit forces
    (`memory_idle`). Generic in the number type, so the solver's integer model gets the same
    bound in its own units."""
    best = max(head[op] + occ[op] + tail[op] for op in problem.ops)
    by_rank: list[list[Op]] = [[] for _ in range(problem.config.ranks)]
    for op in problem.ops:
        by_rank[problem.rank(op)].append(op)
    for mine in by_rank:
        best = max(best, jackson(mine, head, occ, tail), memory_idle(problem, mine, head, occ,
                                                                       tail))
    return best


#: Heads and tails count the ranks' capacity (`_sharpen`) up to this many ops: it keeps a
#: matrix of path lengths between every two ops (20 MB and about a second at this size, the
#: largest the exact model solves).
SHARPEN_OPS = 1600


def heads_tails(problem: Problem, edges: Sequence[tuple[Op, Op, T]], occ: Mapping[Op, T]
                ) -> tuple[dict[Op, T], dict[Op, T]]:
    """Per op, a least start (its head) and a least time that must follow its end (its
    tail): the longest paths over `edges`, raised by each rank's capacity (`_sharpen`) on
    problems of up to `SHARPEN_OPS` ops."""
    head, tail = longest_paths(problem.ops, edges, occ)
    if len(problem.ops) <= SHARPEN_OPS:
        head, tail = _sharpen(problem, edges, occ, head, tail)
    return head, tail


def _sharpen(problem: Problem, edges: Sequence[tuple[Op, Op, T]], occ: Mapping[Op, T],
             head: dict[Op, T], tail: dict[Op, T]) -> tuple[dict[Op, T], dict[Op, T]]:
    """Heads and tails that count each rank's capacity and budget (the one-machine
    adjustment of Carlier and Pinson, and its memory analogue). Every ancestor of q that runs
    on rank r must have run there before q starts, so q's head is at least the one-machine
    bound (`_one_machine`) of those ancestors, with their heads and, as tails, their path
    lengths to q; a tail likewise over the op's descendants on a rank, with their distances
    from it as heads. A forward q also needs room: its rank's forwards among q's ancestors
    are live unless released, so releases that are not q's descendants must have freed the
    excess first, at the earliest when the earliest-ending ones have. Longest paths alone let
    a rank run all of an op's ancestors at once; with these, backwards wait for whole rounds
    of forwards, which is what the memory idle and Jackson's bound feed on.

    NOTE: heads are final in topological order (each uses its ancestors' raised heads, and
    a release's head where it is already final, a valid one where not), tails in the reverse
    order; tails do not use heads, and a second pass over the heads raised no bound on the
    bench's shapes."""
    ops = problem.ops
    n = len(ops)
    at = {op: i for i, op in enumerate(ops)}
    order = sorted(range(n), key=lambda i: problem.topological[ops[i]])
    dur = np.array([float(occ[op]) for op in ops])
    rank = np.array([problem.rank(op) for op in ops])
    preds: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    succs: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    for src, dst, delay in edges:
        preds[at[dst]].append((at[src], float(delay)))
        succs[at[src]].append((at[dst], float(delay)))
    # dist[a, q]: the longest path from a's end to q's start; NaN where q does not follow a
    dist = np.full((n, n), np.nan)
    for q in order:
        col = dist[:, q]
        for p, d in preds[q]:
            col = np.fmax(col, dist[:, p] + dur[p] + d)
            col[p] = max(d, col[p]) if col[p] == col[p] else d
        dist[:, q] = col
    ranks = [rank == r for r in range(problem.config.ranks)]
    hd = np.array([float(head[op]) for op in ops])
    limit = problem.memory_limit
    size = np.array([problem.weight(op.stage) for op in ops])
    opens = np.array([op.kind == "F" for op in ops]) & (size > 0)
    freed = np.array([problem.freed(op) for op in ops])
    frees = freed > 0
    for q in order:
        best = float(hd[q])
        for p, d in preds[q]:
            best = max(best, float(hd[p] + dur[p]) + d)
        follows = ~np.isnan(dist[:, q])
        for mine in ranks:
            s = follows & mine
            if s.sum() > 1:
                best = max(best, _one_machine(hd[s], dur[s], dist[s, q]))
        if limit is not None and opens[q]:
            own = ranks[rank[q]]
            need = size[follows & opens & own].sum() + size[q] - problem.budget
            if need > 0:  # releases must have ended first: the earliest that free enough
                can = frees & own & np.isnan(dist[q, :])
                ends = hd[can] + dur[can]
                i = np.argsort(ends)
                enough = np.nonzero(np.cumsum(freed[can][i]) >= need)[0]
                if len(enough):  # (none: no schedule runs q; the budget check says so)
                    best = max(best, float(ends[i][enough[0]]))
        hd[q] = best
    tl = np.array([float(tail[op]) for op in ops])
    for a in reversed(order):
        best = float(tl[a])
        for x, d in succs[a]:
            best = max(best, d + float(dur[x] + tl[x]))
        follows = ~np.isnan(dist[a, :])
        for mine in ranks:
            s = follows & mine
            if s.sum() > 1:
                best = max(best, _one_machine(dist[a, s], dur[s], tl[s]))
        tl[a] = best
    zero = occ[ops[0]] * 0
    kind = type(zero)
    return ({op: kind(round(x) if kind is int else x) for op, x in zip(ops, hd)},
            {op: kind(round(x) if kind is int else x) for op, x in zip(ops, tl)})


def _one_machine(h: Floats, p: Floats, t: Floats) -> float:
    """A lower bound on max(end + tail) over the jobs of one machine: for any subset J, the
    machine starts none before J's least head, runs all of J, and the last to end still has
    at least J's least tail to go. Taken over the subsets of the latest heads and of the
    longest tails: heads `h`, durations `p`, tails `t` (arrays, so a rank's ancestors cost a
    few vector operations)."""
    i = np.argsort(h)
    later = np.cumsum(p[i][::-1])[::-1]
    by_head = np.max(h[i] + later + np.minimum.accumulate(t[i][::-1])[::-1])
    j = np.argsort(-t)
    by_tail = np.max(np.minimum.accumulate(h[j]) + np.cumsum(p[j]) + t[j])
    return float(max(by_head, by_tail))


def longest_paths(ops: Sequence[Op], edges: Sequence[tuple[Op, Op, T]], occ: Mapping[Op, T]
                  ) -> tuple[dict[Op, T], dict[Op, T]]:
    """Heads (longest path to each op's start) and tails (longest path after its end)."""
    zero = occ[ops[0]] * 0
    succ: dict[Op, list[tuple[Op, T]]] = {op: [] for op in ops}
    pred: dict[Op, list[tuple[Op, T]]] = {op: [] for op in ops}
    for p, q, h in edges:
        succ[p].append((q, h))
        pred[q].append((p, h))
    order = topological_order(ops, ((p, q) for p, q, _ in edges))
    head: dict[Op, T] = {}
    for op in order:
        head[op] = max((head[p] + occ[p] + h for p, h in pred[op]), default=zero)
    tail: dict[Op, T] = {}
    for op in reversed(order):
        tail[op] = max((h + occ[q] + tail[q] for q, h in succ[op]), default=zero)
    return head, tail


def jackson(ops: list[Op], head: Mapping[Op, T], occ: Mapping[Op, T],
             tail: Mapping[Op, T]) -> T:
    """The preemptive one-machine bound: at each moment run the released op with the longest
    tail; the answer, max over ops of completion + tail, is a lower bound on any
    non-preemptive schedule of these ops on one rank (Carlier, 1982)."""
    todo = sorted(ops, key=head.__getitem__)
    left = {op: occ[op] for op in ops}
    ready: list[tuple[T, int, Op]] = []
    t = best = occ[ops[0]] * 0
    i, n = 0, len(todo)
    while i < n or ready:
        if not ready and t < head[todo[i]]:
            t = head[todo[i]]
        while i < n and head[todo[i]] <= t:
            op = todo[i]
            heapq.heappush(ready, (-tail[op], i, op))
            i += 1
        op = ready[0][2]
        run = left[op] if i >= n else min(left[op], head[todo[i]] - t)
        t += run
        left[op] -= run
        if left[op] <= 1e-12:
            heapq.heappop(ready)
            best = max(best, t + tail[op])
    return best


#: The most release times `memory_idle` tries per rank (the earliest, where memory binds
#: hardest); any subset of them gives a valid bound, and this keeps it linear-time on the
#: largest problems.
MEMORY_POINTS = 16


def memory_idle(problem: Problem, mine: list[Op], head: Mapping[Op, T], occ: Mapping[Op, T],
                 tail: Mapping[Op, T]) -> T:
    """A rank's bound with the idle its memory limit forces: until an activation can first be
    released, the rank can start only as many Fs as fit in the limit, and the other ops
    (backwards) are not ready yet, so a rank whose heads leave it nothing else to do waits.

    For a time T, the live memory at T is the Fs started by then less the releases ended by
    then, so the Fs started before T hold at most the room R(T): the limit plus what the
    releases that can end before T free. That caps their number (`cap(T)`: R(T) over the
    least positive activation size) and their sizes' sum (R(T) itself, which binds where
    stages' activations differ: a chunk of two layers holds twice a chunk of one). The work
    the rank can do before T (`work_before`) is then bounded, and what is left runs after
    T: the step is at least T + load - work before T + the least tail. Tried at the release
    times, where the room grows."""
    zero = occ[mine[0]] * 0
    limit = problem.memory_limit
    opens = [op.kind == "F" and problem.weight(op.stage) > 0 for op in mine]
    sizes = [problem.weight(op.stage) for op, o in zip(mine, opens) if o]
    if limit is None or not sizes or sum(sizes) <= problem.budget:
        return zero
    least, total = min(sizes), sum(sizes)
    frees = sorted((head[op] + occ[op], x) for op in mine
                   if (x := problem.freed(op)) > 0)
    load = sum((occ[op] for op in mine), zero)
    last = min(tail[op] for op in mine)
    ranked = sorted(zip(mine, opens), key=lambda x: head[x[0]])
    best, freed, done = zero, 0.0, 0
    for t, _ in frees[:MEMORY_POINTS]:
        while done < len(frees) and frees[done][0] < t:  # ended strictly before t
            freed += frees[done][1]
            done += 1
        if problem.budget + freed >= total:  # every F fits: neither cap binds any more
            break
        cap = math.floor((limit + freed) / least + 1e-9)
        room = Room(problem.budget + freed, problem.weight)
        best = max(best, t + load - work_before(t, ranked, head, occ, cap, room) + last)
    return best


@dataclass(frozen=True)
class Room:
    """What the forwards a rank has started may hold at once (`capacity`, in the problem's
    memory unit) and what each holds (`size` of its stage)."""

    capacity: float
    size: Callable[[int], float]

    def most_work(self, fs: Sequence[tuple[float, float]]) -> float:
        """The most work of forwards, given as (work, size) with size > 0, whose sizes sum
        to at most `capacity`: the fractional knapsack (largest work per size first, the
        last one in part), which is no less than any whole choice."""
        left, out = self.capacity, 0.0
        for work, size in sorted(fs, key=lambda ws: ws[0] / ws[1], reverse=True):
            if size >= left:
                return out + work * max(left, 0.0) / size
            left, out = left - size, out + work
        return out


def work_before(t: T, ranked: Sequence[tuple[Op, bool]], head: Mapping[Op, T],
                 occ: Mapping[Op, T], cap: int, room: Room | None = None) -> T:
    """The most work one rank can do before `t` when at most `cap` of its F ops (flagged in
    `ranked`, which is sorted by head) start by then, and (with `room`) the activations of
    those that start hold at most its capacity. For any tau, the ops whose head is before
    tau do at most their (capped) work, and the rest at most t - tau; the least of these over
    tau is the bound.

    NOTE (chains). A micro-batch's forwards run through the stages in order, so on a rank
    with several chunks the F ops of one micro-batch that start by `t` are a prefix of that
    micro-batch's chain there: a later chunk's forward brings its earlier ones' activations
    along. Where a rank holds a chain (two chunks or more) the capped work is the best such
    choice (`chain_work`), not the `cap` largest forwards: on heavy-ends' four-chunk V at
    K = 4 (rank 3 holds stages 3, 4, 11 and 12; its first backward's head is 8.1) the
    largest sixteen forwards are eight of stage 12 and eight of stage 3, 6.2 of work, while
    any sixteen activations that a schedule can hold do at most 5.125 (three whole chains
    and four first chunks): the bound rises from 30.3 to 30.575. The knapsack is
    costly, so a first pass takes the `cap` largest at every tau, and the second solves it
    only at a tau where it could still lower the least found: the best choice only grows
    with tau, so the last one solved bounds it from below."""
    best = max(t * 0, t - head[ranked[0][0]]) if ranked else t * 0
    for chained in (False, True):
        best = _work_pass(t, ranked, head, occ, cap, best, chained, room)
    return best


def _work_pass(t: T, ranked: Sequence[tuple[Op, bool]], head: Mapping[Op, T],
               occ: Mapping[Op, T], cap: int, best: T, chained: bool, room: Room | None
               ) -> T:
    """One pass of `work_before` over tau, lowering `best`: with the `cap` largest forwards
    or the most whose sizes fit the room, or (`chained`) the best prefixes of their chains
    where that could lower it."""
    zero = t * 0
    other, fs, least = zero, zero, zero
    sized: list[tuple[float, float]] = []  # (work, size) of the forwards so far, for `room`
    chosen: list[T] = []  # a min-heap of the cap largest F works
    chains: dict[int, list[tuple[int, T]]] = {}  # per micro-batch: (stage, work) of its Fs
    counted, longest = 0, 0
    i, n = 0, len(ranked)
    while i < n and head[ranked[i][0]] < t:
        h = head[ranked[i][0]]
        while i < n and head[ranked[i][0]] == h:
            op, is_f = ranked[i]
            x = min(occ[op], t - head[op])
            i += 1
            if not is_f:
                other += x
                continue
            if room is not None and not chained:
                sized.append((float(x), room.size(op.stage)))
            if chained:
                chain = chains.setdefault(op.mb, [])
                chain.append((op.stage, x))
                counted, longest = counted + 1, max(longest, len(chain))
            elif len(chosen) < cap:
                heapq.heappush(chosen, x)
                fs += x
            elif cap and x > chosen[0]:
                fs += x - heapq.heapreplace(chosen, x)
        tau = head[ranked[i][0]] if i < n and head[ranked[i][0]] < t else t
        if not chained:
            capped = fs
            if room is not None and other + t - tau < best:  # (only where it could tell)
                capped = min(fs, _floor_like(zero, room.most_work(sized)))
            best = min(best, other + capped + t - tau)
        elif counted > cap and longest > 1 and other + least + t - tau < best:
            least = chain_work(chains.values(), cap, zero)
            best = min(best, other + least + t - tau)
    return best


def _floor_like(zero: T, x: float) -> T:
    """`x`, an upper bound of a sum of `zero`'s type, in that type: floored for integers
    (the sum is a whole number no more than x; the margin absorbs x's own rounding)."""
    return type(zero)(math.floor(x + 1e-6)) if isinstance(zero, int) else type(zero)(x)


def chain_work(chains: Iterable[list[tuple[int, T]]], cap: int, zero: T) -> T:
    """The most work of at most `cap` forwards when each micro-batch's (a list of (stage,
    work), its forwards on the rank) must be a prefix of its chain in stage order: a
    knapsack over the micro-batches, each offering its prefixes (`work_before`'s NOTE)."""
    kind = type(zero)
    most = np.zeros(cap + 1, dtype=np.int64 if kind is int else np.float64)
    for chain in chains:  # most[c]: the most work with at most c forwards
        prefix = np.cumsum([x for _, x in sorted(chain, key=lambda sx: sx[0])])
        new = most.copy()
        for k, w in enumerate(prefix[:cap], start=1):
            np.maximum(new[k:], most[:-k] + w, out=new[k:])
        most = new
    return kind(most[cap])
