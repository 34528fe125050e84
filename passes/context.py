"""What a pass may know besides its options: the costs and the communication model.

Pass options are scalars written in a pipeline string; a cost file is not. Passes that decide
by cost (`reorder`, `synth`) read it from the context the caller hands to `PassManager`, the
way xDSL hands `ModulePass.apply(ctx, op)` a context: explicitly, never through a global, so
two pipelines with different costs can run side by side.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import Literal, get_args

import pipeir
from pipeir.diagnostics import UsageError
from pipeir.sim.chunks import rescale
from pipeir.sim.costs import CostModel, expect_costs

CommModel = Literal["overlapped", "blocking"]

#: The costs of a context no one gave costs to. `PassManager` tells it apart by identity
#: (not by value: a costs block may spell out the defaults on purpose) to warn about passes
#: that plan by cost.
UNIT_COSTS = CostModel()


@dataclass(frozen=True)
class PassContext:
    """The cost model and communication model passes plan against (default: unit costs,
    F = 1, B = 2, free and overlapped communication, under which every micro-batch costs the
    same and cost-driven passes have nothing to gain)."""

    costs: CostModel = UNIT_COSTS
    comm: CommModel = "overlapped"

    def __post_init__(self) -> None:
        expect_costs(self.costs, "PassContext(costs=...)")
        if self.comm not in get_args(CommModel):
            raise UsageError(f"PassContext(comm=...): expected one of "
                             f"{', '.join(get_args(CommModel))}, got {self.comm!r}")

    def for_stages(self, before: int, after: int) -> PassContext:
        """The context for what a pass made of `before` stages into `after` (`interleave`):
        the same model cut into `after // before` chunks per stage (`rescale`), so the passes
        after it plan with each chunk's share of its stage's costs. With a count that is not
        a multiple, per-stage costs no longer name the same layers and are dropped. Unit
        costs (none given) stay the unit costs."""
        if after == before or self.costs is UNIT_COSTS:
            return self
        if after % before == 0:
            return replace(self, costs=rescale(self.costs, before, after // before))
        return replace(self, costs=replace(self.costs, stage={}, stage_mb={}))


def printed_costs(context: PassContext, settings: Mapping[str, object], before: int,
                  after: int) -> dict[str, object]:
    """The costs block of a schedule of `after` stages that passes made from an input of
    `before` stages whose file set `settings`, planned under `context` (the pass manager's,
    cut into the new stages by `for_stages`): those settings while the stages are the
    input's, else the context's costs, so the file simulates as the passes after the change
    planned; without them each new chunk would cost a whole stage (57 for interleaved 1F1B
    at p = 4, m = 8, not 28.5)."""
    if after == before:
        return dict(settings)
    return dict(context.costs.settings())


#: The context of a pass run without one (`Interleave(v=2).run(s)`).
DEFAULT_CONTEXT: PassContext = PassContext()


def costless_message(name: str, remedy: str) -> str:
    """Why a pass that decides by cost (`PassBase.costed`) should not run with no costs: one
    wording for the CLI's stderr line and the Python API's warning, each with its `remedy`."""
    return (f"{name} plans by cost, and there are no costs ({remedy}): it plans for the "
            "defaults, F = 1, B = 2 and free links")


def callers_level() -> int:
    """The `stacklevel` of the first frame outside pipeir (its `pipeir/` and `passes/`
    folders), so a warning names the user's line, whichever API entry they called and
    however many of pipeir's frames lie between (3.11 has no `skip_file_prefixes`)."""
    ours = tuple(str(Path(f).parent) + os.sep for f in (pipeir.__file__, __file__))
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(ours):
        level, frame = level + 1, frame.f_back
    return level


def given(ctx: PassContext | None, name: str) -> PassContext:
    """The context a cost-driven pass plans against: `ctx`, or, when its `run` was called
    without one (`Reorder().run(s)`), the default with the same warning `PassManager` gives.
    NOTE: `PassManager` always hands its context over (and warned when it was built), so
    None means exactly "called directly, with no costs"."""
    if ctx is not None:
        return ctx
    warnings.warn(costless_message(name, "give run() a PassContext with costs, or "
                                         "pipeir.compile costs=..."),
                  stacklevel=callers_level())
    return DEFAULT_CONTEXT
