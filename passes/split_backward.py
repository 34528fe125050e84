"""split-backward: zero-bubble pipelining (Qi et al., 2024) as a transformation.

Each backward B(s, mb) becomes I(s, mb) (input gradient, on the critical path between ranks)
and W(s, mb) (weight gradient, needed by nobody but the optimizer), and the W ops are moved
into the pipeline's bubbles. The two modes are the paper's handcrafted schedules, derived
from the input schedule rather than rebuilt from scratch, so any valid input works:

* ``h1`` (ZB-H1) keeps every F and I where the input had F and B, and delays each rank's W
  ops by `lag[r] = P - peak[r]` backwards, where `peak[r]` is the rank's peak of in-flight
  micro-batches in the input and `P` the largest peak. Every rank then peaks at P, so the
  schedule's peak memory is the input's (the paper's claim: rank 0's 1F1B peak, p); later
  ranks hold more than in 1F1B, which is what pays for the shorter cool-down. On 1F1B with
  F = I = W the idle time per rank drops from (p-1)(F+I+W) to (p-1)(F+I-W).
  Where the context's costs split memory (`memory_w_bytes`: an I frees what W does not
  keep, `pipeir.memmodel`), a W waiting after its I holds only that fraction a of an
  activation, so a rank may lag further within the same budget: each rank's lag is then the
  largest whose counted peak stays within the schedule's `memory_limit` (without one, the
  input's peak P), at least `P - peak[r]`; kept only when it simulates faster under the
  context's costs (on 1F1B a rank i holds p - i + lag a, so with the limit p rank i lags
  up to floor(i / a)).
* ``h2`` (ZB-H2) also moves forwards: a list scheduler with unit op costs runs, on each rank,
  the next I when it is ready, else the next F while fewer than `2P - 1` micro-batches are in
  flight, else the oldest pending W. Each rank keeps the input's order of forwards and of
  backwards. On 1F1B with m >= 2p - 1 every rank is busy without a gap from its first op to
  its last (the paper's parallelogram: bubble (p-1)(F+I-2W) = 0 when F = I = W).

NOTE: guarantees. Both modes only ever produce valid schedules: h1 keeps the input's order of
every op but W, and a W depends only on the I before it on the same rank; h2 is the record of
a dependency-respecting execution, and it cannot get stuck (the op of the input's earliest
start among the ranks' next ops is always runnable, see `_list_schedule`). Neither mode is
allowed to be slower than its input: the pass simulates the construction and the input
with each B split in place, with the default costs (F = I = W = 1, B = 2, free
communication), and keeps the in-place split if the construction loses (it never does on
1F1B; it can on inputs whose W ops were already placed well).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import ClassVar, Literal

from pipeir.diagnostics import UsageError
from pipeir.memmodel import live_memory
from pipeir.ops import Op
from pipeir.passes.base import OptionError, Pass
from pipeir.passes.context import DEFAULT_CONTEXT, PassContext
from pipeir.passes.dp_reduce import reject_reductions
from pipeir.passes.memory import reject_memory_ops
from pipeir.schedule import Schedule
from pipeir.sim import CostModel, simulate  # only the checks need the simulator
from pipeir.verify import fits_in, memory_report

Mode = Literal["h1", "h2"]


@dataclass(frozen=True)
class SplitBackward(Pass):
    """Split every backward into I + W and move the W ops into the bubbles."""

    name: ClassVar[str] = "split-backward"
    summary: ClassVar[str] = ("zero bubble: each B becomes I + W, W ops fill the bubbles "
                              "(h1: same peak memory; h2: up to 2p-1 in flight, no bubble)")

    mode: Mode = "h1"

    def __post_init__(self) -> None:
        if self.mode not in ("h1", "h2"):
            raise OptionError("mode", f"split-backward: mode must be h1 or h2, got {self.mode!r}")

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        reject_reductions(schedule, self.name)
        reject_memory_ops(schedule, self.name)
        plain = split_in_place(schedule)
        if self.mode == "h1":
            built = schedule.with_programs(lagged_w(schedule))
            deeper = schedule.with_programs(lagged_w(schedule, ctx.costs))
            if _faster(deeper, built, ctx):
                built = deeper
        else:
            built = schedule.with_programs(list_schedule(schedule))
        return built if not _slower(built, plain) else plain


def _backwards(prog: tuple[Op, ...]) -> list[Op]:
    """The rank's backwards in program order, as I ops (a B and an existing I alike)."""
    return [Op("I", op.stage, op.mb) for op in prog if op.kind in ("B", "I")]


def split_in_place(schedule: Schedule) -> Schedule:
    """Every B replaced in place by I then W; existing I and W ops stay where they are.
    Exactly as fast and as memory-hungry as the input when B costs I + W."""
    progs = []
    for prog in schedule.programs:
        out: list[Op] = []
        for op in prog:
            if op.kind == "B":
                out.extend((Op("I", op.stage, op.mb), Op("W", op.stage, op.mb)))
            else:
                out.append(op)
        progs.append(out)
    return schedule.with_programs(progs)


def lagged_w(schedule: Schedule, sizes: CostModel | None = None) -> list[list[Op]]:
    """ZB-H1: the input's order with B -> I, and W of the i-th backward after the
    (i + lag)-th one, lag = P - peak[r]; the last `lag` W ops close the program. With
    `sizes` whose memory is split, each rank's lag is the largest that keeps its peak,
    counted with the split, within the budget (the module docstring)."""
    peaks = memory_report(schedule).peak_activations
    top = max(peaks, default=0)
    split = sizes is not None and sizes.splits_memory
    budget = schedule.config.memory_limit if schedule.config.memory_limit is not None else top
    progs = []
    for r, prog in enumerate(schedule.programs):
        lag = int(top - peaks[r])
        out = _lagged(prog, lag)
        while split and sizes is not None and lag < len(prog):
            more = _lagged(prog, lag + 1)
            if not fits_in(_peak(more, sizes), budget):
                break
            lag, out = lag + 1, more
        progs.append(out)
    return progs


def _lagged(prog: tuple[Op, ...], lag: int) -> list[Op]:
    """One rank's program with B -> I and each W `lag` backwards after its I."""
    out: list[Op] = []
    pending: deque[Op] = deque()
    for op in prog:
        if op.kind == "F":
            out.append(op)
        elif op.kind in ("B", "I"):
            out.append(Op("I", op.stage, op.mb))
            pending.append(Op("W", op.stage, op.mb))
            if len(pending) > lag:
                out.append(pending.popleft())
    out.extend(pending)
    return out


def _peak(prog: list[Op], sizes: CostModel) -> float:
    """A rank's peak of activations along `prog`, counted with the split of `sizes`."""
    return max((live for _, live in live_memory(prog, lambda op: sizes.counted_memory(op.stage))),
               default=0.0)


def list_schedule(schedule: Schedule) -> list[list[Op]]:
    """ZB-H2: simulate with unit costs; each rank runs, when free, its next I if ready, else
    its next F if ready and fewer than 2P - 1 micro-batches are in flight, else its oldest
    pending W. Returns the order in which each rank ran its ops.

    NOTE: why it never gets stuck. Let x be, among every rank's next F and next I, the op
    that starts first in the input. Everything x needs comes earlier in the input, and each
    rank runs its forwards (and its backwards) in input order, so all of it has run. If x is
    an I it is ready. If x is an F on rank r, the ranks's in-flight count is at most the
    input's just before x (every backward before x in the input has run here), which is below
    the input's peak, which is at most the limit.
    """
    c = schedule.config
    peaks = memory_report(schedule).peak_activations
    limit = [max(peaks[r], 2 * max(peaks) - 1) for r in range(c.ranks)]
    if c.memory_limit is not None:  # a verified input peaks within it, so the proof holds
        limit = [min(c.memory_limit, x) for x in limit]
    fwd = [deque(op for op in prog if op.kind == "F") for prog in schedule.programs]
    bwd = [deque(_backwards(prog)) for prog in schedule.programs]
    pending: list[deque[Op]] = [deque() for _ in range(c.ranks)]
    live = [0] * c.ranks
    done: dict[Op, int] = {}  # op -> the time step it finished at
    out: list[list[Op]] = [[] for _ in range(c.ranks)]
    left = sum(len(q) for q in fwd) + 2 * sum(len(q) for q in bwd)
    last = c.stages - 1
    t = 0

    def finished(op: Op) -> bool:
        return done.get(op, t + 1) <= t

    while left:
        ran: list[Op] = []
        for r in range(c.ranks):
            b, f = bwd[r], fwd[r]
            if b and finished(Op("F", b[0].stage, b[0].mb)) and (
                    b[0].stage == last or finished(Op("I", b[0].stage + 1, b[0].mb))):
                op = b.popleft()
                pending[r].append(Op("W", op.stage, op.mb))
            elif f and live[r] < limit[r] and (
                    f[0].stage == 0 or finished(Op("F", f[0].stage - 1, f[0].mb))):
                op = f.popleft()
                live[r] += 1
            elif pending[r]:
                op = pending[r].popleft()
                live[r] -= 1
            else:
                continue
            out[r].append(op)
            ran.append(op)
        if not ran:  # pragma: no cover - impossible for a valid input (see the NOTE above)
            raise UsageError("split-backward{mode=h2}: the input cannot be reordered (is it "
                             "a verified schedule?); mode=h1 keeps its order")
        for op in ran:
            done[op] = t + 1
        left -= len(ran)
        t += 1
    return out


def _faster(candidate: Schedule, baseline: Schedule, ctx: PassContext) -> bool:
    """Whether `candidate` simulates strictly faster than `baseline` under the context."""
    if candidate.programs == baseline.programs:
        return False
    return (simulate(candidate, ctx.costs, comm=ctx.comm).makespan
            < simulate(baseline, ctx.costs, comm=ctx.comm).makespan)


def _slower(candidate: Schedule, baseline: Schedule) -> bool:

    return simulate(candidate).makespan > simulate(baseline).makespan
