"""The pass pipeline a user names, and THE data-parallel policy: how many replicas, and
where the gradient reductions go."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from pipeir.diagnostics import Diagnostic, UsageError
from pipeir.passes import LoweredPass, PassBase, Pipeline, parse_pipeline, registry
from pipeir.passes.context import costless_message
from pipeir.passes.dp_reduce import DpReduce
from pipeir.passes.overlap import Overlap
from pipeir.schedule import Schedule
from pipeir.sim import CostModel

#: The most processes: torch.distributed numbers ranks with 32-bit integers.
MAX_WORLD = 2**31 - 1

#: What the costless warning tells a command-line user to do (the API has its own remedy).
_CLI_COSTS_REMEDY = "give --costs FILE or a costs block"


@dataclass(frozen=True)
class Planned:
    """A pass pipeline ready to run, and what the user should hear about it."""

    pipeline: Pipeline
    warnings: tuple[Diagnostic, ...] = ()


PassesArg = str | Pipeline | Sequence[PassBase] | None


def plan_pipeline(passes: PassesArg, *, overlap: bool | None = None,
                  max_posted: int | None = None,
                  extra: Mapping[str, type[PassBase]] | None = None,
                  required: bool = False) -> Planned:
    """The pipeline `passes` names (a pipeline string, a `Pipeline`, passes, or none: a
    blank string is none unless `required`, when it is the parser's "empty pipeline"
    error). `overlap` is THE communication policy of what is lowered to run (`compile`,
    `run`, `pipeir.compile`): True (their default) appends the `overlap` pass unless the
    pipeline has it (with `max_posted` as its bound), False is blocking communication (a
    pipeline naming `overlap` contradicts it), None leaves the pipeline as given (`opt`).
    A pass also claimed by an installed plugin, which is ignored, is warned about: the user
    may believe the plugin runs (`extra` passes, loaded by the caller, are not).

    NOTE (why overlap by default): the simulator's default communication is overlapped, and
    measured against blocking programs (`bench/runtime.py`: 1F1B, interleaved and ZB-V, an
    MLP and a transformer, 2 and 4 ranks; docs/performance.md) the overlapped ones were
    faster in every row, often by a third."""
    if max_posted is not None and max_posted < 0:
        raise UsageError("--max-posted must be a non-negative integer")
    if overlap is False and max_posted is not None:
        raise UsageError("--max-posted bounds the receives the overlap pass posts ahead; with "
                         "blocking communication there are none")
    if passes is None or (isinstance(passes, str) and not passes.strip() and not required):
        pipeline = Pipeline.of(())
    elif isinstance(passes, str):
        pipeline = parse_pipeline(passes, extra)
    else:
        pipeline = passes if isinstance(passes, Pipeline) else Pipeline.of(passes)
    warnings = shadowed(p.name for p in pipeline.passes if p.name not in (extra or {}))
    has = next((i for i, p in enumerate(pipeline.passes) if isinstance(p, Overlap)), None)
    if overlap is False and has is not None:
        raise UsageError("blocking communication was asked for, but the pass pipeline "
                         "includes 'overlap'", pipeline.spans[has])
    if max_posted is not None and has is not None:
        raise UsageError(f"--max-posted {max_posted}: the pass pipeline's 'overlap' sets its "
                         "own bound (overlap{max_posted=K}); give one of the two",
                         pipeline.spans[has])
    if (overlap or max_posted is not None) and has is None:
        pipeline = pipeline.then(Overlap(max_posted=max_posted or 0))
    return Planned(pipeline, warnings)


def shadowed(names: Iterable[str]) -> tuple[Diagnostic, ...]:
    """A warning for each pass name also claimed by an installed plugin (which is ignored)."""
    plugins = registry.shadowed_plugins()
    return tuple(Diagnostic(registry.shadow_warning(n, plugins[n]), severity="warning")
                 for n in dict.fromkeys(names) if n in plugins)


def costless(passes: Iterable[PassBase], settings: Mapping[str, object],
             remedy: str = _CLI_COSTS_REMEDY) -> tuple[Diagnostic, ...]:
    """A warning for each pass that decides by cost when there are no cost settings at all:
    it then plans for the default unit costs, which is rarely what was meant."""
    if settings:
        return ()
    return tuple(Diagnostic(costless_message(n, remedy), severity="warning")
                 for n in dict.fromkeys(p.name for p in passes if p.costed))


def check_replicas(ranks: int, dp: int) -> None:
    """`dp` replicas of a `ranks`-rank pipeline: at least one replica, and ranks x dp
    processes that torch.distributed can number."""
    if dp < 1:
        raise UsageError(f"--dp {dp}: need at least 1 replica")
    if ranks * dp > MAX_WORLD:
        raise UsageError(f"--dp {dp}: {ranks} ranks x {dp:,} replicas is {ranks * dp:,} "
                         "processes; torch.distributed numbers them with 32-bit integers (at "
                         f"most {MAX_WORLD:,})")


@dataclass(frozen=True)
class Replicated:
    """The data-parallel policy's verdict: the replicas, the costs that know them, and the
    pipeline with the gradient reductions where they are needed."""

    dp: int
    costs: CostModel
    pipeline: Pipeline


def data_parallel(pipeline: Pipeline, schedule: Schedule, costs: CostModel,
                  dp: int | None = None) -> Replicated:
    """THE data-parallel policy. `dp` replicas (default: the costs' `dp`, so a `dp = 2` cost
    file never builds one replica without a word); with more than one, the pipeline gets the
    `dp-reduce` pass before its first lowered pass, unless it has one or the schedule places
    its own reductions (R ops)."""
    dp = costs.dp if dp is None else dp
    check_replicas(schedule.config.ranks, dp)
    if dp == 1:  # (costs that say dp = 2 keep saying it: one replica is what was asked)
        return Replicated(1, costs, pipeline)
    costs = replace(costs, dp=dp)
    if any(isinstance(p, DpReduce) for p in pipeline.passes) or any(
            op.kind == "R" for op in schedule):
        return Replicated(dp, costs, pipeline)
    n = next((i for i, p in enumerate(pipeline.passes) if isinstance(p, LoweredPass)),
             len(pipeline.passes))
    return Replicated(dp, costs, Pipeline((*pipeline.passes[:n], DpReduce(), *pipeline.passes[n:]),
                                          (*pipeline.spans[:n], None, *pipeline.spans[n:])))
