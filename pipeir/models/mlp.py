"""Built-in `mlp`: residual tanh blocks regressing a fixed random map; the demo model that
needs no user code. Width 512, 8 blocks spread over the stages, batches of 256, SGD with
momentum: large enough that compute, not per-instruction overhead, fills most of a step on a
CPU. `small` (width 64, batches of 64) is the same model for quick tests
(`--model pipeir.models.mlp:small`)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from pipeir.models.spec import ModelSpec

WIDTH = 512
BLOCKS = 8
BATCH = 256


class Block(nn.Module):
    """x + tanh(Wx + b): the residual keeps gradients alive through many stages."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def _stage(width: int, s: int, stages: int) -> nn.Module:
    return nn.Sequential(*(Block(width) for _ in range(max(1, BLOCKS // stages))))


def _batch(width: int, batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + step % 4)  # a few batches, seen repeatedly
    x = torch.randn(batch, width, generator=g)
    target_map = torch.randn(width, width, generator=torch.Generator().manual_seed(7))
    return x, torch.tanh(x @ target_map / width**0.5)


def _optimizer(params: Iterable[Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=0.1, momentum=0.9)


def spec(width: int = WIDTH, batch: int = BATCH) -> ModelSpec:
    return ModelSpec(stage=partial(_stage, width), loss=nn.functional.mse_loss,
                     batch=partial(_batch, width, batch), optimizer=_optimizer)


def small() -> ModelSpec:
    """Width 64, batches of 64: the model of the runtime tests."""
    return spec(64, 64)
