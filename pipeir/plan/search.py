"""Choose the cut points and the schedule together: the best few splits by the dynamic
program (`pipeir.plan.partition`), each refined by tune's search of schedules in the
simulator, under a memory budget; beside them the uniform split with tune's best.

NOTE (memory). A budget (`pipeir.memunit.MemoryLimit`) is either a count, the unit `check`
and tune count (`pipeir.memunit`: activations a rank may hold, one per stage, or chunk, and
micro-batch; 1F1B needs P; fractional where W keeps part of one), or bytes per rank: the
simulated peak of saved activations on the rank plus `weight_copies` times the parameter bytes
it holds (2: weights and gradients; an optimizer with state adds its copies, Adam 2 more).
The dynamic program already drops stages that cannot fit 1F1B's in-flight micro-batches
(min(P - k, M) on stage k); each schedule tune finds is then checked against the budget with
its own simulated peak, and the fastest that fits is kept.

NOTE (chunks). Tune interleaves by cutting each stage into v equal chunks, which a real
model's stages are not (a head is one piece). Here a rank's v chunks are real ranges of
pieces: splits into `ranks * v` chunks (the dynamic program's best by chunk work, and the
uniform split into that many) are simulated on interleaved 1F1B, and for v = 2 on the
V-shaped schedules, with each chunk's own costs. The uniform baseline is the uniform split
at the best v under the same budget: what a user gets from tune without planning.

NOTE (other shapes). Tune's schedules put P * v chunks on P ranks in a loop or a V. Where the
splits and placements of every kind are few enough to bound one by one (`refine.shapes`: a
few pieces on a few ranks, such as the built-in transformer's six on two or three), the ones
whose bound is below the planned step are given to synth from scratch, least bound first:
three chunks on two ranks, the embedding's and the head's on one, can beat every loop and V.

NOTE (rounding). Where the plan meets its bound, the step (the simulator's sums along the
schedule) and the bound (the closed form's sums per rank, or synth's over heads and tails) are
the same number added up in different orders, and the float bound can pass the step by an ulp
or two (7e-15 on 47 ms). The exact bound is no more than the exact step, so a bound within
`ROUNDING` above the step is reported as the step; anything further above is left as it is,
for the tests to catch as the bug it would be.

NOTE (refinement). With a time for it, synth then looks for a faster schedule on the chosen
split alone, and synth's bound for that split's shape sharpens the reported one
(`pipeir.plan.refine`); the uniform baseline keeps tune's best.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeir import library
from pipeir.diagnostics import PipeirError, UsageError
from pipeir.limits import plain_number
from pipeir.memunit import COUNTING, MemoryLimit
from pipeir.plan.layers import (
    Cut,
    LayerCost,
    Link,
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
    universal_bound,
    work_score,
)
from pipeir.plan.refine import Budget, fresh, shape_bound, shapes, static_bytes, synthesized
from pipeir.search.tune import (
    PRESPLIT,
    SPLITS,
    Candidate,
    evaluate,
    expect_list,
    search,
    variants,
)
from pipeir.sim import CostModel, simulate
from pipeir.sim.cost_settings import is_number
from pipeir.sim.engine import COMM_MODELS

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
    bound: float  # the planned split's lower bound: `partition.lower_bound`, sharpened by
    # `refine.shape_bound` (its placement, the memory budget)
    best_bound: float  # what no split and schedule beats (`partition.universal_bound`)
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
         max_v: int = 4, splits: Sequence[str | None] = SPLITS,
         comms: Sequence[str] = ("overlapped", "blocking"), synth_time: float = 0.0
         ) -> Plan:
    """Plan a pipeline of `ranks` ranks over `layers` (one micro-batch of `microbatches`):
    the `keep` best splits by stage work and by lower bound, and for v = 2, 4 .. `max_v`
    chunks per rank the `keep` best splits into `ranks * v` chunks, plus the uniform split
    at every v, each with its fastest schedule within `memory` (module NOTE). `splits` and
    `comms` narrow tune's split-backward modes and comm models (a model whose backward
    cannot be split: (None,)). With `synth_time` > 0, synth then looks that long for a
    faster schedule on the chosen split (`pipeir.plan.refine`)."""
    layers = tuple(layers)
    ranks, microbatches, keep, max_v = (_whole(name, v) for name, v in (
        ("ranks", ranks), ("microbatches", microbatches), ("keep", keep), ("max_v", max_v)))
    expect_list("plan", "splits", splits, SPLITS)
    expect_list("plan", "comms", comms, COMM_MODELS)
    _check(layers, ranks, microbatches, weight_copies)
    if keep < 1 or max_v < 1:
        raise UsageError(f"plan: keep and max_v must be at least 1, got keep={keep}, "
                         f"max_v={max_v}")
    if not isinstance(link, Link):
        raise TypeError(f"plan(link=...): expected a Link (pipeir.plan.Link(latency, "
                        f"bandwidth)), got {type(link).__name__}")
    if not is_number(synth_time) or synth_time < 0:
        raise UsageError(f"plan: synth_time must be a non-negative number of seconds, got "
                         f"{synth_time!r}")
    if memory is not None and not isinstance(memory, MemoryLimit):
        raise UsageError(f"plan(memory=...): a MemoryLimit (pipeir.memunit), e.g. "
                         f"MemoryLimit(40e9, in_bytes=True), got {memory!r}")
    n = len(layers)
    fits = _fits_1f1b(layers, ranks, microbatches, memory, weight_copies)
    cuts: dict[tuple[Cut, int], None] = {}
    for score in (work_score(layers), bound_score(layers, microbatches)):
        cuts.update(((c, 1), None) for _, c in best_splits(n, ranks, _within(score, fits),
                                                            keep))
    chunks = [v for v in (2**k for k in range(1, 7)) if v <= max_v and ranks * v <= n
              and ranks > 1]
    for v in chunks:
        cuts.update(((c, v), None) for _, c in best_splits(n, ranks * v, work_score(layers),
                                                            keep))
    uniform = [c for c in (_refine(layers, uniform_cut(n, ranks * v), ranks, microbatches, link,
                                   memory, weight_copies, v, splits, comms)
                           for v in [1, *chunks]) if c is not None]
    chosen = uniform + [c for c in (_refine(layers, cut, ranks, microbatches, link, memory,
                                            weight_copies, v, splits, comms)
                                    for cut, v in cuts) if c is not None]
    if not chosen:
        raise UsageError(_nothing_fits(layers, ranks, microbatches, memory, weight_copies))
    planned = min(chosen, key=_order)
    if synth_time > 0:
        planned = _resynthesized(layers, planned, link, memory, weight_copies, synth_time)
        planned = _other_shapes(layers, planned, ranks, microbatches, link, memory,
                                weight_copies, splits, comms, synth_time)
    config = planned.candidate.schedule.config
    bound = max(lower_bound(layers, planned.cut, microbatches, link,
                            [config.placement[s] for s in range(config.stages)]),
                shape_bound(layers, planned.cut, config, link, memory, weight_copies, splits,
                            comms))
    return Plan(layers, ranks, microbatches, link, memory, weight_copies, planned,
                min(uniform, key=_order) if uniform else None, _at_most(bound, planned.step),
                universal_bound(layers, ranks, microbatches), len(cuts) + 1 + len(chunks))


#: How far (relative) a bound's float sum may pass the step it bounds (module NOTE).
ROUNDING = 1e-12


def _at_most(bound: float, step: float) -> float:
    """`bound`, or `step` where the bound passes it by rounding alone (module NOTE)."""
    return step if step < bound <= step * (1 + ROUNDING) else bound


def _resynthesized(layers: Sequence[LayerCost], planned: Choice, link: Link,
                   memory: Budget | None, weight_copies: float, time_limit: float) -> Choice:
    """The planned choice with synth's schedule for its split, if that is faster and fits
    (a byte budget is checked again with the weights, as every choice is)."""
    found = synthesized(layers, planned.cut, planned.candidate, link, memory, weight_copies,
                        time_limit)
    if found is None:
        return planned
    if memory is None or memory.bytes is None:
        return Choice(planned.cut, found, None)
    held = _rank_bytes(found, stages_of(layers, planned.cut), weight_copies)
    return Choice(planned.cut, found, held) if max(held) <= memory.bytes else planned


#: The most splits and placements `_other_shapes` gives synth, and the most it bounds (each
#: a few tens of ms: the built-in transformer's 6 pieces make 32 on 2 ranks, 122 on 3).
OTHER_SHAPES, SHAPES = 2, 200


def _other_shapes(layers: Sequence[LayerCost], planned: Choice, ranks: int, microbatches: int,
                  link: Link, memory: Budget | None, weight_copies: float,
                  splits: Sequence[str | None], comms: Sequence[str], time_limit: float
                  ) -> Choice:
    """The planned choice, or a faster schedule synth finds from scratch on another split
    and placement (module NOTE): where all of them are few enough to bound
    (`refine.shapes`), the `OTHER_SHAPES` with the least bounds below the planned step, each
    given `time_limit` seconds."""
    found = shapes(layers, ranks, microbatches, link, memory, weight_copies, splits, comms,
                   SHAPES)
    if found is None:
        return planned
    mine = (planned.cut, planned.candidate.schedule.config.placement)
    others = [x for x in found if x.config.ranks == ranks and (x.cut, x.config.placement)
              != mine and x.bound < planned.step * (1 - 1e-9)][:OTHER_SHAPES]
    for shape in others:
        cand = fresh(layers, shape, link, memory, weight_copies, splits, comms, time_limit)
        if cand is None or cand.step_time >= planned.step * (1 - 1e-9):
            continue
        if memory is None or memory.bytes is None:
            planned = Choice(shape.cut, cand, None)
            continue
        held = _rank_bytes(cand, stages_of(layers, shape.cut), weight_copies)
        if max(held) <= memory.bytes:
            planned = Choice(shape.cut, cand, held)
    return planned


def _whole(name: str, value: object) -> int:
    """An integer argument (numpy's too), not a bool: `plan(L, True, 4)` once planned for
    one rank and reported that no schedule was found."""
    plain = plain_number(value)
    if type(plain) is not int:
        raise TypeError(f"plan: {name} must be an integer, got {type(value).__name__} "
                        f"{value!r}")
    return plain


def _check(layers: Sequence[LayerCost], ranks: int, microbatches: int,
           weight_copies: float) -> None:
    bad = next((x for x in layers if not isinstance(x, LayerCost)), None)
    if bad is not None:
        raise TypeError(f"plan: layers are LayerCost objects (pipeir.plan.LayerCost, or "
                        f"what profile measures), got {type(bad).__name__}")
    if not is_number(weight_copies):
        raise UsageError(f"--weight-copies {weight_copies!r}: must be a finite number")
    if ranks < 1:
        raise UsageError(f"--ranks {ranks}: need at least 1 rank")
    if ranks > len(layers):
        raise UsageError(f"--ranks {ranks}: the model has {len(layers)} pieces (its split "
                         f"points and its start), so at most {len(layers)} stages")
    if microbatches < 1:
        raise UsageError(f"--microbatches {microbatches}: need at least 1")
    if weight_copies < 0:
        raise UsageError(f"--weight-copies {weight_copies:g}: cannot be negative")


def _order(c: Choice) -> tuple[float, tuple[float, int, float, str]]:
    return (c.step, c.candidate.sort_key())


def _fits_1f1b(layers: Sequence[LayerCost], ranks: int, microbatches: int,
               memory: Budget | None, weight_copies: float) -> StageScore | None:
    """Whether a stage can hold 1F1B's in-flight micro-batches within a byte budget (the
    dynamic program's filter; see the module NOTE), or None without a byte budget."""
    if memory is None or memory.bytes is None:
        return None
    budget = memory.bytes

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
            memory: Budget | None, weight_copies: float, v: int,
            splits: Sequence[str | None], comms: Sequence[str]) -> Choice | None:
    """The fastest schedule for this split (`ranks * v` chunks) within the budget, or None:
    tune's search for one chunk per rank, the interleaved and V-shaped library schedules
    with these chunks' own costs for more."""
    stages = stages_of(layers, cut)
    costs = CostModel.from_settings(cost_settings(stages, link))
    count = None if memory is None else memory.count
    if v == 1:
        try:
            ranked = search(costs, ranks, [microbatches], memory_limit=count, max_v=1,
                            comms=comms, splits=splits).ranked
        except UsageError:  # no schedule within the count
            return None
    else:
        ranked = sorted((c for c in _chunked(costs, ranks, microbatches, v, splits, comms)
                         if c.fits(count)),
                        key=Candidate.sort_key)
    for cand in ranked:
        if memory is None or memory.bytes is None:
            return Choice(cut, cand, None)
        held = _rank_bytes(cand, stages, weight_copies)
        if max(held) <= memory.bytes:
            return Choice(cut, cand, held)
    return None


def _chunked(costs: CostModel, ranks: int, microbatches: int, v: int,
             splits: Sequence[str | None], comms: Sequence[str]) -> list[Candidate]:
    """Interleaved 1F1B with v chunks per rank (and for v = 2 the V-shaped schedules, which
    split their backwards, unless `splits` allows no split) under costs for each chunk."""
    out = []
    for family in ["interleaved-1f1b", *(PRESPLIT if v == 2 and any(splits) else ())]:
        try:
            base = library.get(family, ranks=ranks, microbatches=microbatches,
                               **({"v": v} if family == "interleaved-1f1b" else {}))
        except PipeirError:  # e.g. M not a multiple of the ranks
            continue
        out += [evaluate(base, costs, family, v, microbatches, split, comm)
                for split, comm in variants(family, splits, comms)]
    return out


def _rank_bytes(cand: Candidate, stages: Sequence[LayerCost], weight_copies: float
                ) -> tuple[float, ...]:
    """Per rank: the simulated peak of saved activations plus the weights of its chunks."""
    sim = simulate(cand.schedule, cand.costs, comm=cand.comm)
    config = cand.schedule.config
    held = [0.0] * config.ranks
    for k, stage in enumerate(stages):
        held[config.placement[k]] += static_bytes(stage, weight_copies)
    peaks = sim.peak_bytes or (0.0,) * config.ranks
    return tuple(h + p for h, p in zip(held, peaks))


def _nothing_fits(layers: Sequence[LayerCost], ranks: int, microbatches: int,
                  memory: Budget | None, weight_copies: float) -> str:
    if memory is None:
        return "no schedule found"
    if memory.bytes is None:
        return (f"no split and schedule fits --memory {memory} (activations per rank, "
                f"counting {COUNTING}; 1F1B needs {ranks})")
    least = min(static_bytes(x, weight_copies) + x.memory_bytes for x in layers)
    return (f"no split and schedule fits --memory {_size(memory.bytes)} per rank "
            f"(the lightest piece alone needs {_size(least)} with one micro-batch in flight)")


def _size(b: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:.3g} {unit}"
    return f"{b:.0f} B"
