"""Models for tests/test_pipes.py, resolved by path in every rank."""

from __future__ import annotations

import os

import torch
from torch import nn

from pipeir.models import ModelSpec, resolve


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((1,), 0.9))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * self.w)


def _big_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 80_000, generator=g), torch.randn(8, 80_000, generator=g)


def big() -> ModelSpec:
    """Hand-offs of 1.28 MB per micro-batch (m = 2): more than a pipe holds (1 MB), so every
    transfer goes through gloo though the ranks have pipes."""
    return ModelSpec(stage=lambda s, n: Scale(), loss=lambda y, t: ((y - t) ** 2).mean(),
                     batch=_big_batch, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))


def probed() -> ModelSpec:
    """The built-in mlp at test size, whose stages, built in a rank after its channels are
    open, fail unless the rank has pipes exactly when `PIPEIR_P2P_PIPES` allows them (built
    by single-process training, they check nothing)."""
    import torch.distributed as dist

    from pipeir.runtime import dist as pdist

    base = resolve("pipeir.models.mlp:small")

    def stage(s: int, n: int) -> nn.Module:
        want = os.environ.get("PIPEIR_P2P_PIPES", "auto") != "off"
        if dist.is_initialized() and (pdist.pipes() is not None) != want:
            raise RuntimeError(f"pipes expected: {want}, rank has: {pdist.pipes()}")
        return base.stage(s, n)

    from dataclasses import replace

    return replace(base, stage=stage)
