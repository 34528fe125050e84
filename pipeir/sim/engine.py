"""The discrete-event simulation: when does each op run, given its costs and the schedule?

Each rank runs its program in order; an op starts once the rank is free and every tensor it
consumes has arrived. Two communication models:

* ``overlapped`` (default): transfers run on a separate channel (async send/recv on a comm
  stream). The data of a cross-rank dependency arrives `transfer_time` after the producer
  ends; neither rank's compute is occupied.
* ``blocking``: each send runs on the sender's compute stream right after the op that
  produced it, so the sender is busy until the data has arrived; receives are posted
  ahead (as torch's irecv), so the receiver waits for the data but is not occupied.

Side channels, one of each per rank, run beside compute: gradient reductions (R ops, data
parallelism) on the reduction channel, offloads and reloads (OFF, RELOAD) on the copy channel
(a copy stream to host memory). The rank issues a channel op when its program reaches it
(after the compute op before it ends; an R once the weight gradients it reduces are done) and
goes on with its next compute op at once; one rank's ops on one channel run one after
another; an op that consumes a channel op's result (a backward after its RELOAD) waits for
it; the step ends when every rank's compute and channels are done.

NOTE: both models are contention-free (transfers never queue behind one another on a
link), so an op's start is the longest path to it through program-order and data edges. The
simulation is therefore one pass over a topological order (`Timing.sweep`, the one timing
core: reorder's evaluator and lowering reuse it), not an event queue, and it is
monotone: making any op or transfer slower never makes the step shorter. A rendezvous send
(the sender waits until the receiver reaches its recv) is deliberately not modelled: it
deadlocks plain 1F1B, which is why real runtimes batch their point-to-point operations.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, NamedTuple

from pipeir._gc import paused_gc
from pipeir.depgraph import kahn_order
from pipeir.diagnostics import UsageError, VerifyError
from pipeir.ops import CHANNEL, Op
from pipeir.schedule import Schedule, expect_schedule
from pipeir.sim.costs import CostModel, expect_costs
from pipeir.sim.result import SimResult, Transfer
from pipeir.verify import check_deadlock, memory_report, peak_bytes

#: The communication models `simulate` understands; the first is the default.
COMM_MODELS: Final = ("overlapped", "blocking")


def simulate(schedule: Schedule, costs: CostModel | None = None,
             comm: str = "overlapped") -> SimResult:
    """Simulate `schedule` under `costs` (default: F = 1, B = 2, free communication).

    Raises VerifyError(check="deadlock") when the schedule cannot run to the end.
    """
    expect_schedule(schedule, "simulate")
    costs = expect_costs(costs, "simulate(costs=...)") or CostModel()
    with paused_gc():
        return _simulate(schedule, costs, comm)


class Times(NamedTuple):
    """What a sweep computes, per op number: start, end, release (when the rank may start its
    next op) and, with blocking sends, when each transfer has arrived."""

    start: list[float]
    end: list[float]
    release: list[float]
    arrive: list[float]  # blocking: when each transfer (by edge number) has arrived


class Timing:
    """A schedule's dependency structure, numbered once, with the transfer times of `costs`
    bound in: `sweep(durations)` times every op in one pass over a topological order.

    The simulator, reorder's evaluator (durations looked up through a micro-batch order) and
    lowering's placement of communication all time schedules through this one class.
    """

    def __init__(self, schedule: Schedule, costs: CostModel, comm: str = "overlapped"):
        # NOTE: ops are numbered once (program order, rank by rank) and everything after
        # that works on lists indexed by number: hashing an Op is a Python-level call, and
        # the sweep would otherwise hash each op a few dozen times (5x slower at 65k ops).
        if comm not in COMM_MODELS:
            raise UsageError(f"unknown communication model '{comm}' (expected "
                             f"{' or '.join(COMM_MODELS)})")
        self.schedule = schedule
        self.blocking = blocking = comm == "blocking"
        deps = schedule.deps
        self.ops = ops = deps.ops
        n = len(ops)
        self.rank = rank = [r for r, prog in enumerate(schedule.programs) for _ in prog]
        stage = [op.stage for op in ops]
        #: per op, the side channel it runs on (None: the rank's compute)
        self.channel: list[str | None] = [CHANNEL.get(op.kind) for op in ops]
        # (the index's own tuples unless side channels rewire them: a copy per op was a
        # fifth of a large lowering's peak memory)
        preds: Sequence[Sequence[int]] = deps.preds
        if any(self.channel):
            rewired = [list(ps) for ps in deps.preds]
            _side_channels(rewired, [set(ps) for ps in deps.data_preds], rank, self.channel)
            preds = rewired
        # An overlapped pair starts once both its ops' inputs are there: the first op also
        # waits for the arrival of what the second consumes (the transfer is the second's).
        joins = deps.joins()
        hop = [costs.transfer_time(b, b + 1) for b in range(max(0, schedule.config.stages - 1))]
        self.size = [costs.boundary_bytes(b) for b in range(len(hop))]
        #: per op, what it waits for: its data/order predecessors, then (as a pair's first)
        #: the inputs of its partner. Overlapped: (pred, time from the pred's end to the
        #: arrival; 0 on the same rank). Blocking: (pred, the transfer's edge number, or -1 on
        #: the same rank: the pred's release), and per op its cross-rank sends (edge, time),
        #: paid one after another after the op, in the order of their consumers.
        self.npred = [len(ps) for ps in preds]
        self.hop = hop
        self.stage = stage
        self.inputs: list[Sequence[tuple[int, float]]] = []
        self.waits: list[list[tuple[int, int]]] = []
        self.sends: list[list[tuple[int, float]]] = [[] for _ in range(n)] if blocking else []
        self.edges = 0
        if blocking:
            edge: dict[tuple[int, int], int] = {}  # (producer, consumer) -> edge, for pairs
            pairs = any(joins)
            for i, ps in enumerate(preds):  # consumers in order: each producer's sends too
                ri, si = rank[i], stage[i]
                w = []
                for j in ps:
                    if rank[j] == ri:
                        w.append((j, -1))
                        continue
                    sj = stage[j]
                    self.sends[j].append((self.edges, 0.0 if sj == si else
                                          hop[sj if sj < si else si]))
                    w.append((j, self.edges))
                    if pairs:
                        edge[j, i] = self.edges
                    self.edges += 1
                self.waits.append(w)
            for i, js in enumerate(joins):
                self.waits[i] += [(j, -1 if rank[j] == rank[i] else edge[j, k]) for j, k in js]
        else:
            for i, ps in enumerate(preds):
                ri, si = rank[i], stage[i]
                inp = []
                for j in ps:
                    sj = stage[j]
                    inp.append((j, 0.0 if sj == si or rank[j] == ri
                                else hop[sj if sj < si else si]))
                for j, k in joins[i]:
                    sj, sk = stage[j], stage[k]
                    inp.append((j, 0.0 if sj == sk or rank[j] == ri
                                else hop[sj if sj < sk else sk]))
                self.inputs.append(tuple(inp))  # (a list is two objects, a tuple one)
        # NOTE: the rewired side-channel waits are ancestors in the schedule's own graph, so
        # its cached order serves the sweep whenever the schedule is acyclic. Only a schedule
        # whose cycle runs through a channel op (verify rejects it) needs its own order.
        self.order: Sequence[int] = deps.order
        if not deps.acyclic and any(self.channel):
            self.order = _reachable(preds, joins)

    @property
    def complete(self) -> bool:
        """Whether every op can run (the schedule does not deadlock)."""
        return len(self.order) == len(self.ops)

    def stuck(self) -> list[int | None]:
        """Per rank, the position of the first op that can never start (None: none)."""
        ran = set(self.order)
        out: list[int | None] = []
        i = 0
        for prog in self.schedule.programs:
            out.append(next((k for k in range(len(prog)) if i + k not in ran), None))
            i += len(prog)
        return out

    def sweep(self, dur: Sequence[float], ready: Sequence[float] | None = None) -> Times:
        """Start, end and release (when the rank may start its next op) of every op, given
        each op's duration; with `ready`, no op of rank r starts before `ready[r]` (which may
        be -inf: the rank waits only for its inputs; `pipeir.sim.steady` times the next step
        this way). Only valid when `complete`."""
        # NOTE: one loop per communication model, each as lean as it can be: reorder's
        # search calls this thousands of times per plan. Overlapped, an op's release is its
        # end, and a same-rank predecessor's transfer time is 0, so every input is end + h.
        n = len(self.ops)
        floor = [0.0] * n if ready is None else [ready[r] for r in self.rank]
        if self.blocking:
            return self._sweep_blocking(dur, floor)
        start = [0.0] * n
        end = [0.0] * n
        inputs = self.inputs
        for i in self.order:
            t = floor[i]
            for j, h in inputs[i]:
                x = end[j] + h
                if x > t:
                    t = x
            start[i] = t
            end[i] = t + dur[i]
        return Times(start, end, end, [])

    def _sweep_blocking(self, dur: Sequence[float], floor: list[float]) -> Times:
        n = len(self.ops)
        start = [0.0] * n
        end = [0.0] * n
        rel = [0.0] * n
        arrive = [0.0] * self.edges
        waits, sends = self.waits, self.sends
        for i in self.order:
            t = floor[i]
            for j, k in waits[i]:
                x = rel[j] if k < 0 else arrive[k]
                if x > t:
                    t = x
            e = t + dur[i]
            start[i] = t
            end[i] = e
            for k, h in sends[i]:
                e += h
                arrive[k] = e
            rel[i] = e
        return Times(start, end, rel, arrive)

    def makespan(self, dur: Sequence[float]) -> float:
        """When the last op releases its rank."""
        return max(self.sweep(dur).release, default=0.0)


def _side_channels(preds: list[list[int]], data: list[set[int]], rank: list[int],
                   channel: list[str | None]) -> None:
    """Rewire `preds` (op numbers in program order, rank by rank) for ops on side channels,
    so that the one sweep times them with no special case.

    NOTE: a compute op right after a channel op in program order does not wait for it (the
    rank issued it and went on) unless it consumes its result (a DATA edge): it waits for
    the last compute op before instead. A channel op waits for the op before it (it is
    issued when the program gets there) and for the previous op on its channel, which
    serialises the channel.
    """
    last: dict[tuple[int, str], int] = {}  # (rank, channel) -> its latest op so far
    for i, ps in enumerate(preds):
        ch = channel[i]
        if ch is not None:
            prev = last.get((rank[i], ch))
            if prev is not None and prev not in ps:
                ps.append(prev)
            last[rank[i], ch] = i
            continue
        fixed = []
        for j in ps:
            if channel[j] is not None and j not in data[i]:
                k = j - 1  # the program-order edge: the compute op before the channel ops
                while k >= 0 and rank[k] == rank[i] and channel[k] is not None:
                    k -= 1
                if k < 0 or rank[k] != rank[i]:
                    continue  # the rank's program starts with channel ops
                j = k
            if j not in fixed:
                fixed.append(j)
        preds[i] = fixed


def _reachable(preds: Sequence[Sequence[int]], joins: Sequence[Sequence[tuple[int, int]]]
               ) -> list[int]:
    """The ops that can run, in an order where each comes after its predecessors (`preds`,
    and a pair's first after its partner's inputs: `joins`)."""
    succs: list[list[int]] = [[] for _ in preds]
    for i, (ps, js) in enumerate(zip(preds, joins)):
        for j in ps:
            succs[j].append(i)
        for j, _ in js:
            succs[j].append(i)
    return kahn_order(succs, [len(ps) + len(js) for ps, js in zip(preds, joins)])


def _simulate(schedule: Schedule, costs: CostModel, comm: str) -> SimResult:
    timing = Timing(schedule, costs, comm)
    if not timing.complete:
        raise VerifyError(check_deadlock(schedule), "deadlock")
    cost = costs.cost
    times = timing.sweep([cost(op) for op in timing.ops])
    end, rel, arrive = times.end, times.release, times.arrive
    # the predecessor that decided each op's start (the first of the latest), and transfers
    why = [-1] * len(end)
    sent: list[tuple[int, int, float, float, float]] = []
    rank, stage, hop, size = timing.rank, timing.stage, timing.hop, timing.size
    blocking, npred = timing.blocking, timing.npred
    per_op: Sequence[Sequence[tuple[int, float]]] = timing.waits if blocking else timing.inputs
    for i, ins in enumerate(per_op):
        t, cause = 0.0, -1
        real, ri, si = npred[i], rank[i], stage[i]
        for n_, (j, a) in enumerate(ins):
            # blocking: a is the edge number (-1: same rank); overlapped: the transfer time
            x = (rel[j] if a < 0 else arrive[int(a)]) if blocking else end[j] + a
            if n_ < real and rank[j] != ri:
                sj = stage[j]
                b = sj if sj < si else si
                h = 0.0 if sj == si else hop[b]
                sent.append((j, i, x - h, x, 0.0 if sj == si else size[b]))
            if x > t or cause < 0:
                t, cause = x, j
        why[i] = cause
    return _result(schedule, costs, comm, timing.ops, rank, times.start, end, rel, why, sent)


def _result(schedule: Schedule, costs: CostModel, comm: str, ops: Sequence[Op], rank: list[int],
            start: list[float], end: list[float], release: list[float], why: list[int],
            sent: list[tuple[int, int, float, float, float]]) -> SimResult:
    ranks = schedule.config.ranks
    makespan = max(release, default=0.0)
    busy = [0.0] * ranks
    sending = [0.0] * ranks
    reducing = [0.0] * ranks
    copying = [0.0] * ranks
    computed = 0.0  # when the last compute op releases its rank
    for i, r in enumerate(rank):
        channel = CHANNEL.get(ops[i].kind)
        if channel is not None:  # on one of the rank's side channels, not its compute
            (reducing if channel == "reduce" else copying)[r] += end[i] - start[i]
            continue
        busy[r] += end[i] - start[i]
        sending[r] += release[i] - end[i]
        computed = max(computed, release[i])
    start_of = dict(zip(ops, start))
    peaks, peak_time = _peaks(schedule, costs, start_of)
    peaks_b = peak_bytes(schedule, costs.stage_memory) if costs.knows_memory else None
    sent.sort(key=_by_start)
    transfers = [Transfer(ops[j], ops[i], rank[j], rank[i], s, e, b) for j, i, s, e, b in sent]
    return SimResult(schedule=schedule, costs=costs, comm=comm, start=start_of,
                     end=dict(zip(ops, end)), makespan=makespan, busy=tuple(busy),
                     idle=tuple(makespan - b for b in busy), sending=tuple(sending),
                     peak_activations=peaks, peak_time=peak_time, peak_bytes=peaks_b,
                     critical_path=_critical_path(ops, release, why), transfers=transfers,
                     reducing=tuple(reducing), compute_makespan=computed,
                     copying=tuple(copying))


def _by_start(t: tuple[int, int, float, float, float]) -> tuple[float, int]:
    return t[2], t[0]


def _peaks(schedule: Schedule, costs: CostModel, start: dict[Op, float]
           ) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """In-flight activations per rank, counted as `pipeir.verify` does (with the costs'
    split), and when each peaks."""
    report = memory_report(schedule, costs)
    return report.peak_activations, tuple(0.0 if op is None else start[op]
                                          for op in report.peak_at)


def _critical_path(ops: Sequence[Op], release: list[float], why: list[int]) -> list[Op]:
    """Follow, from the op that finishes last, the predecessor that held each op back."""
    if not ops:
        return []
    i = max(range(len(ops)), key=release.__getitem__)
    path = []
    while i >= 0:
        path.append(ops[i])
        i = why[i]
    path.reverse()
    return path
