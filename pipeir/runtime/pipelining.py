"""pipeir inside torch.distributed.pipelining: `torch_schedule(stages, "zb-v", ...)` returns
a torch schedule object that runs a verified pipeir schedule, so a training script that builds
`PipelineStage`s and calls `schedule.step(...)` adopts pipeir by changing one line.

The schedule goes through torch's own `_PipelineScheduleRuntime` CSV path: pipeir writes the
`compute_comms` CSV (every SEND/RECV placed as torch's lowering places them, which pipeir
proves deadlock-free) and torch loads and executes it, action by action. The stages' wiring
(skip connections, argument counts, tied copies) is checked when the schedule is built
(`pipeir.runtime.wiring`), on every rank alike.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

from pipeir import library
from pipeir.api import parse
from pipeir.diagnostics import UsageError
from pipeir.interop.writer import dumps_csv
from pipeir.runtime import wiring
from pipeir.schedule import Schedule, expect_schedule


def torch_schedule(stages: PipelineStage | Sequence[PipelineStage],
                   schedule: str | os.PathLike[str] | Schedule, *, n_microbatches: int,
                   loss_fn: Callable[..., Any] | None = None, **kwargs: Any
                   ) -> _PipelineScheduleRuntime:
    """A torch schedule (call `.step(...)` as with any) running `schedule` on this rank's
    `stages`: a library name ("1f1b", "interleaved-1f1b", "zb-v", ...), a `.sched` path, or a
    `Schedule`. Names and files are instantiated for the stages' pipeline group size, their
    stage count and `n_microbatches`; the schedule is verified and must place exactly these
    stages on this rank. Other keyword arguments go to torch's schedule (e.g.
    `scale_grads`). Collective: every rank of the pipeline group calls it (the stages'
    wiring is gathered and checked here, see `pipeir.runtime.wiring`); the copies of a tied
    weight (stages of `pipeir.split`) get their summed gradient at the end of each
    `step()`."""
    mine = [stages] if isinstance(stages, PipelineStage) else list(stages)
    if not mine:
        raise UsageError("torch_schedule: no stages given")
    # (a module, as pipeir.split gives, failed on torch's missing attributes; torch's
    # pipeline() makes stages of a private class: anything with a stage index is a stage)
    for x in mine:
        if isinstance(x, nn.Module) or not hasattr(x, "stage_index"):
            raise UsageError(f"torch_schedule: expected torch's PipelineStage objects, got "
                             f"{type(x).__name__}: wrap each of this rank's chunks as "
                             f"PipelineStage(chunk, stage_index, num_stages, device)")
    ranks, rank, total = mine[0].group_size, mine[0].group_rank, mine[0].num_stages
    sched = _instantiate(schedule, ranks, n_microbatches, total)
    c = sched.config
    for what, ours, theirs in (("ranks", c.ranks, ranks), ("stages", c.stages, total),
                               ("microbatches", c.microbatches, n_microbatches)):
        if ours != theirs:
            raise UsageError(f"torch_schedule: schedule '{sched.name}' has {what} = {ours}, "
                             f"the pipeline {theirs}")
    want = sorted(c.stages_of(rank))
    have = sorted(s.stage_index for s in mine)
    if want != have:
        raise UsageError(f"torch_schedule: schedule '{sched.name}' places stages {want} on "
                         f"rank {rank}, which holds stages {have}")
    text = dumps_csv(sched, "compute_comms")  # verifies
    group = mine[0].group
    wirings = wiring.gather(mine, rank, group)
    wiring.check(wirings)
    runtime = _Runtime(mine, n_microbatches, loss_fn=loss_fn, **kwargs)  # type: ignore[no-untyped-call]
    runtime.tied, runtime.tied_group = wiring.tied_copies(wirings, mine), group
    fd, path = tempfile.mkstemp(suffix=".csv", prefix="pipeir-")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
        runtime._load_csv(path, format="compute_comms")
    finally:
        os.unlink(path)
    return runtime


class _Runtime(_PipelineScheduleRuntime):  # type: ignore[misc]
    """torch's runtime, then the tied copies' gradients summed (`wiring.TiedCopies`)."""

    tied: list[wiring.TiedCopies]
    tied_group: Any

    def step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().step(*args, **kwargs)
        for copies in self.tied:
            copies.sync(self.tied_group)
        return out


def _instantiate(schedule: str | os.PathLike[str] | Schedule, ranks: int, microbatches: int,
                 stages: int) -> Schedule:
    if isinstance(schedule, Schedule):
        return schedule
    if not isinstance(schedule, str | os.PathLike):
        expect_schedule(schedule, "torch_schedule")  # (a name, a path or a Schedule)
    if str(schedule).endswith(".csv"):
        raise UsageError(f"torch_schedule: '{schedule}' is a torch schedule CSV; read it with "
                         f"pipeir.interop.load_csv(path) and give its .schedule")
    if isinstance(schedule, str) and library.find(schedule) is not None:
        kw: dict[str, int] = {"stages": stages}
        if "v" in library.params(schedule):
            kw["v"] = stages // ranks
        return library.get(schedule, ranks, microbatches, **kw)
    if not Path(schedule).is_file():
        raise UsageError(f"torch_schedule: '{schedule}' is neither a library schedule nor a "
                         f".sched file; the library has {', '.join(library.names())}",
                         notes=library.suggest(str(schedule)))
    return parse(Path(schedule), overrides={"ranks": ranks, "microbatches": microbatches})
