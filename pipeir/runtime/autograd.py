"""Autograd's engine, called the way `torch.autograd.backward` and `torch.autograd.grad` call
it, without their general-purpose Python front end.

NOTE (hot path): every backward of a stage goes through one of these. torch's front ends
normalize their arguments (tensors or edges, dicts, nested and batched gradients, functorch
and `__torch_function__` checks) and compare each gradient's shape with its output's through
the symbolic-shapes helpers: on a small stage that costs more than the engine's own work
(measured with `python bench/runtime.py --mode noop`: about 50 us of the 85 us CPU time of a
one-op backward). The runtime's calls are always of one form (plain tensors or gradient edges,
one gradient per output, made by the runtime from the shape plan), so the only check that
remains useful is the shape comparison, done here on `torch.Size` directly. The engine is
entered through `torch.autograd.graph._engine_run_backward`, as torch's front ends enter it:
that keeps what it does around the call (the context device threads see, debug logging).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge


def _public_run_backward(outputs: Any, grads: Any, keep_graph: bool, create_graph: bool,
                         inputs: Any, *, allow_unreachable: bool, accumulate_grad: bool
                         ) -> tuple[torch.Tensor | None, ...]:
    """The engine through torch's public front ends: same results, for a torch without the
    private entry point."""
    if accumulate_grad:
        torch.autograd.backward(outputs, grads, retain_graph=keep_graph,
                                create_graph=create_graph, inputs=inputs or None)
        return ()
    return tuple(torch.autograd.grad(outputs, inputs, grads, retain_graph=keep_graph,
                                     create_graph=create_graph, allow_unused=allow_unreachable))


_engine_run_backward: Callable[..., tuple[torch.Tensor | None, ...]] = (
    getattr(torch.autograd.graph, "_engine_run_backward", None) or _public_run_backward)


def _grads(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None
           ) -> tuple[torch.Tensor, ...]:
    """The gradients to start from: ones for a scalar loss (`grads` None), else `grads`,
    each checked against its output's shape (the engine itself does not check roots)."""
    if grads is None:
        return tuple(torch.ones_like(o, memory_format=torch.preserve_format) for o in outputs)
    if len(grads) != len(outputs):
        raise RuntimeError(f"{len(grads)} gradients for {len(outputs)} outputs")
    for i, (o, g) in enumerate(zip(outputs, grads)):
        if o.shape != g.shape:
            raise RuntimeError(f"Mismatch in shape: grad_output[{i}] has a shape of {g.shape} "
                               f"and output[{i}] has a shape of {o.shape}.")
    return tuple(grads)


def backward(outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor] | None) -> None:
    """`torch.autograd.backward(outputs, grads)`: accumulate into the leaves' `.grad`."""
    _engine_run_backward(tuple(outputs), _grads(outputs, grads), False, False, (),
                         allow_unreachable=True, accumulate_grad=True)


def grad(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor],
         grads: Sequence[torch.Tensor] | None) -> tuple[torch.Tensor | None, ...]:
    """`torch.autograd.grad(outputs, inputs, grads, retain_graph=True, allow_unused=True)`."""
    return _engine_run_backward(tuple(outputs), _grads(outputs, grads), True, False,
                                tuple(inputs), allow_unreachable=True, accumulate_grad=False)


def grad_from_edges(edges: Sequence[GradientEdge], inputs: Sequence[torch.Tensor],
                    grads: Sequence[torch.Tensor]) -> tuple[torch.Tensor | None, ...]:
    """`grad` restarted at autograd nodes (`edges`) with gradients autograd itself saved
    there (their shapes are the nodes' own)."""
    return _engine_run_backward(tuple(edges), tuple(grads), True, False, tuple(inputs),
                                allow_unreachable=True, accumulate_grad=False)
