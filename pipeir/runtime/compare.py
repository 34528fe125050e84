"""`pipeirc run --check`: train the same model single-process on the same data and compare,
per stage, the parameters after the last step and that step's gradients."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeir.models.spec import ModelSpec, structure
from pipeir.runtime.launch import RunError, RunResult
from pipeir.runtime.reference import train_reference
from pipeir.runtime.worker import Job

#: Default tolerances of --check: full precision, and under autocast (bf16 keeps 8 bits of
#: mantissa: the two runs round a few values differently and that spreads over the steps;
#: measured 5e-3 after 10 steps of examples/gpt.py).
RTOL, RTOL_AUTOCAST = 1e-5, 2e-2


#: A tensor's difference is relative to its largest value, but to no less than this share of
#: the largest of its stage's tensors of the same kind: rounding scales with the terms summed,
#: not with the result. A Linear's bias before a BatchNorm has a gradient of zero in exact
#: arithmetic; data-parallel replicas sum the micro-batches in another order than one process
#: and leave noise there of about 5e-8 of the stage's largest gradient, "100 %" of it. A
#: wrong gradient is wrong by its own size, far above this.
FLOOR = 0.1


def rel_diff(got: Any, want: Any, floor: float = 0.0) -> float:
    """max |got - want| / max(max |want|, floor) over one tensor (0 for an all-zero pair);
    infinite where either side holds a NaN or an infinity: NaN compares false with
    everything, so a NaN difference used to be skipped and a run with NaN gradients passed
    --check."""
    a, b = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    scale = max(float(np.abs(b).max()) if b.size else 0.0, floor)
    err = float(np.abs(a - b).max()) if b.size else 0.0
    return err / scale if scale > 0 else err


def differences(spec: ModelSpec, job: Job, result: RunResult, index: int = 0
                ) -> list[tuple[int, float, float, str]]:
    """Per stage: (stage, largest parameter difference, largest gradient difference, the
    worst tensor's name). A tensor present on one side only counts as infinitely different.

    NOTE: with data-parallel replicas, buffers (BatchNorm's running statistics) are left
    out: each replica updates its own from its own micro-batches, as DDP without
    SyncBatchNorm does, while the reference sees every replica's."""
    low = job.lowered
    want, want_grads = train_reference(spec, low.stages, low.microbatches, low.accumulate,
                                       job.steps, job.dp)
    buffers = ({s: {k for k, _ in m.named_buffers()}
                for s, m in structure(spec, low.stages, range(low.stages)).items()}
               if job.dp > 1 else {})
    rows = []
    for s in range(low.stages):
        worst: list[tuple[float, str]] = []
        for mine, ref in ((result.params[index][s], want[s]),
                          (result.grads[index][s], want_grads[s])):
            d, name = 0.0, ""
            keys = sorted((set(mine) | set(ref)) - buffers.get(s, set()))
            values = {k: ref[k].double().numpy() for k in keys if k in ref}
            top = max((float(np.abs(v).max()) for v in values.values() if v.size), default=0.0)
            for k in keys:
                x = (rel_diff(mine[k], values[k], FLOOR * top) if k in mine and k in ref
                     else float("inf"))
                if x > d:
                    d, name = x, k
            worst.append((d, name))
        (p, pname), (g, gname) = worst
        rows.append((s, p, g, pname if p >= g else gname))
    return rows


def check(spec: ModelSpec, job: Job, result: RunResult, tolerance: float | None) -> None:
    """Print the comparison; raise RunError (exit 1) when a stage is beyond tolerance."""
    tol = tolerance if tolerance is not None else (RTOL if spec.autocast is None
                                                   else RTOL_AUTOCAST)
    rows = differences(spec, job, result)
    print(f"\ncheck: single-process training of the same model and data, {job.steps} "
          "step(s); largest relative difference per stage (max |a-b| / max |b| per tensor)")
    print(f"{'stage':>6} {'parameters':>11} {'gradients':>11}")
    for s, p, g, _ in rows:
        print(f"{s:>6} {p:>11.2e} {g:>11.2e}")
    bad = [r for r in rows if max(r[1], r[2]) > tol]
    if bad:
        s, p, g, name = max(bad, key=lambda r: max(r[1], r[2]))
        by = f"{max(p, g):.2e}" if max(p, g) < float("inf") else \
            "inf (a NaN or an infinity, or a tensor on one side only)"
        raise RunError(f"--check: stage {s} differs from single-process training by {by} in "
                       f"'{name}' ({'parameter' if p >= g else 'gradient'}; tolerance {tol:.0e})")
    print(f"all stages within {tol:.0e} of single-process training")
