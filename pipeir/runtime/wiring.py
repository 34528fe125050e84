"""The stages' wiring, checked when `pipeir.torch_schedule` builds a schedule rather than
found at the first `step()`: every rank describes its stages, the descriptions are gathered
over the pipeline group, and every rank judges the same whole, so all raise the same error
or none does (a rank that raised alone would leave the others waiting in a collective).

The rules, in the order they are checked:

1. A stage reads its neighbour's outputs only. A stage of torch's own tracer
   (`build_stage(pipe.get_stage_module(k), k, pipe.info(), ...)`) may read an earlier
   stage's output or the model's input (a skip connection: stage 2 reading stage 0's mask);
   pipeir's schedules pass values between neighbouring stages only, so such a stage is
   refused, naming the value (`pipeir.split` carries it along the chain instead).
2. A stage takes what the stage before it gives: a tuple output is the next stage's
   positional arguments (torch's `PipelineStage` convention), so the count must fit the
   next stage's `forward`. The count is known where the stage is a graph (`pipeir.split`'s
   traced stages, `fx.symbolic_trace`), or where its `PipelineStage` was given
   `output_args`; elsewhere it is left to the first step. Stages of torch's tracer (rule 1)
   route each value by name instead, so the count does not apply to them.
3. Tied parameters stay one weight. The stages of a `ModuleSpec` / `pipeir.split` mark the
   parameters that are copies of one weight of the unsplit module (`TIED_ATTR`); where the
   copies are different tensors (other stages, other ranks), torch's runtime would train
   them apart. The schedule sums their gradients after each `step()` (`TiedCopies.sync`),
   so they stay equal as in the unsplit module.
"""

from __future__ import annotations

import inspect
import itertools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import fx, nn

from pipeir.diagnostics import UsageError
from pipeir.models.module import TIED_ATTR


@dataclass(frozen=True)
class Wiring:
    """What one stage takes, gives and shares, as far as its module says (picklable).

    `takes`: the positional argument counts its forward accepts (lo, hi; hi None: any);
    `gives`: its output count (None: unknown before it runs); `reads`: for each argument,
    (the stage making it, -1 for the model input; the value's name) where torch's tracer
    recorded it; `tied`: (parameter name, the weight's unsplit name, rank, tensor id,
    shape, dtype name)."""

    stage: int
    rank: int
    takes: tuple[int, int | None] | None
    gives: int | None
    reads: tuple[tuple[int, str], ...]
    tied: tuple[tuple[str, str, int, int, tuple[int, ...], str], ...]


def describe(stage: Any, rank: int) -> Wiring:
    """The wiring of one `PipelineStage` (or torch's traced `_PipelineStage`)."""
    module: nn.Module = stage.submod
    return Wiring(stage.stage_index, rank, _takes(module), _gives(stage, module),
                  _reads(stage), tuple((n, key, rank, id(p), tuple(p.shape),
                                        str(p.dtype).removeprefix("torch."))
                                       for n, key in sorted(getattr(module, TIED_ATTR,
                                                                    {}).items())
                                       for p in [module.get_parameter(n)]))


def gather(stages: Sequence[Any], rank: int, group: Any) -> list[Wiring]:
    """Every stage's wiring in the pipeline group, by stage index."""
    mine = [describe(s, rank) for s in stages]
    everyone: list[list[Wiring] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    return sorted((w for ws in everyone for w in ws or []), key=lambda w: w.stage)


def check(wirings: Sequence[Wiring]) -> None:
    """Rules 1 and 2 of the module docstring: a UsageError naming the stage and value."""
    for w in wirings:
        for i, (src, name) in enumerate(w.reads):
            if src != w.stage - 1:
                what = "the model's input" if src < 0 else f"stage {src}'s output"
                raise UsageError(
                    f"torch_schedule: stage {w.stage} reads {what} '{name}' (argument "
                    f"{i}), a skip connection: pipeir's schedules pass values between "
                    "neighbouring stages only; split the module with pipeir.split, which "
                    "carries such a value along the chain")
    for before, w in itertools.pairwise(wirings):
        if before.gives is None or w.takes is None or before.reads or w.reads:
            continue  # unknown, or torch's traced stages, which route each value by name
        lo, hi = w.takes
        if before.gives < lo or (hi is not None and before.gives > hi):
            want = f"{lo}" if lo == hi else f"{lo} to {hi}" if hi is not None \
                else f"at least {lo}"
            raise UsageError(
                f"torch_schedule: stage {w.stage} takes {want} positional argument(s), "
                f"stage {before.stage} gives {before.gives} output(s) (a tuple output is "
                "the next stage's positional arguments, as in torch's PipelineStage)")


@dataclass(frozen=True)
class TiedCopies:
    """One weight of the unsplit module held as several tensors: `local` are this rank's
    (each once); a rank holding none adds zeros of `shape` and `dtype`."""

    name: str
    local: tuple[nn.Parameter, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def sync(self, group: Any) -> None:
        """Give every copy the sum of the copies' gradients (one all-reduce)."""
        grads = [p.grad for p in self.local if p.grad is not None]
        total = (torch.stack(grads).sum(0) if grads
                 else torch.zeros(self.shape, dtype=self.dtype, device=self.device))
        dist.all_reduce(total, group=group)
        for p in self.local:
            p.grad = total.clone()


def tied_copies(wirings: Sequence[Wiring], stages: Sequence[Any]) -> list[TiedCopies]:
    """Rule 3: the tied weights held as more than one tensor, in an order every rank shares
    (an all-reduce each)."""
    held: dict[str, set[tuple[int, int]]] = {}
    like: dict[str, tuple[tuple[int, ...], str]] = {}
    for w in wirings:
        for _, key, rank, ident, shape, dtype in w.tied:
            held.setdefault(key, set()).add((rank, ident))
            like[key] = (shape, dtype)
    params: dict[str, dict[int, nn.Parameter]] = {}
    for s in stages:
        for n, key in getattr(s.submod, TIED_ATTR, {}).items():
            p = s.submod.get_parameter(n)
            params.setdefault(key, {})[id(p)] = p
    return [TiedCopies(key, tuple(params.get(key, {}).values()), like[key][0],
                       getattr(torch, like[key][1]), stages[0].device)
            for key in sorted(k for k, copies in held.items() if len(copies) > 1)]


def _takes(module: nn.Module) -> tuple[int, int | None] | None:
    if isinstance(module, fx.GraphModule):
        holders = [n for n in module.graph.nodes if n.op == "placeholder"]
        return (sum(1 for n in holders if not n.args), len(holders))
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a C-implemented forward: no signature to read
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return (sum(1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                    and p.default is p.empty), None)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return (sum(1 for p in positional if p.default is p.empty), len(positional))


def _gives(stage: Any, module: nn.Module) -> int | None:
    meta = getattr(getattr(stage, "_user_meta", None), "outputs", None)
    if meta is not None:
        return len(meta)
    if isinstance(module, fx.GraphModule):
        out = next(n for n in module.graph.nodes if n.op == "output").args[0]
        return len(out) if isinstance(out, tuple | list) else 1
    return None


def _reads(stage: Any) -> tuple[tuple[int, str], ...]:
    """Where a traced `_PipelineStage`'s arguments come from (empty for a `PipelineStage`,
    whose inputs are always its neighbour's outputs)."""
    node = getattr(stage, "node", None)
    index: dict[str, int] = getattr(stage, "submod_to_stage_index", {})
    if not isinstance(node, fx.Node):
        return ()
    module = stage.submod
    names = ([n.name for n in module.graph.nodes if n.op == "placeholder"]
             if isinstance(module, fx.GraphModule) else [])
    out = []
    for i, a in enumerate(node.args):
        if not isinstance(a, fx.Node):
            continue
        made = a.args[0] if (a.op == "call_function" and a.target is operator.getitem
                             and isinstance(a.args[0], fx.Node)) else a
        out.append((index.get(made.name, -1) if made.op == "call_module" else -1,
                    names[i] if i < len(names) else a.name))  # the stage's name for it
    return tuple(out)
