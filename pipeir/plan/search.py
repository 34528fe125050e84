"""Choose the cut points and the schedule together: the best few splits by the dynamic
program (`pipeir.plan.partition`), each refined by tune's search of schedules in the
simulator, under a memory budget; beside them the uniform split with tune's best.

NOTE (memory). A budget is either a count, tune's unit (micro-batches of activations a rank
may hold, 1F1B needs P), or bytes per rank: the simulated peak of saved activations on the
rank plus `weight_copies` times the parameter bytes it holds (2: weights and gradients; an
optimizer with state adds its copies, Adam 2 more). The dynamic program already drops stages
that cannot fit 1F1B's in-flight micro-batches (min(P - k, M) on stage k); each schedule tune
finds is then checked against the budget with its own simulated peak, and the fastest that
fits is kept. Splits are searched with one stage per rank: interleaving assumes a stage cut
into v equal chunks, which a planned split, unequal by design, is not; the uniform split is
searched with interleaving (up to as many chunks as its smallest stage has pieces), so the
comparison gives the baseline every schedule tune knows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeir.diagnostics import UsageError
from pipeir.plan.layers import (
    Cut,
    LayerCost,
    Link,
    bounds,
    cost_settings,
    stage_cost,
    stages_of,
)
from pipeir.plan.partition import (
    StageScore,
    best_splits,
    bound_score,
    lower_bound,
    uniform_cut,
    work_score,
)
from pipeir.sim import CostModel, simulate
from pipeir.tune import SPLITS, Candidate, search

#: A budget: a count of micro-batch activations (int) or bytes per rank (float), as
#: `pipeir.cli.common.memory_limit` reads `--memory`.
Budget = int | float

#: Transfers that cost nothing.
NO_LINK = Link()


@dataclass(frozen=True)
class Choice:
    """A split and the schedule tune found for it."""

    cut: Cut
    candidate: Candidate
    rank_bytes: tuple[float, ...] | None  # simulated activations + weight copies, per rank

    @property
    def step(self) -> float:
        return self.candidate.step_time


@dataclass(frozen=True)
class Plan:
    """What `plan` found: the chosen split and schedule, the bounds, the baseline."""

    layers: tuple[LayerCost, ...]
    ranks: int
    microbatches: int
    link: Link
    memory: Budget | None
    weight_copies: float
    planned: Choice
    uniform: Choice | None  # None: no schedule of the uniform split fits the budget
    bound: float  # the planned split's lower bound (`partition.lower_bound`)
    best_bound: float  # the least bound over all splits, free transfers
    splits_tried: int

    @property
    def gain(self) -> float | None:
        """How much faster the plan is than the uniform split's best (0.2 = 20 %)."""
        return None if self.uniform is None else self.uniform.step / self.planned.step - 1

    @property
    def gap(self) -> float:
        """The plan's distance above its lower bound (0.03 = 3 %)."""
        return self.planned.step / self.bound - 1 if self.bound > 0 else 0.0


def plan(layers: Sequence[LayerCost], ranks: int, microbatches: int, link: Link = NO_LINK,
         memory: Budget | None = None, weight_copies: float = 2.0, keep: int = 6,
         splits: Sequence[str | None] = SPLITS,
         comms: Sequence[str] = ("overlapped", "blocking")) -> Plan:
    """Plan a pipeline of `ranks` stages over `layers` (one micro-batch of `microbatches`):
    the `keep` best splits by stage work and by lower bound, plus the uniform split, each
    with tune's fastest schedule within `memory`. `splits` and `comms` narrow tune's
    split-backward modes and comm models (a model whose backward cannot be split: (None,))."""
    layers = tuple(layers)
    if ranks < 1:
        raise UsageError(f"--ranks {ranks}: need at least 1 rank")
    if ranks > len(layers):
        raise UsageError(f"--ranks {ranks}: the model has {len(layers)} pieces (its split "
                         f"points and its start), so at most {len(layers)} stages")
    if microbatches < 1:
        raise UsageError(f"--microbatches {microbatches}: need at least 1")
    if weight_copies < 0:
        raise UsageError(f"--weight-copies {weight_copies:g}: cannot be negative")
    fits = _fits_1f1b(layers, ranks, microbatches, memory, weight_copies)
    cuts: dict[Cut, None] = {}
    for score in (work_score(layers), bound_score(layers, microbatches)):
        cuts.update((c, None) for _, c in best_splits(len(layers), ranks, _within(score, fits),
                                                       keep))
    uni = uniform_cut(len(layers), ranks)
    cuts[uni] = None
    chosen = [c for c in (_refine(layers, cut, ranks, microbatches, link, memory,
                                  weight_copies, 1, splits, comms) for cut in cuts)
              if c is not None]
    if not chosen:
        raise UsageError(_nothing_fits(layers, ranks, microbatches, memory, weight_copies))
    planned = min(chosen, key=lambda c: (c.step, c.candidate.sort_key()))
    smallest = min(hi - lo for lo, hi in bounds(uni, len(layers)))
    max_v = 1
    while max_v * 2 <= min(smallest, 8) and ranks > 1:
        max_v *= 2
    uniform = _refine(layers, uni, ranks, microbatches, link, memory, weight_copies, max_v,
                      splits, comms)
    best = best_splits(len(layers), ranks, bound_score(layers, microbatches))
    return Plan(layers, ranks, microbatches, link, memory, weight_copies, planned, uniform,
                lower_bound(layers, planned.cut, microbatches, link), best[0][0], len(cuts))


def static_bytes(stage: LayerCost, weight_copies: float) -> float:
    """What a stage holds whatever the schedule: its weights and their copies."""
    return weight_copies * stage.param_bytes


def _fits_1f1b(layers: Sequence[LayerCost], ranks: int, microbatches: int,
               memory: Budget | None, weight_copies: float) -> StageScore | None:
    """Whether a stage can hold 1F1B's in-flight micro-batches within a byte budget (the
    dynamic program's filter; see the module NOTE), or None without a byte budget."""
    if memory is None or isinstance(memory, int):
        return None
    budget = float(memory)

    def fits(lo: int, hi: int, k: int) -> float | None:
        s = stage_cost(layers, lo, hi, k == 0)
        held = static_bytes(s, weight_copies) + min(ranks - k, microbatches) * s.memory_bytes
        return 0.0 if held <= budget else None

    return fits


def _within(score: StageScore, fits: StageScore | None) -> StageScore:
    if fits is None:
        return score

    def both(lo: int, hi: int, k: int) -> float | None:
        return None if fits(lo, hi, k) is None else score(lo, hi, k)

    return both


def _refine(layers: Sequence[LayerCost], cut: Cut, ranks: int, microbatches: int, link: Link,
            memory: Budget | None, weight_copies: float, max_v: int,
            splits: Sequence[str | None], comms: Sequence[str]) -> Choice | None:
    """Tune's fastest schedule for this split within the budget, or None."""
    stages = stages_of(layers, cut)
    costs = CostModel.from_settings(cost_settings(stages, link))
    count = memory if isinstance(memory, int) else None
    try:
        result = search(costs, ranks, [microbatches], memory_limit=count, max_v=max_v,
                        comms=comms, splits=splits)
    except UsageError:  # no schedule within the count
        return None
    if memory is None or count is not None:
        return Choice(cut, result.best, None)
    for cand in result.ranked:
        held = _rank_bytes(cand, stages, weight_copies)
        if max(held) <= float(memory):
            return Choice(cut, cand, held)
    return None


def _rank_bytes(cand: Candidate, stages: Sequence[LayerCost], weight_copies: float
                ) -> tuple[float, ...]:
    """Per rank: the simulated peak of saved activations plus the weights it holds (a chunk
    of an interleaved stage holds 1/v of its stage's)."""
    sim = simulate(cand.schedule, cand.costs, comm=cand.comm)
    config = cand.schedule.config
    held = [0.0] * config.ranks
    for virtual in range(config.stages):
        held[config.placement[virtual]] += static_bytes(stages[virtual // cand.v],
                                                        weight_copies) / cand.v
    peaks = sim.peak_bytes or (0.0,) * config.ranks
    return tuple(h + p for h, p in zip(held, peaks))


def _nothing_fits(layers: Sequence[LayerCost], ranks: int, microbatches: int,
                  memory: Budget | None, weight_copies: float) -> str:
    if isinstance(memory, int):
        return (f"no split and schedule fits --memory {memory} (micro-batches of activations "
                f"per rank; 1F1B needs {ranks})")
    least = min(static_bytes(x, weight_copies) + x.memory_bytes for x in layers)
    return (f"no split and schedule fits --memory {_size(float(memory or 0))} per rank "
            f"(the lightest piece alone needs {_size(least)} with one micro-batch in flight)"
            if memory is not None else "no schedule found")


def _size(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"
