"""A model written as a chain of named pieces, cut at any piece boundary: the built-in
`Splittable` (`pipeir.models.splittable`) behind `transformer@...` and `heavy-lm`.

A piece is one or more named modules run in order (`("blocks.3", Block)` or
`("norm", LayerNorm), ("head", Linear)`); its first name is the split point where a stage may
begin. A stage holds its pieces' modules under their original dotted names (`blocks.3.mlp.0.
weight`), so a checkpoint names the same parameter the same way under every cut.

NOTE (why each piece is seeded by its own index): `at(points)` must give stage s the unsplit
model's initial weights whatever the cut. The runtime seeds a stage by its stage number
(`build_stage`), which would make a block's weights depend on where the cut fell; reseeding
with `seed + piece index` before building each piece makes them depend on the piece alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from pipeir.diagnostics import UsageError
from pipeir.models.spec import ModelSpec
from pipeir.models.splittable import check_points, uniform_points

#: One module of a piece: its dotted name in the unsplit model and how to build it.
Part = tuple[str, Callable[[], nn.Module]]


class ChainStage(nn.Module):
    """Pieces' modules under their dotted names, run in order."""

    def __init__(self, parts: Sequence[tuple[str, nn.Module]]):
        super().__init__()
        self._order = [name for name, _ in parts]
        for name, module in parts:
            *path, leaf = name.split(".")
            parent: nn.Module = self
            for p in path:
                if not hasattr(parent, p):
                    parent.add_module(p, nn.ModuleDict())
                parent = getattr(parent, p)
            parent.add_module(leaf, module)

    def forward(self, x: Any) -> Any:
        for name in self._order:
            x = self.get_submodule(name)(x)
        return x


@dataclass(frozen=True)
class ChainModel:
    """A `Splittable` from pieces (see the module docstring); `train` holds the loss, data
    and training settings every cut shares (its `stage` is replaced by the cut's)."""

    pieces: Sequence[Sequence[Part]]
    train: ModelSpec
    piece_seed: int = field(default=0)

    def split_points(self) -> list[str]:
        return [piece[0][0] for piece in self.pieces[1:]]

    def at(self, points: Sequence[str]) -> ModelSpec:
        starts = [0, *(1 + i for i in check_points(self.split_points(), points))]
        bounds = [*starts, len(self.pieces)]

        def stage(s: int, stages: int) -> nn.Module:
            if stages != len(starts):
                raise UsageError(f"the model is cut at {len(points)} point(s) into "
                                 f"{len(starts)} stages, not {stages}")
            return self._stage(bounds[s], bounds[s + 1])

        return replace(self.train, stage=stage)

    def spec(self) -> ModelSpec:
        """The model cut by `uniform_points` for whatever number of stages runs it."""
        def stage(s: int, stages: int) -> nn.Module:
            return self.at(uniform_points(self.split_points(), stages)).stage(s, stages)

        return replace(self.train, stage=stage)

    def _stage(self, lo: int, hi: int) -> ChainStage:
        parts = []
        for k in range(lo, hi):
            torch.manual_seed(self.train.seed + self.piece_seed + 7919 * k + 17)
            parts += [(name, build()) for name, build in self.pieces[k]]
        return ChainStage(parts)
