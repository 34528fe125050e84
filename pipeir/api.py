"""The front door: read `.sched` files or text into schedules, and compile them."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pipeir import driver
from pipeir.diagnostics import Source, UsageError
from pipeir.driver import read_source
from pipeir.frontend.elaborate import Elaborated, Value
from pipeir.schedule import Schedule, expect_schedule
from pipeir.sim.costs import expect_costs
from pipeir.sim.engine import COMM_MODELS

if TYPE_CHECKING:
    from pipeir.passes import Compiled, PassBase, Pipeline
    from pipeir.passes.context import CommModel
    from pipeir.sim.costs import CostModel
    from pipeir.sim.result import SimResult

__all__ = ["compile", "load", "parse", "read_source", "simulate"]


def load(src: str | os.PathLike[str] | Source, *, overrides: Mapping[str, Value] | None = None,
         use: tuple[str, Mapping[str, Value]] | None = None) -> Elaborated:
    """Parse and elaborate a `.sched` file (a path) or text; keeps the file's cost settings."""
    return driver.load_source(src, overrides=overrides, use=use)


def parse(src: str | os.PathLike[str], *, overrides: Mapping[str, Value] | None = None
          ) -> Schedule:
    """Read a schedule from a `.sched` file path or from `.sched` text.

    `overrides` replace pipeline settings or schedule parameters, like `--set` on the CLI.
    """
    return load(src, overrides=overrides).schedule


def compile(schedule: Schedule | Elaborated,
            passes: str | Pipeline | Sequence[PassBase] | None = None, *,
            costs: CostModel | None = None, comm: CommModel | None = None,
            dp: int | None = None, overlap: bool = True) -> Compiled:
    """Run `passes` (a pipeline string such as "split-backward"), lower and prove the
    programs deadlock-free. `costs` place communication and drive cost-aware passes (given
    what `pipeir.load` returns, its file's costs block is the default, as on the command
    line); `comm` defaults to the model the pipeline runs under (overlapped with `overlap`,
    else blocking).

    Communication is asynchronous by default: the `overlap` pass is appended unless `passes`
    has it (`overlap=False`: blocking sends and receives, as `--blocking` on the command line).

    `dp` data-parallel replicas of the pipeline (default: the costs' `dp`, else 1): with more
    than one, a schedule without its own gradient reductions gets the `dp-reduce` pass, as
    `pipeirc compile --dp D` does (both go through `pipeir.driver`).
    """
    target = expect_schedule(schedule.schedule if isinstance(schedule, Elaborated) else schedule,
                             "pipeir.compile")
    expect_costs(costs, "pipeir.compile(costs=...)")
    if comm is not None and comm not in COMM_MODELS:
        raise UsageError(f"pipeir.compile(comm=...): expected one of {', '.join(COMM_MODELS)}, "
                         f"got {comm!r}")
    if type(overlap) is not bool:
        raise TypeError(f"pipeir.compile(overlap=...): expected True or False, got {overlap!r}")
    if comm == "overlapped" and not overlap:
        raise UsageError("pipeir.compile(comm='overlapped') plans for asynchronous "
                         "communication, but overlap=False lowers to blocking programs: give "
                         "comm='blocking', or leave comm out")
    if comm == "blocking" and overlap:
        raise UsageError("pipeir.compile(comm='blocking') plans for blocking communication, "
                         "but overlap=True lowers to asynchronous programs: give overlap=False "
                         "for blocking programs")
    if dp is not None and (type(dp) is not int or dp < 1):
        raise UsageError(f"pipeir.compile(dp=...): expected a whole number of data-parallel "
                         f"replicas, at least 1, got {dp!r}")
    planned = driver.plan_pipeline(passes, overlap=overlap)
    for d in planned.warnings:
        warnings.warn(d.message, stacklevel=2)
    chosen = driver.costs_for(schedule, costs)
    _warn_unused(target, chosen)
    build = driver.compile_schedule(target, planned.pipeline, chosen, dp=dp, comm=comm)
    return build.compiled


def simulate(schedule: Schedule, costs: CostModel | None = None,
             comm: str = "overlapped") -> SimResult:
    """`pipeir.sim.simulate` (its docstring says what it computes) of a schedule verified
    first, as `pipeirc simulate` does: timing a schedule that lacks ops, or holds ops of
    micro-batches it does not have, would report the bubble of some other work. Raises
    VerifyError (or warns, as the command line does, of costs for stages or micro-batches
    the pipeline does not have: they change nothing, and are usually a typo)."""
    expect_schedule(schedule, "simulate")
    result = driver.simulate_verified(schedule, expect_costs(costs, "simulate(costs=...)"), comm)
    if costs is not None:
        _warn_unused(schedule, costs)
    return result


def _warn_unused(schedule: Schedule, costs: CostModel) -> None:
    for d in driver.unused_costs(schedule.config, costs):
        warnings.warn(d.message, stacklevel=3)
