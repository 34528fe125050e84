"""The steady state: how long a step takes when steps run back to back.

`simulate` times one step on its own: every rank starts at 0 and the step ends when the last
op does (the *makespan*). That is the step time when the optimizer step is synchronised
across ranks (a global gradient norm for clipping, a NaN check): no rank may start step k + 1
before every rank has finished step k. With the optimizer stepped per stage as soon as the
stage's own gradients are done (the Zero Bubble paper's post-validation, sec. 5), steps
overlap: step k + 1 starts on a rank once that rank has finished step k, so one step's
cool-down runs beside the next step's warm-up.

Definition. Every rank runs its program once per step, step after step; an op of step k + 1
starts once its rank has finished step k (the rank's last op, and any side-channel op, of
step k has released it) and its inputs of step k + 1 have arrived; nothing crosses steps
otherwise (a stage's next forward needs only its own updated weights, and every stage lives
on one rank, so "not before the stage's optimizer step" is implied by the rank's program
order). The *steady step* is the limit of (end of step K) / K: the time per step that
training runs at.

How it is computed. Let x_r(k) be when rank r is free after step k. Timing step k + 1 is
the simulator's sweep with rank r not starting before x_r(k), and its end times are
max-plus linear in those: x_r(k + 1) = max over r' of x_r'(k) + A[r', r], where A[r', r] is
the longest path in one step from "rank r' may start" to "rank r is done" (-inf where there
is none; one sweep per rank r' gives a row). The limit of x(k) / k is then A's maximum cycle
mean (the max-plus eigenvalue; Karp's algorithm, exact, O(P^3)).

Two related figures, both reported:

* the *longest rank span* of the isolated step (from a rank's first op's start to its last
  op's release, the worst rank): the Zero Bubble paper's "cost" (its bubble rate is
  (cost - m (T_F + T_B + T_W)) / cost). Shifting the whole isolated step by that span is a
  valid back-to-back timing, so the steady step is never longer (it can be shorter where the
  isolated step's as-soon-as-possible timing starts a rank earlier than the steady state
  needs it to, lengthening that rank's span; on the library schedules the two agree);
* the makespan, which the steady step never exceeds either.

Bubbles are the idle share of the ranks over a step of that length: 1 - sum(busy) / (P x T)
with T the makespan (`SimResult.bubble`), the steady step, or the longest span (the paper's
figure where every rank is equally busy).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeir.diagnostics import VerifyError
from pipeir.schedule import Schedule, expect_schedule
from pipeir.sim.costs import CostModel, expect_costs
from pipeir.sim.engine import Timing
from pipeir.sim.result import SimResult, expect_result
from pipeir.verify import check_deadlock

NEG = -math.inf


@dataclass(frozen=True)
class SteadyState:
    """One schedule's steady state (see the module docstring): the time per step with steps
    back to back (`step`), the isolated step's `makespan` and per-rank `spans`, and each
    rank's `busy` time per step (compute only, as `SimResult.busy`)."""

    step: float
    makespan: float
    spans: tuple[float, ...]
    busy: tuple[float, ...]

    @property
    def longest_span(self) -> float:
        """The Zero Bubble paper's cost of a step: the longest rank's span."""
        return max(self.spans, default=0.0)

    def bubble_at(self, step: float) -> float:
        """The ranks' idle share of a step `step` long: 1 - sum(busy) / (ranks x step)."""
        if step <= 0 or not self.busy:
            return 0.0
        return max(0.0, 1.0 - sum(self.busy) / (len(self.busy) * step))

    @property
    def bubble(self) -> float:
        """The idle share of the steady step."""
        return self.bubble_at(self.step)

    @property
    def span_bubble(self) -> float:
        """The idle share of the longest rank's span (the paper's bubble rate)."""
        return self.bubble_at(self.longest_span)


def steady_state(schedule: Schedule, costs: CostModel, comm: str = "overlapped"
                 ) -> SteadyState:
    """The steady state of `schedule` under `costs` and `comm`; a VerifyError, as `simulate`
    gives, when the schedule deadlocks (its sweep would time only the ops that run: a step of
    0 was returned, silently)."""
    expect_schedule(schedule, "steady_state")
    costs = expect_costs(costs, "steady_state(costs=...)") or CostModel()
    timing = Timing(schedule, costs, comm)
    if not timing.complete:
        raise VerifyError(check_deadlock(schedule), check="deadlock")
    dur = [costs.cost(op) for op in timing.ops]
    ranks, rank = schedule.config.ranks, timing.rank
    matrix = _matrix(timing, dur, ranks)
    times = timing.sweep(dur)
    first = [-x for x in _last([-t for t in times.start], rank, ranks)]
    last = _last(times.release, rank, ranks)
    busy = [0.0] * ranks
    for i, d in enumerate(dur):
        if timing.channel[i] is None:
            busy[rank[i]] += d
    spans = tuple(b - a if b > NEG else 0.0 for a, b in zip(first, last))
    return SteadyState(cycle_time(matrix), max([0.0, *last]), spans, tuple(busy))


def steady(result: SimResult) -> SteadyState:
    """The steady state of a simulated schedule (see `steady_state`)."""
    expect_result(result, "steady", "for a schedule: steady_state(schedule, costs)")
    return steady_state(result.schedule, result.costs, result.comm)


def _matrix(timing: Timing, dur: Sequence[float], ranks: int) -> list[list[float]]:
    """A[r'][r]: when rank r is done if rank r' may start at 0 and no other rank ever may
    (-inf: never), as rows."""
    if timing.blocking:  # one sweep per source rank
        out = []
        for src in range(ranks):
            ready = [NEG] * ranks
            ready[src] = 0.0
            out.append(_last(timing.sweep(dur, ready).release, timing.rank, ranks))
        return out
    # NOTE: overlapped, the same sweep for every source rank at once: each op's end is a
    # vector over source ranks (max-plus linear in their ready times), so a step of P
    # ranks costs one pass with small vector operations instead of P passes (0.1 s
    # instead of 2 s for ZB-V at p = 32, m = 96)
    n = len(timing.ops)
    own = np.full((ranks, ranks), NEG)
    np.fill_diagonal(own, 0.0)
    end = np.full((n, ranks), NEG)
    inputs, rank = timing.inputs, timing.rank
    for i in timing.order:
        t = own[rank[i]]
        for j, h in inputs[i]:
            t = np.maximum(t, end[j] + h)
        end[i] = t + dur[i]
    done = np.full((ranks, ranks), NEG)  # [rank, source]
    np.maximum.at(done, np.asarray(rank, dtype=np.intp), end)
    rows: list[list[float]] = done.T.tolist()
    return rows


def _last(times: Sequence[float], rank: Sequence[int], ranks: int) -> list[float]:
    """Per rank, the latest of `times` (one per op; -inf for a rank with none)."""
    out = [NEG] * ranks
    for r, t in zip(rank, times):
        if t > out[r]:
            out[r] = t
    return out


def cycle_time(matrix: Sequence[Sequence[float]]) -> float:
    """The maximum cycle mean of the max-plus matrix `matrix` (matrix[u][v]: the weight of
    the edge u -> v, -inf where there is none), by Karp's theorem with every node a source;
    0 when the graph has no cycle (no rank has ops)."""
    n = len(matrix)
    if n == 0:
        return 0.0
    walks = [[0.0] * n]  # walks[k][v]: the heaviest walk of exactly k edges ending at v
    for _ in range(n):
        prev = walks[-1]
        walks.append([max((prev[u] + matrix[u][v] for u in range(n) if prev[u] > NEG
                           and matrix[u][v] > NEG), default=NEG) for v in range(n)])
    best = NEG
    for v in range(n):
        last = walks[n][v]
        if last == NEG:
            continue
        best = max(best, min((last - walks[k][v]) / (n - k) for k in range(n)
                             if walks[k][v] > NEG))
    return max(best, 0.0)
