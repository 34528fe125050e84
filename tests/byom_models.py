"""Unsplit `nn.Module`s for `ModuleSpec` (loaded by path: `tests/byom_models.py:seq`).

`Tied` is a tiny language model whose head shares the embedding's Parameter (recognised from
the module, no `tied`) and whose blocks hand over (hidden, scale): two tensors, the second
without a gradient, so a traced stage returns a tuple the next stage takes as arguments.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from pipeir.models import ModuleSpec

D, V = 8, 16


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 + step)
    return torch.randn(8, D, generator=g), torch.randn(8, 2, generator=g)


def _seq() -> nn.Module:
    return nn.Sequential(nn.Linear(D, D), nn.Tanh(),
                         nn.Sequential(*(nn.Linear(D, D) for _ in range(4))), nn.Linear(D, 2))


def seq() -> ModuleSpec:
    """Split by pruning (no example): an nn.Sequential whose layer list is nested."""
    return ModuleSpec(module=_seq, batch=_batch, loss=nn.functional.mse_loss,
                      points=["2.2"])


def seq_uniform() -> ModuleSpec:
    """No points: the layer list cut evenly for the schedule's stage count."""
    return ModuleSpec(module=_seq, batch=_batch, loss=nn.functional.mse_loss)


def seq_bad_point() -> ModuleSpec:
    return ModuleSpec(module=_seq, batch=_batch, loss=nn.functional.mse_loss,
                      points=["2.9"])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return h + torch.tanh(self.lin(h)) * scale


class Tied(nn.Module):
    def __init__(self, skip: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(4))
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.embed.weight  # one Parameter: tied
        self.skip = skip

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        first = h
        scale = (ids[..., None] % 3).float() / 3  # no gradient
        for layer in self.layers:
            h = layer(h, scale)
        if self.skip:  # stage 0's embedding read after the last block: a skip connection
            h = h + first
        out: torch.Tensor = self.head(self.norm(h))
        return out


def _tokens(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11 + step)
    t = torch.randint(0, V, (8, 7), generator=g)
    return t[:, :-1], t[:, 1:]


def _ce(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(list(params), lr=0.01)


def tied() -> ModuleSpec:
    """Traced (example: one micro-batch of the 4 the tests run), tied, Adam, clipping."""
    return ModuleSpec(module=Tied, batch=_tokens, loss=_ce, example=_tokens(0)[0][:2],
                      points=["layers.2"], optimizer=_adam, clip_grad_norm=0.5)


def tied4() -> ModuleSpec:
    """`tied` in four stages (interleaved on two ranks)."""
    return ModuleSpec(module=Tied, batch=_tokens, loss=_ce, example=_tokens(0)[0][:2],
                      points=["layers.1", "layers.2", "layers.3"], optimizer=_adam,
                      clip_grad_norm=0.5)


def skip() -> ModuleSpec:
    return ModuleSpec(module=lambda: Tied(skip=True), batch=_tokens, loss=_ce,
                      example=_tokens(0)[0][:2], points=["layers.2"])


class MaskWhenPadded(nn.Module):
    """Hands over `(h, mask)` where the micro-batch has padding and `(h, None)` where it has
    none, as Hugging Face's causal mask does: the structure depends on the data. Like
    Hugging Face's, it keeps the mask when it cannot look at the values (fake tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(D, D), nn.Linear(D, D))

    def forward(self, x: torch.Tensor) -> Any:
        pad = x[:, 0] > 1.5
        keep = isinstance(pad, FakeTensor) or bool(pad.any())
        return self.layers[0](x), (pad if keep else None)


class TakesMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 2)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        out: torch.Tensor = self.lin(h if mask is None else h * (~mask)[:, None])
        return out


def data_dependent() -> Any:
    from pipeir.models import ModelSpec

    def stage(s: int, n: int) -> nn.Module:
        return MaskWhenPadded() if s == 0 else TakesMask()

    return ModelSpec(stage=stage, batch=_batch, loss=nn.functional.mse_loss)
