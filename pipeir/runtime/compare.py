"""`pipeirc run --check`: train the same model single-process on the same data and compare,
per stage, the parameters after the last step and that step's gradients."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeir.models.spec import ModelSpec, structure
from pipeir.runtime.job import Job
from pipeir.runtime.launch import RunError, RunResult
from pipeir.runtime.reference import train_reference

#: Default tolerances of --check: full precision, and under autocast (bf16 keeps 8 bits of
#: mantissa: the two runs round a few values differently and that spreads over the steps;
#: measured 5e-3 after 10 steps of examples/gpt.py).
RTOL, RTOL_AUTOCAST = 1e-5, 2e-2


#: NOTE (the noise floor): a pipelined run sums the same terms as single-process training in
#: another order (micro-batches, a tied weight's copies, data-parallel replicas), and the
#: rounding that leaves is noise any correct run may show. A fixed share of the largest value
#: cannot bound it: a gradient that is zero in exact arithmetic (a Linear's bias before a
#: BatchNorm, the key slice of GPT-2's fused qkv bias) is all noise, and AdamW turns that
#: noise into steps of the learning rate. So --check measures it: the reference trains a
#: second time with every step's micro-batches in reverse order, and a tensor may differ from
#: the reference by `NOISE` times what the two references differ by before the difference
#: counts. A wrong loss scale, a missing clip or an untied weight is wrong by the tensor's
#: own size, far above both.
NOISE = 8.0


def rel_diff(got: Any, want: Any, noise: Any = None) -> float:
    """(max |got - want| - NOISE * max |noise - want|) / max |want| over one tensor's finite
    values, never below 0 (0 for an all-zero pair; `noise` is the reverse-order reference's
    tensor, None: no noise allowance); infinite where the two sides' NaNs and infinities are
    not the same values in the same places. A NaN compares false with everything, so a NaN
    difference used to be skipped and a run with NaN gradients passed --check; but an fp16
    step whose scaled gradients overflow is infinite in single-process training too (the
    loss scale backs off and skips it), and identical infinities are agreement."""
    a, b = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    c = b if noise is None else np.asarray(noise, dtype=np.float64)
    finite = np.isfinite(b)
    if a.shape != b.shape or not np.array_equal(np.isfinite(a), finite) \
            or not np.array_equal(a[~finite], b[~finite], equal_nan=True):
        return float("inf")
    if c.shape != b.shape or not np.array_equal(np.isfinite(c), finite):
        c = b  # the other order overflowed elsewhere: no noise allowance
    a, b, c = a[finite], b[finite], c[finite]
    if not b.size:
        return 0.0
    scale = float(np.abs(b).max())
    err = max(0.0, float(np.abs(a - b).max()) - NOISE * float(np.abs(c - b).max()))
    return err / scale if scale > 0 else err


def differences(spec: ModelSpec, job: Job, result: RunResult, index: int = 0
                ) -> list[tuple[int, float, float, str]]:
    """Per stage: (stage, largest parameter difference, largest gradient difference, the
    worst tensor's name), each beyond the noise floor (see NOTE). A tensor present on one
    side only counts as infinitely different.

    NOTE: with data-parallel replicas, buffers (BatchNorm's running statistics) are left
    out: each replica updates its own from its own micro-batches, as DDP without
    SyncBatchNorm does, while the reference sees every replica's."""
    low = job.lowered
    runs = [train_reference(spec, low.stages, low.microbatches, low.accumulate, job.steps,
                            job.dp, reverse=r) for r in (False, True)]
    (want, want_grads), (other, other_grads) = runs
    buffers = ({s: {k for k, _ in m.named_buffers()}
                for s, m in structure(spec, low.stages, range(low.stages)).items()}
               if job.dp > 1 else {})
    rows = []
    for s in range(low.stages):
        worst: list[tuple[float, str]] = []
        for mine, ref, alt in ((result.params[index][s], want[s], other[s]),
                               (result.grads[index][s], want_grads[s], other_grads[s])):
            d, name = 0.0, ""
            for k in sorted((set(mine) | set(ref)) - buffers.get(s, set())):
                x = (rel_diff(mine[k], ref[k].double().numpy(),
                              alt[k].double().numpy() if k in alt else None)
                     if k in mine and k in ref else float("inf"))
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
          "step(s); largest relative difference per stage beyond the rounding noise of "
          f"another summation order ((max |a-b| - {NOISE:g} x noise) / max |b| per tensor)")
    print(f"{'stage':>6} {'parameters':>11} {'gradients':>11}")
    for s, p, g, _ in rows:
        print(f"{s:>6} {p:>11.2e} {g:>11.2e}")
    bad = [r for r in rows if max(r[1], r[2]) > tol]
    if bad:
        s, p, g, name = max(bad, key=lambda r: max(r[1], r[2]))
        by = (f"{max(p, g):.2e}" if max(p, g) < float("inf") else
              "inf (a NaN or an infinity single-process training does not have, or a tensor on "
              "one side only)")
        raise RunError(f"--check: stage {s} differs from single-process training by {by} in "
                       f"'{name}' ({'parameter' if p >= g else 'gradient'}; tolerance {tol:.0e})")
    print(f"all stages within {tol:.0e} of single-process training")
