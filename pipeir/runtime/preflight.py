"""What `pipeirc run` checks before any rank starts, so a bad model or checkpoint is one
clear message (a UsageError, exit 2) naming the stage and the parameter or tensor, with
nothing written: stage outputs the next stage cannot take, tied groups naming a missing
parameter, a checkpoint of another model or stage count, a save directory holding another
run's checkpoint, `--device cuda` on a host without a CUDA device per rank.

The shape plan traced here (batch(0)'s micro-batch layouts) goes to the ranks with the job, so
they do not trace it again. `pipeirc run` calls `check_model` in a process forked from the
ranks' fork server where there is one (`pipeir.runtime.forked`), so that its own process need
not import torch."""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

from pipeir import limits
from pipeir.diagnostics import UsageError
from pipeir.models.refs import resolve
from pipeir.models.spec import ModelSpec, check_spec
from pipeir.runtime import checkpoint
from pipeir.runtime.dist import device_kind
from pipeir.runtime.job import Start
from pipeir.runtime.mesh import shard
from pipeir.runtime.milestones import mark
from pipeir.runtime.shapes import PlanError, ShapePlan
from pipeir.runtime.worker import split_batch
from pipeir.usercode import contained, stdout_to_stderr


def check_model(model: str, stages: int, microbatches: int, steps: int, **flags: Any
                ) -> Start:
    """`preflight` of the model `model` names (a bad name is a UsageError here); picklable
    arguments only, for `pipeir.runtime.forked`."""
    mark("preflight: started")
    start = preflight(resolve(model), model, stages, microbatches, steps, **flags)
    mark("preflight: done")
    return start


def preflight(spec: ModelSpec, model: str, stages: int, microbatches: int, steps: int, *,
              save: str | None = None, save_every: int = 0, resume: str | None = None,
              placement: Sequence[int] | None = None, dp: int = 1,
              keep: int | None = None) -> Start:
    """Validate the model and the checkpoint flags; returns where training starts (and the
    shape plan of batch(0), which the ranks then need not trace again). With
    `placement` (stage -> rank; the processes run on this machine, `dp` copies of each), check
    that their weights, gradients and optimizer state fit its memory (pipeir.limits)."""
    try:
        check_spec(spec, stages)
    except UsageError as e:
        raise UsageError(f"--model {model}: {e.message}") from None
    with contained(f"--model {model}", "calling batch(0)"):
        batch = spec.batch(0)
    if not (isinstance(batch, tuple | list) and len(batch) == 2):
        raise UsageError(f"--model {model}: batch(step) must return a pair (inputs, targets), "
                         f"got {type(batch).__name__}" + (
                             f" of {len(batch)}" if isinstance(batch, tuple | list) else ""))
    try:  # replica 0's share, as its ranks will cut it (`mesh.shard`)
        first = split_batch(shard(batch, dp, 0, microbatches), microbatches)
    except ValueError as e:
        raise UsageError(f"--model {model}: {e}") from None
    except Exception as e:  # not (inputs, targets): a tuple of the wrong length, None ...
        raise UsageError(f"--model {model}: batch(0) gave a value pipeir cannot split into "
                         f"micro-batches: {type(e).__name__}: {e}") from None
    plan = ShapePlan(spec, stages)
    try:
        with stdout_to_stderr():  # the stages run here: their output is not the report's
            for x in first[0]:
                plan.trace(x)
            plan.trace_real(first[0])
    except PlanError as e:
        raise UsageError(f"--model {model}: {e}") from None
    if placement is not None:
        try:  # where the ranks will run (`PIPEIR_DEVICE=cuda` without the devices: refused)
            kind, _ = device_kind((max(placement) + 1) * dp)
        except ValueError as e:
            raise UsageError(str(e)) from None
        per_rank, counts = [0] * (max(placement) + 1), [0] * (max(placement) + 1)
        for stage, nbytes in enumerate(plan.state_bytes()):
            per_rank[placement[stage]] += nbytes
            counts[placement[stage]] += 1
        limits.check_training(per_rank, counts, dp, on_host=kind == "cpu")
    if save_every < 0:
        raise UsageError("--save-every must be 0 (save after the last step only) or more")
    if save_every and save is None:
        raise UsageError("--save-every goes with --save DIR")
    if keep is not None and keep < 0:
        raise UsageError("--keep must be at least 0 (0 keeps every checkpoint)")
    if keep is not None and save is None:
        raise UsageError("--keep goes with --save DIR")
    layouts = pickle.dumps(plan.layouts)
    start = Start(0, None, layouts)
    if resume is not None:
        source, step = checkpoint.validate(resume, spec, stages)
        start = Start(step, source, layouts)
        if start.step >= steps:
            raise UsageError(f"--resume {resume}: the checkpoint is at step {start.step}; "
                             f"--steps {steps} leaves nothing to train")
    if save is not None:
        checkpoint.check_target(save, resume)
        checkpoint.check_space(save, spec, stages)
    return start
