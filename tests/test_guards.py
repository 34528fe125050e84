"""Run-time guards (issue 11): a non-finite loss stops the run naming the step and the
micro-batch (or warns with --allow-nonfinite), and ranks that get different batch(step) stop
with a clear message instead of training on mismatched data."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pipeir.runtime.guards import batch_digest

REPO = Path(__file__).parent.parent
Cli = Callable[..., tuple[int, str, str]]

MODELS = '''
import pytest
import torch
from pipeir.models import ModelSpec
from pipeir.models.mlp import small as mlp

def nan_at_step_2():
    base = mlp()
    def batch(step):
        x, y = base.batch(step)
        if step == 2:
            x = x.clone()
            x[40] = float("nan")  # sample 40 of 64: micro-batch 1 of 2
        return x, y
    return ModelSpec(stage=base.stage, loss=base.loss, batch=batch)

def unseeded():
    base = mlp()
    def batch(step):
        x = torch.randn(64, 64)  # the global generator: each rank's differs
        return x, torch.tanh(x)
    return ModelSpec(stage=base.stage, loss=base.loss, batch=batch)
'''


def _run(cli: Cli, tmp_path: Path, model: str, *extra: str) -> tuple[int, str, str]:
    f = tmp_path / "models.py"
    f.write_text(MODELS)
    return cli("run", REPO / "examples/1f1b.sched", "--set", "ranks=2", "--set",
               "microbatches=2", "--model", f"{f}:{model}", "--steps", "4", "--timeout", "20",
               *extra)


@pytest.mark.mp
def test_a_nan_loss_stops_the_run_naming_step_and_microbatch(cli: Cli, tmp_path: Path) -> None:
    code, out, err = _run(cli, tmp_path, "nan_at_step_2")
    assert code == 1 and "Traceback" not in err
    assert "NonFiniteLoss: the loss is nan at step 3 (batch(2)), micro-batch 1" in err
    assert "`loss stage=1 mb=1" in err and "--allow-nonfinite" in err
    assert "step    2/4" in out and "step    3/4" not in out


@pytest.mark.mp
def test_allow_nonfinite_only_warns(tmp_path: Path) -> None:
    f = tmp_path / "models.py"
    f.write_text(MODELS)
    r = subprocess.run([sys.executable, "-m", "pipeir", "run", "examples/1f1b.sched", "--set",
                        "ranks=2", "--set", "microbatches=2", "--model", f"{f}:nan_at_step_2",
                        "--steps", "4", "--timeout", "20", "--allow-nonfinite"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "step    4/4" in r.stdout, r.stderr
    assert "warning: the loss is nan at step 3 (batch(2)), micro-batch 1" in r.stderr  # a rank's


@pytest.mark.mp
def test_ranks_with_different_batches_stop(cli: Cli, tmp_path: Path) -> None:
    code, out, err = _run(cli, tmp_path, "unseeded")
    assert code == 1 and "Traceback" not in err
    assert "BatchMismatch: batch(0) is not the same on every rank (ranks that agree: 0 | 1)" \
        in err
    assert "step    1/4" not in out


def test_batch_digest() -> None:
    x = torch.arange(12.0).reshape(3, 4)
    assert batch_digest((x, [x, {"a": x}])) == batch_digest((x.clone(), [x, {"a": x}]))
    y = x.clone()
    y[2, 3] = 0.5
    assert batch_digest(x) != batch_digest(y)
    assert batch_digest(x) != batch_digest(x.reshape(4, 3))  # same bytes, other shape
    assert batch_digest(x) != batch_digest(x.double())
    half = torch.tensor([1.0, 2.5], dtype=torch.bfloat16)  # no numpy dtype: digested too
    assert batch_digest(half) == batch_digest(half.clone())
    assert batch_digest(half) != batch_digest(half.float())
    assert batch_digest(half) != batch_digest(torch.tensor([1.0, 3.0], dtype=torch.bfloat16))
