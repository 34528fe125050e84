"""Shape plans: the shape and dtype of every tensor that crosses a stage boundary, known before
any transfer so receivers allocate buffers without a per-transfer handshake.

The plan is traced once per distinct micro-batch input shape, on the meta device (no memory,
no compute), so micro-batches of different sizes each get their own entry.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeir.models.spec import ModelSpec

Shape = tuple[tuple[int, ...], torch.dtype]


class ShapePlan:
    """`act(stage, mb)`: the output shape of `stage` for micro-batch `mb` (which is also the
    shape of the gradient sent back into that stage)."""

    def __init__(self, spec: ModelSpec, stages: int):
        self.spec = spec
        self.stages = stages
        self._meta: list[torch.nn.Module] | None = None
        self._by_input: dict[tuple[tuple[int, ...], torch.dtype], list[Shape]] = {}
        self._mb: list[list[Shape]] = []

    def _modules(self) -> list[torch.nn.Module]:
        if self._meta is None:
            with torch.device("meta"):
                self._meta = [self.spec.stage(s, self.stages) for s in range(self.stages)]
        return self._meta

    def plan(self, inputs: Sequence[torch.Tensor]) -> None:
        """Trace (or look up) the shapes for this step's micro-batch inputs."""
        self._mb = [self._trace(x) for x in inputs]

    def _trace(self, x: torch.Tensor) -> list[Shape]:
        key = (tuple(x.shape), x.dtype)
        found = self._by_input.get(key)
        if found is None:
            found = []
            h = torch.empty(x.shape, dtype=x.dtype, device="meta")
            with torch.no_grad():
                for mod in self._modules():
                    h = mod(h)
                    found.append((tuple(h.shape), h.dtype))
            self._by_input[key] = found
        return found

    def act(self, stage: int, mb: int) -> Shape:
        return self._mb[mb][stage]
