"""The discrete-event simulation: when does each op run, given its costs and the schedule?

Each rank runs its program in order; an op starts once the rank is free and every tensor it
consumes has arrived. Two communication models:

* ``overlapped`` (default): transfers run on a separate channel (async send/recv on a comm
  stream). The data of a cross-rank dependency arrives `transfer_time` after the producer
  ends; neither rank's compute is occupied.
* ``blocking``: each send runs on the sender's compute stream right after the op that
  produced it, so the sender is busy until the data has arrived; receives are posted
  ahead (as torch's irecv), so the receiver waits for the data but is not occupied.

NOTE: both models are contention-free (transfers never queue behind one another on a
link), so an op's start is the longest path to it through program-order and data edges. The
simulation is therefore one pass over a topological order, not an event queue, and it is
monotone: making any op or transfer slower never makes the step shorter. A rendezvous send
(the sender waits until the receiver reaches its recv) is deliberately not modelled: it
deadlocks plain 1F1B, which is why real runtimes batch their point-to-point operations.
"""

from __future__ import annotations

from typing import Final

from pipeir._gc import paused_gc
from pipeir.diagnostics import UsageError, VerifyError
from pipeir.ops import Op
from pipeir.schedule import Schedule, pair_waits
from pipeir.sim.costs import CostModel
from pipeir.sim.result import SimResult, Transfer
from pipeir.verify import check_deadlock, live_activations, memory_report

#: The communication models `simulate` understands; the first is the default.
COMM_MODELS: Final = ("overlapped", "blocking")


def simulate(schedule: Schedule, costs: CostModel | None = None,
             comm: str = "overlapped") -> SimResult:
    """Simulate `schedule` under `costs` (default: F = 1, B = 2, free communication).

    Raises VerifyError(check="deadlock") when the schedule cannot run to the end.
    """
    if comm not in COMM_MODELS:
        raise UsageError(f"unknown communication model '{comm}' (expected "
                         f"{' or '.join(COMM_MODELS)})")
    costs = costs if costs is not None else CostModel()
    with paused_gc():
        return _simulate(schedule, costs, comm == "blocking")


def _simulate(schedule: Schedule, costs: CostModel, blocking: bool) -> SimResult:
    # NOTE: ops are numbered once (program order, rank by rank) and everything after that
    # works on lists indexed by number: hashing an Op is a Python-level call, and the main
    # loop would otherwise hash each op a few dozen times (5x slower at 65k ops).
    config = schedule.config
    progs = schedule.programs
    ops = [op for prog in progs for op in prog]
    n = len(ops)
    idx = {op: i for i, op in enumerate(ops)}
    rank = [r for r, prog in enumerate(progs) for _ in prog]
    stage = [op.stage for op in ops]
    cost = costs.cost
    dur = [cost(op) for op in ops]
    gpred = schedule.graph._pred  # NOTE: networkx's adjacency dict, read-only, for speed
    preds = [[idx[p] for p in gpred[op]] for op in ops]
    succs: list[list[int]] = [[] for _ in range(n)]
    for i, ps in enumerate(preds):
        for j in ps:
            succs[j].append(i)
    # An overlapped pair starts once both its ops' inputs are there: the first op also waits
    # for the arrival of what the second consumes (the transfer itself is the second's).
    joins: dict[int, list[tuple[int, int]]] = {}
    join_succs: dict[int, list[int]] = {}
    for p, first, second in pair_waits(schedule):
        j, i, k = idx[p], idx[first], idx[second]
        joins.setdefault(i, []).append((j, k))
        join_succs.setdefault(j, []).append(i)
    n_bound = max(0, config.stages - 1)
    # transfer time and size per stage boundary b (between stage b and b + 1)
    size = [costs.boundary_bytes(b) for b in range(n_bound)]
    hop = [costs.transfer_time(b, b + 1) for b in range(n_bound)]

    start = [0.0] * n
    end = [0.0] * n
    release = [0.0] * n  # when the op's rank may start its next op
    why = [-1] * n  # the predecessor that decided the op's start
    arrive: dict[tuple[int, int], float] = {}  # blocking model: when a send's data arrives
    sent: list[tuple[int, int, float, float, float]] = []
    indeg = [len(ps) + len(joins.get(i, ())) for i, ps in enumerate(preds)]
    ready = [i for i in range(n) if not indeg[i]]
    done = 0
    while ready:
        i = ready.pop()
        done += 1
        r = rank[i]
        si = stage[i]
        t = 0.0
        cause = -1
        for j in preds[i]:
            if rank[j] == r:
                x = release[j]
            else:
                sj = stage[j]
                h = 0.0 if sj == si else hop[sj if sj < si else si]
                x = arrive[j, i] if blocking else end[j] + h
                sent.append((j, i, x - h, x, 0.0 if sj == si else size[sj if sj < si else si]))
            if x > t or cause < 0:
                t, cause = x, j
        for j, k in joins.get(i, ()):
            sj, sk = stage[j], stage[k]
            h = 0.0 if rank[j] == rank[k] or sj == sk else hop[sj if sj < sk else sk]
            x = release[j] if rank[j] == r else (arrive.get((j, k), end[j] + h) if blocking
                                                 else end[j] + h)
            if x > t:
                t, cause = x, j
        e = t + dur[i]
        start[i] = t
        end[i] = e
        why[i] = cause
        rel = e
        for q in join_succs.get(i, ()):
            indeg[q] -= 1
            if not indeg[q]:
                ready.append(q)
        for q in succs[i]:
            if blocking and rank[q] != r:
                sq = stage[q]
                rel += 0.0 if sq == si else hop[sq if sq < si else si]
                arrive[i, q] = rel
            d = indeg[q] - 1
            indeg[q] = d
            if not d:
                ready.append(q)
        release[i] = rel

    if done < n:
        raise VerifyError(check_deadlock(schedule), "deadlock")
    return _result(schedule, costs, "blocking" if blocking else "overlapped", ops, rank,
                   start, end, release, why, sent)


def _result(schedule: Schedule, costs: CostModel, comm: str, ops: list[Op], rank: list[int],
            start: list[float], end: list[float], release: list[float], why: list[int],
            sent: list[tuple[int, int, float, float, float]]) -> SimResult:
    ranks = schedule.config.ranks
    makespan = max(release, default=0.0)
    busy = [0.0] * ranks
    sending = [0.0] * ranks
    for i, r in enumerate(rank):
        busy[r] += end[i] - start[i]
        sending[r] += release[i] - end[i]
    start_of = dict(zip(ops, start))
    peaks, peak_time = _peaks(schedule, start_of)
    peak_bytes = _peak_bytes(schedule.programs, costs) if costs.knows_memory else None
    sent.sort(key=_by_start)
    transfers = [Transfer(ops[j], ops[i], rank[j], rank[i], s, e, b) for j, i, s, e, b in sent]
    return SimResult(schedule=schedule, costs=costs, comm=comm, start=start_of,
                     end=dict(zip(ops, end)), makespan=makespan, busy=tuple(busy),
                     idle=tuple(makespan - b for b in busy), sending=tuple(sending),
                     peak_activations=peaks, peak_time=peak_time, peak_bytes=peak_bytes,
                     critical_path=_critical_path(ops, release, why), transfers=transfers)


def _by_start(t: tuple[int, int, float, float, float]) -> tuple[float, int]:
    return t[2], t[0]


def _peaks(schedule: Schedule, start: dict[Op, float]
           ) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """In-flight activations per rank, counted as `pipeir.verify` does, and when each peaks."""
    report = memory_report(schedule)
    return report.peak_activations, tuple(0.0 if op is None else start[op]
                                          for op in report.peak_at)


def _peak_bytes(progs: tuple[tuple[Op, ...], ...], costs: CostModel) -> tuple[float, ...]:
    def size(op: Op) -> float:
        return costs.activation_memory(op.stage) or 0.0
    return tuple(max((live for _, live in live_activations(prog, size)), default=0.0)
                 for prog in progs)


def _critical_path(ops: list[Op], release: list[float], why: list[int]) -> list[Op]:
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
