"""The front door: read `.sched` files or text into schedules, and compile them."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from pipeir import limits
from pipeir.diagnostics import Source
from pipeir.frontend.elaborate import Elaborated, Value, elaborate
from pipeir.frontend.parser import parse_source
from pipeir.library import LIBRARY
from pipeir.passes import PassContext, PassManager, Pipeline, parse_pipeline
from pipeir.passes.context import UNIT_COSTS
from pipeir.schedule import Schedule

if TYPE_CHECKING:
    from pipeir.passes import Compiled, PassBase, Pipeline
    from pipeir.passes.context import CommModel
    from pipeir.sim.costs import CostModel


def read_source(path: str | os.PathLike[str]) -> Source:
    """Read a `.sched` file; unreadable or non-UTF-8 files are usage errors, not tracebacks."""
    return limits.read_input(path, ".sched file")


def _source(src: str | os.PathLike[str] | Source) -> Source:
    if isinstance(src, Source):  # text with the name its diagnostics give (a plan's schedule)
        return src
    if isinstance(src, os.PathLike):
        return read_source(src)
    if "\n" not in src and "{" not in src and (src.endswith(".sched") or os.path.exists(src)):
        return read_source(src)
    return Source("<string>", src)


def load(src: str | os.PathLike[str] | Source, *, overrides: Mapping[str, Value] | None = None,
         use: tuple[str, Mapping[str, Value]] | None = None) -> Elaborated:
    """Parse and elaborate a `.sched` file (a path) or text; keeps the file's cost settings."""
    return elaborate(parse_source(_source(src)), library=LIBRARY, overrides=overrides,
                     use=use)


def parse(src: str | os.PathLike[str], *, overrides: Mapping[str, Value] | None = None
          ) -> Schedule:
    """Read a schedule from a `.sched` file path or from `.sched` text.

    `overrides` replace pipeline settings or schedule parameters, like `--set` on the CLI.
    """
    return load(src, overrides=overrides).schedule


def compile(schedule: Schedule, passes: str | Pipeline | Sequence[PassBase] | None = None, *,
            costs: CostModel | None = None, comm: CommModel | None = None) -> Compiled:
    """Run `passes` (a pipeline string such as "split-backward,overlap"), lower and prove the
    programs deadlock-free. `costs` place communication and drive cost-aware passes; `comm`
    defaults to the model the pipeline runs under (overlapped with `overlap`, else blocking).
    """
    if passes is None or (isinstance(passes, str) and not passes.strip()):
        pipeline = Pipeline.of(())
    elif isinstance(passes, str):
        pipeline = parse_pipeline(passes)
    else:
        pipeline = passes if isinstance(passes, Pipeline) else Pipeline.of(passes)
    # UNIT_COSTS, the very object: PassManager warns that reorder and synth have no costs
    ctx = PassContext(costs if costs is not None else UNIT_COSTS,
                      comm if comm is not None else pipeline.comm)
    return PassManager(pipeline, context=ctx).compile(schedule)
