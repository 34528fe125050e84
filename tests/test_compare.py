"""`--check`'s judgement (pipeir.runtime.compare) on results made in-process: a run that sums
in another order passes (the noise floor), a wrong loss scale, a missing clip and an untied
weight fail. The real pipelined runs it passes are in test_byom and test_runtime."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from byom_helpers import MODELS, byom_job

import pipeir
from pipeir.models import ModelSpec, resolve
from pipeir.runtime.compare import check, differences
from pipeir.runtime.launch import RunError, RunResult
from pipeir.runtime.reference import train_reference

STEPS = 2


def _as_result(spec: ModelSpec, stages: int, reverse: bool = False) -> RunResult:
    """What a run of `spec` on 4 micro-batches would report, trained single-process."""
    params, grads = train_reference(spec, stages, 4, 1, STEPS, reverse=reverse)

    def numpy(d: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, Any]]:
        return {s: {k: v.numpy() for k, v in t.items()} for s, t in d.items()}

    return RunResult(params={0: numpy(params)}, grads={0: numpy(grads)})


def _scaled(spec: ModelSpec) -> ModelSpec:
    return replace(spec, loss=lambda out, target: 2 * spec.loss(out, target))


@pytest.mark.parametrize(("model", "wrong", "what"), [
    ("seq", _scaled, "a wrong loss scale"),
    ("tied", lambda s: replace(s, clip_grad_norm=None), "a missing clip"),
    ("tied", lambda s: replace(s, tied=None), "an untied weight"),
])
def test_check_fails_wrong_training_and_passes_another_summation_order(
        model: str, wrong: Any, what: str, capsys: pytest.CaptureFixture[str]) -> None:
    spec = resolve(f"{MODELS}:{model}")
    job = byom_job(pipeir.library.get("1f1b", 2, 4), model, STEPS)
    check(spec, job, _as_result(spec, 2, reverse=True), None)  # passes: no exception
    assert "all stages within 1e-05" in capsys.readouterr().out
    with pytest.raises(RunError, match=r"--check: stage [01] differs from single-process "
                                       r"training by"):
        check(spec, job, _as_result(wrong(spec), 2), None)
    worst = max(max(p, g) for _, p, g, _ in differences(spec, job,
                                                           _as_result(wrong(spec), 2)))
    assert worst > 1e-2, what  # wrong by the tensor's own size, not by rounding
