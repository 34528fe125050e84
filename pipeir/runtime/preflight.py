"""What `pipeirc run` checks before any process starts, so a bad model or checkpoint is one
clear message (a UsageError, exit 2) naming the stage and the parameter or tensor, with
nothing written: stage outputs the next stage cannot take, tied groups naming a missing
parameter, a checkpoint of another model or stage count, a save directory holding another
run's checkpoint."""

from __future__ import annotations

from pipeir.diagnostics import UsageError
from pipeir.models.spec import ModelSpec, check_spec
from pipeir.runtime import checkpoint
from pipeir.runtime.shapes import PlanError, ShapePlan
from pipeir.runtime.worker import split_batch


def preflight(spec: ModelSpec, model: str, stages: int, microbatches: int, steps: int, *,
              save: str | None = None, save_every: int = 0, resume: str | None = None) -> int:
    """Validate the model and the checkpoint flags; returns the step training starts at."""
    try:
        check_spec(spec, stages)
    except UsageError as e:
        raise UsageError(f"--model {model}: {e.message}") from None
    plan = ShapePlan(spec, stages)
    try:
        for x in split_batch(spec.batch(0), microbatches)[0]:
            plan.trace(x)
    except PlanError as e:
        raise UsageError(f"--model {model}: {e}") from None
    if save_every < 0:
        raise UsageError("--save-every must be at least 1")
    if save_every and save is None:
        raise UsageError("--save-every goes with --save DIR")
    start = 0
    if resume is not None:
        start = checkpoint.validate(resume, spec, stages)
        if start >= steps:
            raise UsageError(f"--resume {resume}: the checkpoint is at step {start}; "
                             f"--steps {steps} leaves nothing to train")
    if save is not None:
        checkpoint.check_target(save, resume)
    return start
