"""Built-in `mlp`: residual tanh blocks regressing a fixed random map; the demo model that
needs no user code. Width 64, 8 blocks spread over the stages, SGD with momentum."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pipeir.models.spec import ModelSpec

WIDTH = 64
BLOCKS = 8
BATCH = 64


class Block(nn.Module):
    """x + tanh(Wx + b): the residual keeps gradients alive through many stages."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def _stage(s: int, stages: int) -> nn.Module:
    return nn.Sequential(*(Block() for _ in range(max(1, BLOCKS // stages))))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234 + step % 4)  # a few batches, seen repeatedly
    x = torch.randn(BATCH, WIDTH, generator=g)
    target_map = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7))
    return x, torch.tanh(x @ target_map / WIDTH**0.5)


def _optimizer(params: Iterable[Any]) -> torch.optim.Optimizer:
    return torch.optim.SGD(list(params), lr=0.1, momentum=0.9)


def spec() -> ModelSpec:
    return ModelSpec(stage=_stage, loss=nn.functional.mse_loss, batch=_batch,
                     optimizer=_optimizer)
