"""Test models for the runtime (loaded by path: `tests/zoo.py:structured`).

`structured`: stages hand over a nested structure, (hidden, {"mask": bool, "skip": float that
carries a gradient, "raw": float that does not, "n": an int constant}), the next stage's two
positional arguments, on sequences whose length changes from step to step. Odd middle stages
have no parameters; even middle stages have a frozen Linear and a Linear the output does not
depend on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pipeir.models import ModelSpec

D = 6


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.skip = nn.Linear(D, D)

    def forward(self, x: dict[str, torch.Tensor]) -> Any:
        h = torch.tanh(self.lin(x["x"]))
        return h, {"mask": x["mask"], "skip": self.skip(x["x"]), "raw": x["x"], "n": 3}


class NoParams(nn.Module):
    def forward(self, h: torch.Tensor, aux: dict[str, Any]) -> Any:
        return torch.tanh(h) + 0.5 * aux["skip"], {**aux, "skip": aux["skip"] * 2}


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.frozen = nn.Linear(D, D).requires_grad_(False)
        self.unused = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, aux: dict[str, Any]) -> Any:
        h = torch.tanh(self.lin(h) + self.frozen(aux["skip"]))
        h = h.masked_fill(~aux["mask"][..., None], 0.0) + 0.1 * aux["raw"]
        return h, aux


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, aux: dict[str, Any]) -> torch.Tensor:
        out: torch.Tensor = self.lin(h + aux["skip"]) * aux["n"]
        return out


def _stage(s: int, n: int) -> nn.Module:
    if s == 0:
        return First()
    if s == n - 1:
        return Last()
    return NoParams() if s % 2 else Frozen()


def _batch(step: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(5 + step)
    t = 4 + 2 * (step % 2)
    x = torch.randn(8, t, D, generator=g)
    return {"x": x, "mask": torch.rand(8, t, generator=g) > 0.3}, torch.randn(8, t, D,
                                                                              generator=g)


def structured() -> ModelSpec:
    return ModelSpec(stage=_stage, loss=nn.functional.mse_loss, batch=_batch)


def structured_adam() -> ModelSpec:
    """`structured` with Adam, a step LR schedule and clipping (small max norm: it clips)."""
    return ModelSpec(stage=_stage, loss=nn.functional.mse_loss, batch=_batch,
                     optimizer=lambda ps: torch.optim.Adam(list(ps), lr=0.01),
                     scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5),
                     clip_grad_norm=0.05)


def mismatched() -> ModelSpec:
    """Stage 1 expects a tensor but stage 0 hands over a tuple."""
    def stage(s: int, n: int) -> nn.Module:
        return First() if s == 0 else nn.Linear(D, D)
    return ModelSpec(stage=stage, loss=nn.functional.mse_loss, batch=_batch)


def bad_tied() -> ModelSpec:
    return ModelSpec(stage=_stage, loss=nn.functional.mse_loss, batch=_batch,
                     tied=lambda n: [[(0, "lin.weight"), (n - 1, "lin.wieght")]])


def noisy() -> ModelSpec:
    """Dropout in every stage: pipelined training draws other random numbers."""
    def stage(s: int, n: int) -> nn.Module:
        return nn.Sequential(*([] if s else [_Pick()]), nn.Dropout(0.5), nn.Linear(D, D))
    return ModelSpec(stage=stage, loss=nn.functional.mse_loss, batch=_batch)


def nan_grads_when_pipelined() -> ModelSpec:
    """`noisy` without dropout whose input gradients turn NaN in a process group only: the
    loss stays finite and the pipelined run's gradients are NaN, which --check must fail."""
    def stage(s: int, n: int) -> nn.Module:
        return nn.Sequential(*([] if s else [_Pick()]), _NaNBackward(), nn.Linear(D, D))
    return ModelSpec(stage=stage, loss=nn.functional.mse_loss, batch=_batch)


class _NaNGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return g * float("nan") if dist.is_initialized() else g


class _NaNBackward(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _NaNGrad.apply(x)  # type: ignore[no-any-return]


class _Pick(nn.Module):
    def forward(self, x: dict[str, torch.Tensor]) -> torch.Tensor:
        return x["x"]


def _loud_mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return 4 * nn.functional.mse_loss(out.float(), target)


def structured_fp16() -> ModelSpec:
    """`structured` under fp16 autocast with a loss large enough that the first two steps'
    scaled gradients overflow fp16: the loss scale backs off and those steps are skipped."""
    return ModelSpec(stage=_stage, loss=_loud_mse, batch=_batch, autocast="fp16")


def _flat_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + step)
    return torch.randn(16, D, generator=g), torch.randn(16, D, generator=g)


def batchnorm() -> ModelSpec:
    """BatchNorm in every stage: running statistics are buffers the forward updates (once per
    micro-batch, also where recompute runs the forward twice)."""
    def stage(s: int, n: int) -> nn.Module:
        return nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh())
    return ModelSpec(stage=stage, loss=nn.functional.mse_loss, batch=_flat_batch)


def converted() -> ModelSpec:
    """Stages that convert themselves (`.to(...)`, `.double()`), which fake tensors cannot do:
    the shape plan builds them for real."""
    def stage(s: int, n: int) -> nn.Module:
        return nn.Sequential(nn.Linear(D, D).to("cpu").double(), nn.Tanh()).double()

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _flat_batch(step)
        return x.double(), y.double()
    return ModelSpec(stage=stage, loss=nn.functional.mse_loss, batch=batch)


def broken_stage() -> ModelSpec:
    """Stage 1 cannot be built."""
    def stage(s: int, n: int) -> nn.Module:
        if s == 1:
            raise ValueError("no such layer")
        return nn.Linear(D, D)
    return ModelSpec(stage=stage, loss=nn.functional.mse_loss, batch=_flat_batch)


def tied_twice() -> ModelSpec:
    """One parameter listed twice in its group: its gradient would be summed twice."""
    return ModelSpec(stage=lambda s, n: nn.Linear(D, D), loss=nn.functional.mse_loss,
                     batch=_flat_batch, tied=lambda n: [[(0, "weight"), (0, "weight")]])


def tied_overlapping() -> ModelSpec:
    """One parameter in two groups, which the runtime would reduce separately."""
    return ModelSpec(stage=lambda s, n: nn.Linear(D, D), loss=nn.functional.mse_loss,
                     batch=_flat_batch,
                     tied=lambda n: [[(0, "weight"), (1, "weight")], [(1, "weight"), (1, "bias")]])


def tied_none() -> ModelSpec:
    return ModelSpec(stage=lambda s, n: nn.Linear(D, D), loss=nn.functional.mse_loss,
                     batch=_flat_batch, tied=lambda n: None)  # type: ignore[arg-type,return-value]


def eighteen_samples() -> ModelSpec:
    """18 samples: over 2 replicas of 2 micro-batches each would be cut 5, 4."""
    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        return torch.randn(18, D, generator=g), torch.randn(18, D, generator=g)
    return ModelSpec(stage=lambda s, n: nn.Linear(D, D), loss=nn.functional.mse_loss,
                     batch=batch)


def two_lists() -> ModelSpec:
    """Variable-length micro-batches as a list of 2: one replica's worth, not two."""
    def batch(step: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        g = torch.Generator().manual_seed(step)
        return ([torch.randn(2, 3 + i, D, generator=g) for i in range(2)],
                [torch.randn(2, 3 + i, D, generator=g) for i in range(2)])
    return ModelSpec(stage=lambda s, n: nn.Linear(D, D), loss=nn.functional.mse_loss,
                     batch=batch)


class _Ema(nn.Module):
    """A buffer the forward replaces (`self.ema = ...`) rather than updates in place."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("ema", torch.zeros(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * h.detach().mean(0)
        return h


def reassigned_buffer() -> ModelSpec:
    return ModelSpec(stage=lambda s, n: _Ema(), loss=nn.functional.mse_loss, batch=_flat_batch)
