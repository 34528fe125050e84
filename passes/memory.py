"""recompute and offload: fit a schedule into a memory budget at the least added step time.

Both passes choose, per stage and micro-batch, which forwards give up their activations:

* ``recompute`` turns F(s, mb) into a checkpointed FC(s, mb) (keeps only its input) and
  places its RC(s, mb) on the same rank between the FC and the backward: right before the
  backward, or up to `max_shift` ops earlier, where it may land in a bubble (it then holds
  the activations from there on);
* ``offload`` puts OFF(s, mb) right after F(s, mb) and RELOAD(s, mb) right before the
  backward or up to `max_shift` ops earlier (they run on the rank's copy channel, so they
  cost time only when a backward has to wait for its reload).

`budget` is per rank: bytes of saved activations when the cost model gives `memory_bytes`,
else units of one stage's activations for one micro-batch (as `pipeirc check` counts them);
either way an I frees what W does not keep (`memory_w_bytes`, `pipeir.memmodel`).

NOTE (the search): greedy. While some rank is over budget, every candidate move on the rank
that is furthest over (each forward there that keeps its activations, at each allowed
position) is simulated (`pipeir.sim.Timing`, under the pass context's costs; largest
reduction first, stopping at the first move that adds no time), and the move with
the least added makespan per unit of "overflow" it removes wins (overflow: the sum over the
rank's program of how far the live activations are above the budget, see
`pipeir.memmodel.live_memory`); ties go to the larger reduction. Memory is counted in program
order, as the verifier counts it. `recompute{all=true}` is the peers' global switch instead:
every forward but the last stage's is checkpointed and recomputed right before its backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from pipeir.diagnostics import UsageError
from pipeir.memmodel import StageMemory, live_memory
from pipeir.ops import MEMORY_KINDS, Op
from pipeir.passes.base import OptionError, Pass
from pipeir.passes.context import DEFAULT_CONTEXT, PassContext
from pipeir.schedule import Schedule
from pipeir.sim.engine import Timing

Programs = list[list[Op]]
Move = Callable[[tuple[Op, ...], Op, int], list[Op] | None]


@dataclass(frozen=True)
class Recompute(Pass):
    """Checkpoint forwards and recompute them before their backward, within a budget."""

    name: ClassVar[str] = "recompute"
    summary: ClassVar[str] = ("fit a memory budget per rank by recomputing the forwards that "
                              "cost the least step time (or all=true: every forward)")

    budget: float = 0.0
    max_shift: int = 4
    all: bool = False

    def __post_init__(self) -> None:
        _check(self.budget, self.max_shift, self.all)

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        if self.all:
            return schedule.with_programs([_recompute_all(schedule, prog)
                                           for prog in schedule.programs])
        return fit(schedule, ctx, self.budget, self.max_shift, _recompute_at)


@dataclass(frozen=True)
class Offload(Pass):
    """Offload activations to host memory after the forward and reload them in time."""

    name: ClassVar[str] = "offload"
    summary: ClassVar[str] = ("fit a memory budget per rank by offloading activations to host "
                              "memory (copy channel) where it costs the least step time")

    budget: float = 0.0
    max_shift: int = 4

    def __post_init__(self) -> None:
        _check(self.budget, self.max_shift, False)

    def run(self, schedule: Schedule, ctx: PassContext = DEFAULT_CONTEXT) -> Schedule:
        return fit(schedule, ctx, self.budget, self.max_shift, _offload_at)


def _check(budget: float, max_shift: int, every: bool) -> None:
    if not every and not budget > 0:
        raise OptionError("budget", "a positive budget per rank is needed (bytes with "
                          "memory_bytes in the costs, else activations)")
    if max_shift < 0:
        raise OptionError("max_shift", f"max_shift must be >= 0, got {max_shift}")


def reject_memory_ops(schedule: Schedule, pass_name: str) -> None:
    """For passes that rebuild programs from F/B/I/W alone: a UsageError when `schedule`
    already has memory ops (they would be lost), saying to run recompute/offload later."""
    op = next((o for o in schedule if o.kind in MEMORY_KINDS), None)
    if op is not None:
        raise UsageError(f"{pass_name} works on F/B/I/W schedules, but this one has {op}: run "
                         f"recompute and offload after {pass_name}", schedule.span_of(op))


# ---- moves --------------------------------------------------------------------------------
def _backward_at(prog: list[Op] | tuple[Op, ...], s: int, m: int) -> int:
    return next(i for i, op in enumerate(prog)
                if op.stage == s and op.mb == m and op.kind in ("B", "I"))


def _recompute_at(prog: tuple[Op, ...], f: Op, shift: int) -> list[Op] | None:
    """`prog` with F `f` checkpointed and its RC `shift` ops before its backward (None when
    that would be before the FC)."""
    out = [Op("FC", f.stage, f.mb) if op == f else op for op in prog]
    b = _backward_at(out, f.stage, f.mb)
    at = b - shift
    if at <= out.index(Op("FC", f.stage, f.mb)):
        return None
    out.insert(at, Op("RC", f.stage, f.mb))
    return out


def _offload_at(prog: tuple[Op, ...], f: Op, shift: int) -> list[Op] | None:
    """`prog` with OFF right after `f` and RELOAD `shift` ops before the backward."""
    out = list(prog)
    at_f = out.index(f)
    out.insert(at_f + 1, Op("OFF", f.stage, f.mb))
    at = _backward_at(out, f.stage, f.mb) - shift
    if at <= at_f + 1:
        return None
    out.insert(at, Op("RELOAD", f.stage, f.mb))
    return out


def _recompute_all(schedule: Schedule, prog: tuple[Op, ...]) -> list[Op]:
    last = schedule.config.stages - 1
    out = list(prog)
    for f in prog:
        if f.kind == "F" and f.stage != last:
            got = _recompute_at(tuple(out), f, 0)
            assert got is not None  # the backward comes after its forward
            out = got
    return out


# ---- the search ---------------------------------------------------------------------------
def fit(schedule: Schedule, ctx: PassContext, budget: float, max_shift: int, move: Move
        ) -> Schedule:
    """Apply `move`s greedily until every rank is within `budget` (see the module NOTE)."""
    costs = ctx.costs
    memory = costs.op_memory()
    last = schedule.config.stages - 1
    cur = schedule
    span = _makespan(cur, ctx)
    while True:
        over = [_overflow(prog, budget, memory) for prog in cur.programs]
        if max(over, default=0.0) <= 0:
            return cur
        r = max(range(len(over)), key=over.__getitem__)
        prog = cur.programs[r]
        moves: list[tuple[float, list[Op]]] = []  # (overflow removed, program)
        for f in prog:
            if f.kind != "F" or (f.stage == last and move is _recompute_at):
                continue
            if Op("OFF", f.stage, f.mb) in cur:  # already offloaded
                continue
            for shift in range(max_shift + 1):
                new_prog = move(prog, f, shift)
                if new_prog is None:
                    break
                gain = over[r] - _overflow(new_prog, budget, memory)
                if gain > 0:
                    moves.append((gain, new_prog))
        # NOTE: simulated largest gain first, so that the first move that adds no time ends
        # the round: every move after it removes less overflow (or as much, found later), so
        # it could not win. The winner is the one a full scan picks.
        moves.sort(key=lambda g: -g[0])  # (stable: equal gains stay in scan order)
        best: tuple[float, float, Schedule] | None = None
        for gain, new_prog in moves:
            progs = [list(p) for p in cur.programs]
            progs[r] = new_prog
            cand = cur.with_programs(progs)
            cost = max(0.0, _makespan(cand, ctx) - span) / gain
            if best is None or (cost, -gain) < (best[0], -best[1]):
                best = (cost, gain, cand)
            if cost == 0:
                break
        if best is None:
            raise UsageError(f"cannot fit rank {r} into the budget of {budget:g}: nothing "
                             "left to recompute or offload lowers its peak further")
        cur = best[2]
        span = _makespan(cur, ctx)


def _overflow(prog: tuple[Op, ...] | list[Op], budget: float,
              memory: Callable[[Op], StageMemory]) -> float:
    """How far the rank's live activations are above `budget`, summed over its program."""
    return sum(max(0.0, live - budget) for _, live in live_memory(prog, memory))


def _makespan(schedule: Schedule, ctx: PassContext) -> float:
    timing = Timing(schedule, ctx.costs, ctx.comm)
    return timing.makespan([ctx.costs.cost(op) for op in timing.ops])

