"""reorder: choose the order in which micro-batches enter the pipeline (dynamic micro-batching).

When micro-batches differ in cost (variable sequence lengths), which one goes first matters:
the long ones stretch the fill and drain of the pipeline if they sit at either end, and hide
in the steady state if they sit in the middle. The pass *relabels* micro-batches: a
permutation π sends every op of micro-batch slot k to micro-batch π[k], on every rank, so
micro-batch π[k] enters k-th. Candidates (the input order, longest-first, shortest-first,
"bookend": short ones at both ends, long ones in the middle, and its reverse) are evaluated,
then random swap moves from the best, until the time or evaluation budget is spent.

NOTE (guarantees). A relabelled schedule is valid whenever the input is: every program keeps
its positions and op kinds, and the dependency rule is the same for every micro-batch, so
each slot's ops keep their dependency pattern (no deadlock, complete, same placement). The
in-flight count at each program position is unchanged, so the per-rank peak memory is the
input's exactly (and in bytes too: activation sizes are per stage, not per micro-batch).
The input order is always a candidate and a permutation is kept only when it is strictly
faster under the same simulator, so the pass never lengthens the simulated step.

Costs come from the pass context (`PassContext`), because pass options are scalars: `pipeirc
opt` puts the file's costs block there. Without costs every micro-batch costs the same,
nothing can be gained, and the pass returns its input.

The evaluator (`SlotSimulator`) numbers the schedule's dependency structure once with the
simulator's own timing core (`pipeir.sim.engine.Timing`) and sweeps it with per-op durations
looked up through π, so it reproduces `pipeir.sim.simulate`'s makespan exactly, bit for bit,
for both communication models, at a fraction of a full simulation's cost. On lognormal
lengths the five candidates find nearly all of the gain (bench/reorder.py); the swaps add
little. The per-rank order of ops is kept as the input has it: reordering ops within a rank
is not attempted. `StepPlanner` is the same search for the runtime, once per training step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Literal

from pipeir._gc import paused_gc  # NOTE: the sweeps allocate many short lists, no cycles
from pipeir.config import PipelineConfig
from pipeir.diagnostics import VerifyError
from pipeir.ops import NO_MB, REDUCE, Kind, Op
from pipeir.passes.base import OptionError, Pass
from pipeir.passes.context import PassContext, given
from pipeir.schedule import Schedule
from pipeir.sim.costs import CostModel
from pipeir.sim.engine import Timing
from pipeir.verify import check_deadlock

if TYPE_CHECKING:
    from pipeir.sim.costs import CostModel


@dataclass(frozen=True)
class Reorder(Pass):
    """Relabel micro-batches so the ones that cost most sit where they hurt least."""

    name: ClassVar[str] = "reorder"
    summary: ClassVar[str] = ("choose the micro-batch entry order that shortens the simulated "
                              "step under the context's costs (same memory, never slower)")
    costed: ClassVar[bool] = True

    by: Literal["cost"] = "cost"
    budget_ms: int = 20
    evals: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.budget_ms < 0:
            raise OptionError("budget_ms", f"reorder: budget_ms must be >= 0, got {self.budget_ms}")
        if self.evals < 1:
            raise OptionError("evals", f"reorder: evals must be >= 1, got {self.evals}")

    def run(self, schedule: Schedule, ctx: PassContext | None = None) -> Schedule:
        ctx = given(ctx, self.name)
        plan = plan_order(schedule, ctx.costs, comm=ctx.comm, budget_s=self.budget_ms / 1e3,
                          evals=self.evals, seed=self.seed)
        return relabel(schedule, plan.order) if plan.improved else schedule


@dataclass(frozen=True)
class Plan:
    """A micro-batch entry order: `order[k]` is the micro-batch that takes slot k."""

    order: tuple[int, ...]
    makespan: float
    fixed_makespan: float
    evaluations: int

    @property
    def improved(self) -> bool:
        return self.makespan < self.fixed_makespan

    @property
    def reduction(self) -> float:
        """Fraction of the fixed order's step time saved."""
        if self.fixed_makespan <= 0:
            return 0.0
        return 1.0 - self.makespan / self.fixed_makespan


def relabel(schedule: Schedule, order: Sequence[int]) -> Schedule:
    """Every op of micro-batch k becomes one of micro-batch `order[k]` (a permutation)."""
    m = schedule.config.microbatches
    if sorted(order) != list(range(m)):
        raise ValueError(f"order must be a permutation of 0..{m - 1}")
    progs = [[Op(op.kind, op.stage, order[op.mb]) if op.mb != NO_MB else op for op in prog]
             for prog in schedule.programs]
    return schedule.with_programs(progs)


class SlotSimulator:
    """`pipeir.sim.simulate`'s makespan as a function of the micro-batch order, for one
    schedule and one cost model: the structure is numbered once (`pipeir.sim.engine.Timing`),
    each call is one sweep with durations looked up through the order."""

    def __init__(self, schedule: Schedule, costs: CostModel, comm: str = "overlapped"):

        self.timing = Timing(schedule, costs, comm)
        if not self.timing.complete:

            raise VerifyError(check_deadlock(schedule), "deadlock")
        self.microbatches = m = schedule.config.microbatches
        groups: dict[tuple[Kind, int], int] = {}
        self.group = [groups.setdefault((op.kind, op.stage), len(groups))
                      for op in self.timing.ops]
        # a reduction has no micro-batch; its cost is the same in any slot
        self.slot = [max(op.mb, 0) for op in self.timing.ops]
        self.table = [[costs.cost(Op(kind, stage, NO_MB if kind == REDUCE else k))
                       for k in range(m)] for (kind, stage) in groups]
        self.weight = [sum(row[k] for row in self.table) for k in range(m)]

    def makespan(self, order: Sequence[int]) -> float:
        """The simulated step time when micro-batch `order[k]` takes slot k."""
        table = self.table
        return self.timing.makespan([table[g][order[k]] for g, k in zip(self.group, self.slot)])


def candidates(weight: Sequence[float]) -> list[tuple[int, ...]]:
    """Orders worth trying first: as given, longest-first, shortest-first, bookend (short at
    both ends, long in the middle) and its reverse."""
    m = len(weight)
    asc = sorted(range(m), key=lambda k: (weight[k], k))
    front: list[int] = []
    back: list[int] = []
    for n, k in enumerate(asc):
        (front if n % 2 == 0 else back).append(k)
    bookend = front + back[::-1]
    out = [tuple(range(m)), tuple(asc[::-1]), tuple(asc), tuple(bookend), tuple(bookend[::-1])]
    seen: set[tuple[int, ...]] = set()
    return [o for o in out if not (o in seen or seen.add(o))]  # type: ignore[func-returns-value]


def search(sim: SlotSimulator, budget_s: float = 0.02, evals: int = 2000,
           seed: int = 0) -> Plan:
    """The best order found: candidates first, then random swaps from the best (first
    improvement), until `budget_s` seconds or `evals` evaluations are spent."""
    deadline = time.perf_counter() + budget_s
    m = sim.microbatches
    fixed = sim.makespan(range(m))
    best, best_t, n = tuple(range(m)), fixed, 1
    if m < 2 or max(sim.weight) == min(sim.weight):
        return Plan(best, best_t, fixed, n)
    for cand in candidates(sim.weight)[1:]:
        if n >= evals:
            break
        t = sim.makespan(cand)
        n += 1
        if t < best_t:
            best, best_t = cand, t
    rnd = random.Random(seed)
    cur = list(best)
    while n < evals and time.perf_counter() < deadline:
        a, b = rnd.randrange(m), rnd.randrange(m - 1)
        b += b >= a
        if sim.weight[cur[a]] == sim.weight[cur[b]]:
            n += 1  # an exchange of equals changes nothing; still counts against the budget
            continue
        cur[a], cur[b] = cur[b], cur[a]
        t = sim.makespan(cur)
        n += 1
        if t < best_t:
            best, best_t = tuple(cur), t
        else:
            cur[a], cur[b] = cur[b], cur[a]
    return Plan(best, best_t, fixed, n)


def plan_order(schedule: Schedule, costs: CostModel, comm: str = "overlapped",
               budget_s: float = 0.02, evals: int = 2000, seed: int = 0) -> Plan:
    """The micro-batch entry order for `schedule` under `costs` (see `search`)."""
    t0 = time.perf_counter()
    with paused_gc():
        sim = SlotSimulator(schedule, costs, comm)
        # the budget covers compiling the structure too: it is what a step's re-plan costs
        return search(sim, max(0.0, budget_s - (time.perf_counter() - t0)), evals, seed)


@dataclass(frozen=True)
class StepPlanner:
    """Re-plans the micro-batch order at every training step from that step's micro-batch
    lengths (the runtime's per-step plan).

    NOTE: every rank computes the plan on its own and they must agree, so the search here is
    bounded by a number of evaluations, never by time (a time budget would let a loaded rank
    stop earlier and pick another order). Plain tuples only: the planner is pickled to the
    worker processes, where an `Op`'s cached hash would not be valid (string hashing is
    seeded per process).
    """

    ranks: int
    microbatches: int
    stages: int
    placement: tuple[int, ...]
    programs: tuple[tuple[tuple[str, int, int], ...], ...]
    settings: tuple[tuple[str, object], ...]  # cost settings, without lengths
    comm: str = "overlapped"
    evals: int = 200
    seed: int = 0

    @classmethod
    def of(cls, schedule: Schedule, settings: dict[str, object] | None = None,
           comm: str = "overlapped", evals: int = 200) -> StepPlanner:
        """`settings` are plain cost settings (name -> value, e.g. a cost file's); the
        lengths come from each step's data, so `lengths` and `length_ref` are dropped."""
        c = schedule.config
        kept = tuple(sorted((k, tuple(v) if isinstance(v, list) else v)
                            for k, v in (settings or {}).items()
                            if k not in ("lengths", "length_ref", "meta")
                            and not k.startswith("meta.")))
        return cls(c.ranks, c.microbatches, c.stages, c.placement,
                   tuple(tuple((op.kind, op.stage, op.mb) for op in prog)
                         for prog in schedule.programs), kept, comm, evals)

    def order(self, lengths: Sequence[float]) -> tuple[int, ...]:
        """The entry order for micro-batches of these lengths: slot k runs micro-batch
        `order[k]`. The identity when reordering would not shorten the simulated step."""

        if len(lengths) != self.microbatches:
            raise ValueError(f"{len(lengths)} lengths for {self.microbatches} micro-batches")
        costs = CostModel.from_settings({**dict(self.settings), "lengths": tuple(lengths)})
        sim = SlotSimulator(_schedule_of(self), costs, self.comm)
        return search(sim, budget_s=float("inf"), evals=self.evals, seed=self.seed).order


def _schedule_of(p: StepPlanner) -> Schedule:
    """The planner's schedule, built once per process."""
    got = _BUILT.get(p)
    if got is None:

        config = PipelineConfig(p.ranks, p.microbatches, p.stages, p.placement)
        got = Schedule.from_programs(config, [[Op(k, s, m) for k, s, m in prog]  # type: ignore[arg-type]
                                              for prog in p.programs])
        _BUILT[p] = got
    return got


_BUILT: dict[StepPlanner, Schedule] = {}
