"""Helpers shared by the tests that train for real (test_runtime, test_memory,
test_synth_runtime, test_zero_bubble): a compiled job of a model and its check against
single-process training (pipeir's reference)."""

from __future__ import annotations

from pathlib import Path

import torch

import pipeir
from pipeir.backend.codegen import rank_source
from pipeir.models import resolve
from pipeir.runtime.compare import RTOL, RTOL_AUTOCAST, differences
from pipeir.runtime.launch import RunResult
from pipeir.runtime.reference import train_reference
from pipeir.runtime.worker import Job
from pipeir.schedule import Schedule

EXAMPLES = Path(__file__).parent.parent / "examples"
TIMEOUT = 60.0
MLP = "pipeir.models.mlp:small"  # the built-in mlp at test size


def runtime_job(schedule: Schedule, passes: str | None, steps: int, model: str = MLP,
                **options: object) -> Job:
    # blocking unless the passes name overlap: each test chooses the communication it covers
    # (the default, overlapped, is what `passes` with "overlap" lowers to)
    low = pipeir.compile(schedule, passes, overlap="overlap" in (passes or "")).lowered
    return Job(low, tuple(rank_source(low, r) for r in range(low.ranks)), model, steps,
               collect=True, **options)  # type: ignore[arg-type]


def assert_matches_reference(jobs: list[Job], result: RunResult) -> None:
    """Parameters after the last step and gradients of the last step allclose (rtol 1e-5) to
    single-process training. Gradients are compared too because one SGD step changes large
    weights too little for a wrong gradient to show in the parameters alone. And `--check`'s
    own judgement passes each of these correct runs (it must not false-alarm on any model or
    schedule the tests train)."""
    for j, job in enumerate(jobs):
        low = job.lowered
        spec = resolve(job.model)
        # bf16: equal to single-process training under the same autocast, within a couple of
        # bf16 roundings (measured: 2e-7 after 3 steps of the tiny gpt)
        rtol = 1e-5 if spec.autocast is None else 1e-2
        want, want_grads = train_reference(spec, low.stages, low.microbatches,
                                           low.accumulate, job.steps)
        what = (f"job {j} {low.name} overlap={low.overlap} accumulate={low.accumulate} "
                f"{job.model.rpartition('/')[2]}")
        assert sorted(result.params[j]) == list(range(low.stages)), f"{what}: stages missing"
        for s in range(low.stages):
            for mine, ref, kind in ((result.params[j][s], want[s], "parameter"),
                                    (result.grads[j][s], want_grads[s], "gradient")):
                assert sorted(mine) == sorted(ref), f"{what}: stage {s} {kind}s differ"
                for k, r in ref.items():
                    got = torch.from_numpy(mine[k])
                    r = r.to(got.dtype)
                    # atol: rtol of the tensor's largest value (sums in another order, e.g.
                    # of a tied weight's two gradients, differ by rounding, which is large
                    # relative to the elements near zero)
                    scale = float(r.abs().max()) if r.numel() and r.is_floating_point() else 0
                    torch.testing.assert_close(
                        got, r, rtol=rtol, atol=max(1e-8, rtol * scale),
                        msg=lambda m, w=f"{what}: stage {s} {kind} {k}": f"{w}: {m}")
        tol = RTOL if spec.autocast is None else RTOL_AUTOCAST
        rows = differences(spec, job, result, j)
        assert max(max(p, g) for _, p, g, _ in rows) <= tol, f"{what}: --check says {rows}"


def lib(name: str, p: int, m: int, **kw: int) -> Schedule:
    return pipeir.library.get(name, p, m, **kw)
