"""The costs a search starts from (tune, synth): a cost file's settings, the ranks it
describes or is given, and the checks that stop a search before it starts."""

from __future__ import annotations

from dataclasses import dataclass

from pipeir.diagnostics import Diagnostic, UsageError
from pipeir.driver.load import Settings, infer_ranks
from pipeir.sim import CostModel


@dataclass(frozen=True)
class SearchCosts:
    """A cost file read for a search: its settings, the cost model, the ranks searched
    (given, or read off the highest stage with its own costs; None when neither tells)."""

    settings: Settings
    costs: CostModel
    ranks: int | None
    warnings: tuple[Diagnostic, ...] = ()


def search_costs(path: str, settings: Settings, ranks: int | None) -> SearchCosts:
    """The costs and ranks tune and synth search with, from the settings read from `path`
    (`read_cost_file`; the caller may add `lengths`). Inferred ranks resting on a few
    far-apart stages stop here; given ranks beyond the file's stages are warned about."""
    costs = CostModel.from_settings(settings)
    known = infer_ranks(costs)
    warnings: tuple[Diagnostic, ...] = ()
    if ranks is None and known is not None:
        check_inferred(path, costs, known)
    elif ranks is not None and known is not None and ranks > known:
        warnings = (Diagnostic(
            f"{path} describes {known} stages (stage.{known - 1}.* is the last set) but "
            f"--ranks is {ranks}: stages {known} to {ranks - 1} take the file's defaults",
            severity="warning"),)
    return SearchCosts(settings, costs, ranks if ranks is not None else known, warnings)


def check_inferred(where: str, costs: CostModel, ranks: int) -> None:
    """Stop before the search when the number of ranks, read off the highest stage with its
    own costs, rests on a few far-apart stages: `[stage.99]` for `[stage.9]` would otherwise
    search 100 ranks for minutes without a word."""
    named = sorted({*costs.stage, *(s for s, _ in costs.stage_mb)})
    if ranks > 2 * len(named) + 2:
        shown = ", ".join(map(str, named[:6])) + (", ..." if len(named) > 6 else "")
        raise UsageError(f"{where}: per-stage costs for stages {shown} only, yet the highest, "
                         f"stage.{ranks - 1}, would make the search cover {ranks} ranks; a typo? "
                         "give --ranks P to search P ranks")


def check_mb_costs(costs: CostModel, microbatches: int) -> None:
    """Per-micro-batch costs (`[mb.K]`) for more micro-batches than searched: a UsageError
    (tune and synth; simulate, with a schedule of its own, warns). Ignored, they made every
    micro-batch look unequal, and tune put `reorder` on every candidate."""
    if costs.mb or costs.stage_mb:
        given = max([*costs.mb, *(m for _, m in costs.stage_mb)]) + 1
        if given > microbatches:
            raise UsageError(f"the costs give per-micro-batch times for {given} micro-batches "
                             f"but --microbatches is {microbatches}")
