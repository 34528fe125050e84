"""Per-piece costs and what a contiguous run of pieces costs as one stage.

A piece is what lies between two neighbouring split points of a `Splittable`; `pipeirc plan`
profiles each one as a stage of its own (`at(all points)`, `pipeir.runtime.profile`), so a
`LayerCost` holds exactly a profiled stage's figures, for one micro-batch.

NOTE (how pieces add up to a stage). Times and sizes of the pieces in a stage add, with two
exceptions. (1) The first stage has no input gradient: its I is 0 and its W is its whole
backward, so on stage 0 every piece's I + W counts as W. (2) What crosses a boundary
(`activation_bytes`) is the last piece's output, and what a checkpointed forward keeps
(`input_bytes`) the first piece's input. (3) What W keeps after I (`memory_w_bytes`, the
Zero Bubble paper's M_W) adds over the pieces of any later stage, a piece without the figure
keeping all it saved; on the first stage, whose I computes nothing, W keeps everything.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LayerCost:
    """One piece's costs for one micro-batch: times in the costs' unit (ms when profiled),
    sizes in bytes. `name` is the split point where the piece begins ("" for the first)."""

    name: str
    F: float
    B: float
    I: float  # noqa: E741 - the paper's name for the op
    W: float
    activation_bytes: float = 0.0  # its output, handed to the next piece
    memory_bytes: float = 0.0  # what autograd keeps from its F until its backward
    param_bytes: float = 0.0
    input_bytes: float = 0.0
    # of memory_bytes, what W still needs after I (None: not measured, all of it)
    memory_w_bytes: float | None = None

    @property
    def work(self) -> float:
        """Its compute for one micro-batch: a forward and a whole backward."""
        return self.F + self.B


@dataclass(frozen=True, slots=True)
class Link:
    """The link between ranks: `latency` per transfer, `bandwidth` bytes per time unit
    (None: unlimited)."""

    latency: float = 0.0
    bandwidth: float | None = None

    def transfer(self, nbytes: float) -> float:
        return self.latency + (nbytes / self.bandwidth if self.bandwidth else 0.0)


#: A split: the index of the first piece of each stage after the first, increasing.
Cut = tuple[int, ...]


def bounds(cut: Cut, pieces: int) -> list[tuple[int, int]]:
    """Each stage's pieces as a half-open range [lo, hi)."""
    edges = [0, *cut, pieces]
    return list(itertools.pairwise(edges))


def stage_cost(layers: Sequence[LayerCost], lo: int, hi: int, first: bool) -> LayerCost:
    """Pieces [lo, hi) as one stage (see the module NOTE); `first`: it is stage 0."""
    run = layers[lo:hi]
    i = 0.0 if first else sum(x.I for x in run)
    w = sum(x.I + x.W for x in run) if first else sum(x.W for x in run)
    return LayerCost(name=run[0].name, F=sum(x.F for x in run), B=sum(x.B for x in run), I=i,
                     W=w, activation_bytes=run[-1].activation_bytes,
                     memory_bytes=sum(x.memory_bytes for x in run),
                     param_bytes=sum(x.param_bytes for x in run),
                     input_bytes=run[0].input_bytes, memory_w_bytes=_kept_for_w(run, first))


def _kept_for_w(run: Sequence[LayerCost], first: bool) -> float | None:
    """The stage's `memory_w_bytes` (the module NOTE's (3)); None when no piece gives it."""
    if all(x.memory_w_bytes is None for x in run):
        return None
    if first:
        return sum(x.memory_bytes for x in run)
    return sum(x.memory_bytes if x.memory_w_bytes is None else x.memory_w_bytes for x in run)


def stages_of(layers: Sequence[LayerCost], cut: Cut) -> list[LayerCost]:
    """The stages a split makes."""
    return [stage_cost(layers, lo, hi, k == 0)
            for k, (lo, hi) in enumerate(bounds(cut, len(layers)))]


def cost_settings(stages: Sequence[LayerCost], link: Link, unit: str | None = "ms"
                  ) -> dict[str, Any]:
    """The simulator's settings (`pipeir.sim.costs`) for one stage per rank."""
    out: dict[str, Any] = {"latency": link.latency}
    if link.bandwidth is not None:
        out["bandwidth"] = link.bandwidth
    if unit is not None:
        out["unit"] = unit
    last = len(stages) - 1
    for k, s in enumerate(stages):
        out.update({f"stage.{k}.F": s.F, f"stage.{k}.B": s.B, f"stage.{k}.I": s.I,
                    f"stage.{k}.W": s.W, f"stage.{k}.memory_bytes": s.memory_bytes,
                    f"stage.{k}.param_bytes": s.param_bytes,
                    f"stage.{k}.input_bytes": s.input_bytes})
        if s.memory_w_bytes is not None:
            out[f"stage.{k}.memory_w_bytes"] = s.memory_w_bytes
        if k < last:
            out[f"stage.{k}.activation_bytes"] = s.activation_bytes
    # the kinds' defaults, for ops the stage tables do not name: the medians' role in a
    # profiled cost file; here simply stage 0's (every stage names its own)
    out.update(F=stages[0].F, B=stages[0].B, I=stages[0].I, W=stages[0].W,
               memory_bytes=stages[0].memory_bytes)
    if stages[0].memory_w_bytes is not None:
        out["memory_w_bytes"] = stages[0].memory_w_bytes
    return out
