"""The chosen split's schedule, refined by synthesis, and the bound of every schedule on it.

Tune's library schedules are built for equal stages; on a planned split (unequal chunks, a
heavy head, a memory budget that binds on some ranks only) a schedule made for these very
costs can be faster, and the schedules' shared lower bound is sharper than the closed form
of `pipeir.plan.partition` once the ranks' capacity and memory are counted. Both come from
`pipeir.search.synth` on the split's own shape (its placement, its chunks, their costs).

NOTE (a byte budget per rank, in synth's one limit). Synth bounds every rank's live
activations by one limit; a rank's room for activations here is the budget less the
weights it holds (`static_bytes`), which differs from rank to rank. Dividing each stage's
activation size by its rank's room and giving synth the limit 1 is the same constraint on
every rank (all the stages of one rank share the divisor), so synth's schedules fit and its
bound holds under the real, uneven budgets. Step times do not change: only the sizes are
scaled.

NOTE (the bound). `shape_bound` is the least of synth's `Problem.lower_bound` over the
backward modes (B whole, or I then W) and comm models the plan searched: the longest chain
of dependencies, each rank's one-machine bound with heads and tails (Jackson's preemptive
schedule), and the idle its memory forces. Each holds for every schedule of that mode and
comm on this split and placement, so their least holds for every schedule the plan could
pick; the plan reports the larger of it and the closed form, both bounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pipeir.config import PipelineConfig
from pipeir.memunit import MemoryLimit, limit_for
from pipeir.plan.layers import Cut, LayerCost, Link, cost_settings, stages_of
from pipeir.plan.partition import chunkings, count_chunkings, lower_bound
from pipeir.schedule import Schedule
from pipeir.search.synth import synthesize
from pipeir.search.synth.problem import Problem
from pipeir.search.tune import Candidate, evaluate
from pipeir.sim import CostModel

#: A budget per rank: a count of activations (`pipeir.memunit`'s unit) or bytes, as
#: `pipeir.cli.common.activations_or_bytes` reads `--memory` (and tune's `--memory-limit`).
Budget = MemoryLimit


def static_bytes(stage: LayerCost, weight_copies: float) -> float:
    """What a stage holds whatever the schedule: its weights and their copies."""
    return weight_copies * stage.param_bytes


def shape_costs(layers: Sequence[LayerCost], cut: Cut, config: PipelineConfig, link: Link,
                memory: Budget | None, weight_copies: float
                ) -> tuple[CostModel, float | None] | None:
    """The split's costs for synth and the limit to give it (module NOTE): with a byte
    budget, each stage's activation size over its rank's room and the limit 1; with a count,
    the costs as they are and the count's limit; without a budget, no limit. None when a
    rank's weights alone leave no room for activations: no schedule fits."""
    stages = stages_of(layers, cut)
    settings: dict[str, Any] = cost_settings(stages, link)
    if memory is None:
        return CostModel.from_settings(settings), None
    if memory.bytes is None:
        return (CostModel.from_settings(settings),
                limit_for(memory.value, config.ranks, config.stages // config.ranks))
    room = [memory.bytes] * config.ranks
    for k, stage in enumerate(stages):
        room[config.placement[k]] -= static_bytes(stage, weight_copies)
    if min(room) <= 0:
        return None
    for k in range(len(stages)):
        # (input_bytes: what a checkpointed forward keeps; memory_w_bytes: what W keeps)
        for size in ("memory_bytes", "memory_w_bytes", "input_bytes"):
            if f"stage.{k}.{size}" in settings:
                settings[f"stage.{k}.{size}"] = (getattr(stages[k], size)
                                                 / room[config.placement[k]])
    for size in ("memory_bytes", "memory_w_bytes"):  # the defaults: stage 0's (cost_settings)
        if size in settings:
            settings[size] = settings[f"stage.0.{size}"]
    return CostModel.from_settings(settings), 1.0


def _problem(config: PipelineConfig, costs: CostModel, limit: float | None, split: bool,
             comm: str, memory: Budget | None) -> Problem:
    return Problem(config, costs, split, "blocking" if comm == "blocking" else "overlapped",
                   limit, memory_bytes=memory is not None and memory.in_bytes)


def shape_bound(layers: Sequence[LayerCost], cut: Cut, config: PipelineConfig, link: Link,
                memory: Budget | None, weight_copies: float, splits: Sequence[str | None],
                comms: Sequence[str]) -> float:
    """What no schedule of this split and placement beats under the budget, over the
    backward modes in `splits` (None: B whole; a mode: I then W) and `comms` (module NOTE);
    infinite when no schedule fits."""
    shaped = shape_costs(layers, cut, config, link, memory, weight_copies)
    if shaped is None:
        return math.inf
    costs, limit = shaped
    modes = sorted({s is not None for s in splits})
    problems = [_problem(config, costs, limit, split, comm, memory)
                for split in modes for comm in comms]
    # (one micro-batch's activations over a rank's room: no schedule fits)
    return min(math.inf if p.least_memory > p.budget else p.lower_bound() for p in problems)


@dataclass(frozen=True)
class Shape:
    """A split and placement with the bound every schedule of it has under the budget: the
    larger of the closed form (`partition.lower_bound`) and `shape_bound`."""

    bound: float
    cut: Cut
    config: PipelineConfig


def shapes(layers: Sequence[LayerCost], ranks: int, microbatches: int, link: Link,
           memory: Budget | None, weight_copies: float, splits: Sequence[str | None],
           comms: Sequence[str], limit: int = 2000) -> list[Shape] | None:
    """Every split and placement on up to `ranks` ranks (`partition.chunkings`) with its
    bound, least first; None when there are more than `limit`."""
    if count_chunkings(len(layers), ranks) > limit:
        return None
    out = []
    for cut, place in chunkings(len(layers), ranks):
        config = PipelineConfig.make(max(place) + 1, microbatches, stages=len(place),
                                     placement=place)
        out.append(Shape(max(lower_bound(layers, cut, microbatches, link, place),
                             shape_bound(layers, cut, config, link, memory, weight_copies,
                                         splits, comms)), cut, config))
    return sorted(out, key=lambda x: (x.bound, x.cut, x.config.placement))


def least_bound(layers: Sequence[LayerCost], ranks: int, microbatches: int, link: Link,
                memory: Budget | None, weight_copies: float, splits: Sequence[str | None],
                comms: Sequence[str], limit: int = 2000) -> float | None:
    """What no split and no schedule on `ranks` ranks beats under the budget: the least
    bound of every split and placement (`shapes`), each a bound for every schedule of its
    split and placement. None when there are more than `limit` to try."""
    found = shapes(layers, ranks, microbatches, link, memory, weight_copies, splits, comms,
                   limit)
    return None if found is None else found[0].bound


def fresh(layers: Sequence[LayerCost], shape: Shape, link: Link, memory: Budget | None,
          weight_copies: float, splits: Sequence[str | None], comms: Sequence[str],
          time_limit: float) -> Candidate | None:
    """The fastest schedule synth finds from scratch for a split and placement that no
    library schedule has (three chunks on two ranks, say), over the backward modes and comm
    models whose bound is below the shape's best found so far, `time_limit` seconds in all;
    None if none fits."""
    shaped = shape_costs(layers, shape.cut, shape.config, link, memory, weight_copies)
    if shaped is None:
        return None
    costs, limit = shaped
    real = CostModel.from_settings(cost_settings(stages_of(layers, shape.cut), link))
    problems = sorted(((_problem(shape.config, costs, limit, split, comm, memory), comm)
                       for split in sorted({s is not None for s in splits}) for comm in comms),
                      key=lambda pc: pc[0].lower_bound())
    problems = [(p, c) for p, c in problems if p.least_memory <= p.budget]
    best: Candidate | None = None
    chunks = max(len(shape.config.stages_of(r)) for r in range(shape.config.ranks))
    for problem, comm in problems:
        if best is not None and problem.lower_bound() >= best.step_time:
            break
        found = synthesize(problem, time_limit=time_limit / len(problems), seed=0)
        cand = evaluate(found.schedule, real, "synth", chunks, shape.config.microbatches, None,
                        comm)
        if best is None or cand.step_time < best.step_time:
            best = cand
    return best


def synthesized(layers: Sequence[LayerCost], cut: Cut, chosen: Candidate, link: Link,
                memory: Budget | None, weight_copies: float, time_limit: float
                ) -> Candidate | None:
    """A schedule synth finds for the chosen split, in the chosen schedule's shape, backward
    mode and comm model, within `time_limit` seconds (starting from the chosen schedule), if
    it is faster than the chosen one; None if not."""
    config = chosen.schedule.config
    shaped = shape_costs(layers, cut, config, link, memory, weight_copies)
    if shaped is None:
        return None
    costs, limit = shaped
    split = any(op.kind in ("I", "W") for op in chosen.schedule)
    problem = _problem(config, costs, limit, split, chosen.comm, memory)
    if not problem.fits(chosen.schedule):
        return None  # (the rounding slack of a byte budget: keep tune's choice)
    found = synthesize(problem, given=chosen.schedule, time_limit=time_limit, seed=0)
    if found.step >= chosen.step_time * (1 - 1e-9):
        return None
    return _candidate(found.schedule, chosen)


def _candidate(schedule: Schedule, chosen: Candidate) -> Candidate:
    """`schedule` as a candidate under the chosen one's (unscaled) costs."""
    return evaluate(schedule, chosen.costs, "synth", chosen.v, chosen.microbatches, None,
                    chosen.comm)


__all__ = ["Budget", "Shape", "fresh", "least_bound", "shape_bound", "shape_costs", "shapes",
           "static_bytes", "synthesized"]
