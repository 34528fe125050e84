"""The model interface: what a user gives `pipeirc run --model`.

A model spec is a function (no arguments) returning a `ModelSpec`:

    import torch
    from torch import nn
    from pipeir.models import ModelSpec

    def my_model() -> ModelSpec:
        def stage(s: int, stages: int) -> nn.Module:      # stage s of `stages`
            return nn.Sequential(nn.Linear(16, 16), nn.Tanh())

        def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
            g = torch.Generator().manual_seed(step)       # same data on every rank
            return torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g)

        return ModelSpec(stage=stage, loss=nn.functional.mse_loss, batch=batch)

Run it with `pipeirc run FILE --model my_file.py:my_model` (or `my_package.module:my_model`).

NOTE (why every rank can build its stages alone): stage s is built right after
`torch.manual_seed(seed + s)`, so its initial weights do not depend on which rank builds it
nor on which other stages that rank owns; single-process reference training builds the same
weights. Every rank calls `batch(step)` and must get the same batch (seed it by step), which is
what lets pipeir split it into micro-batches and know every shape without a handshake.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeir._importing import import_file
from pipeir.diagnostics import UsageError

if TYPE_CHECKING:
    import torch

#: Built-in model names -> "module:function".
BUILTINS: dict[str, str] = {
    "mlp": "pipeir.models.mlp:spec",
    "transformer": "pipeir.models.transformer:spec",
}


def _sgd(params: Iterable[Any]) -> Any:
    import torch

    return torch.optim.SGD(list(params), lr=0.05)


@dataclass(frozen=True)
class ModelSpec:
    """A model split into pipeline stages, its loss and its data.

    `stage(s, stages)` builds stage s as an nn.Module (it maps the previous stage's output to
    its own); `loss(output, target)` is the mean loss of one micro-batch; `batch(step)` returns
    (inputs, targets) whose first dimension is split into micro-batches (uneven splits are
    allowed: micro-batches then differ in size). `optimizer(params)` defaults to SGD(lr=0.05).
    """

    stage: Callable[[int, int], torch.nn.Module]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    optimizer: Callable[[Iterable[Any]], Any] = _sgd
    seed: int = 0


def build_stage(spec: ModelSpec, s: int, stages: int) -> torch.nn.Module:
    """Stage s with its deterministic initial weights (see the module NOTE)."""
    import torch

    torch.manual_seed(spec.seed + 1000 * s + 17)
    return spec.stage(s, stages)


def resolve(ref: str) -> ModelSpec:
    """`mlp`, `transformer`, `package.module:function` or `path/to/file.py[:function]`
    (function defaults to `spec`) -> the ModelSpec it returns. Bad references are UsageErrors."""
    target = BUILTINS.get(ref, ref)
    where, sep, fn = target.rpartition(":")
    if not sep:
        where, fn = target, "spec"
    if where.endswith(".py") or "/" in where:
        module = _load_file(ref, Path(where))
    elif not where or not where.replace(".", "").replace("_", "").isalnum():
        raise UsageError(f"--model '{ref}': expected mlp, transformer, module:function or "
                         "file.py[:function]")
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise UsageError(f"--model '{ref}': cannot import {where}: {e}",
                             notes=()) from None
    factory = getattr(module, fn, None)
    if not callable(factory):
        raise UsageError(f"--model '{ref}': {where} has no function '{fn}'")
    try:
        spec = factory()
    except Exception as e:
        raise UsageError(f"--model '{ref}': {fn}() raised {type(e).__name__}: {e}") from None
    if not isinstance(spec, ModelSpec):
        raise UsageError(f"--model '{ref}': {fn}() returned {type(spec).__name__}, "
                         "expected a pipeir.models.ModelSpec")
    return spec


def _load_file(ref: str, path: Path) -> Any:
    return import_file(path, "pipeir_model", f"--model '{ref}'")
