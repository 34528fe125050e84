"""Split backward: the input-gradient half (I) and the weight-gradient half (W) of one stage's
backward, each doing its own share of the work, so that I + W costs about one full backward.

The idea is torch.distributed.pipelining's `stage_backward_input` / `stage_backward_weight`:
I runs autograd only towards the stage input and, on the way, saves the gradient that reaches
every *boundary node* (a node on the input path that also feeds a parameter through a *side
branch* off that path, e.g. the `AddmmBackward` of a Linear); W restarts autograd at those
nodes with the saved gradients and goes only towards the parameters.

NOTE (why W makes one autograd call per group of boundary nodes): a single call from all
boundary nodes at once would make autograd walk from a later boundary node down the input
path to an earlier one (that path leads to the earlier node's parameters), recomputing the
activation gradients I already computed. Starting at one node with only the parameters of its
side branches as targets, autograd runs just that node's weight-gradient outputs and the side
branches. That is exact when side branches are disjoint. When they share a node (tied weights:
one parameter, or one tensor made from parameters, used in two places), the nodes that share
are one group and run in one call that also reaches the later node's parameters through the
input path; there, as in torch, a pre-hook pins every group node's incoming gradient to the
value I saved, so nothing is counted twice (the input path between them is recomputed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch.autograd.graph import GradientEdge, Node

from pipeir.runtime import autograd

Grads = tuple[torch.Tensor | None, ...]


@dataclass
class WeightWork:
    """What I leaves for W: groups of boundary nodes, each with the nodes of its side branches
    and its parameters; the gradients I saved per node (`full` holds the output and its
    gradient instead when nothing was split: the input needed no gradient)."""

    groups: list[tuple[list[Node], set[Node], list[torch.Tensor]]]
    saved: dict[Node, Grads]
    full: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor] | None] | None = None


def _node_of(t: torch.Tensor) -> Node | None:
    """The grad_fn of `t`, or for a leaf the accumulator its gradient goes into."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]  # type: ignore[union-attr]


def _graph(roots: Sequence[Node]) -> list[Node]:
    """Every node reachable from `roots`, in discovery order."""
    seen = set(roots)
    order = list(dict.fromkeys(roots))
    for node in order:
        for fn, _ in node.next_functions:
            if fn is not None and fn not in seen:
                seen.add(fn)
                order.append(fn)
    return order


def _on_path(nodes: list[Node], targets: set[Node]) -> set[Node]:
    """The nodes among `nodes` from which a target is reachable (the input path)."""
    parents: dict[Node, list[Node]] = {}
    for node in nodes:
        for fn, _ in node.next_functions:
            if fn is not None:
                parents.setdefault(fn, []).append(node)
    hit = set(targets)
    todo = list(targets)
    while todo:
        for parent in parents.get(todo.pop(), ()):
            if parent not in hit:
                hit.add(parent)
                todo.append(parent)
    return hit


def _side(start: Sequence[Node]) -> tuple[set[Node], list[torch.Tensor]]:
    """The nodes of the side branches from `start` and the parameters (leaves that need a
    gradient, seen through their AccumulateGrad nodes) at their ends."""
    seen = set(start)
    todo = list(start)
    params: list[torch.Tensor] = []
    while todo:
        node = todo.pop()
        leaf = getattr(node, "variable", None)  # only AccumulateGrad nodes have one
        if leaf is not None:
            params.append(leaf)
        for fn, _ in node.next_functions:
            if fn is not None and fn not in seen:
                seen.add(fn)
                todo.append(fn)
    return seen, params


def _groups(boundary: list[tuple[Node, set[Node], list[torch.Tensor]]]
            ) -> list[tuple[list[Node], set[Node], list[torch.Tensor]]]:
    """Boundary nodes whose side branches share a node, merged (in order); the nodes of
    their side branches and their parameters."""
    groups: list[tuple[list[Node], set[Node], list[torch.Tensor]]] = []
    for node, side, params in boundary:
        nodes, merged, ps = [node], set(side), list(params)
        for g in [g for g in groups if not g[1].isdisjoint(side)]:
            groups.remove(g)
            nodes, ps = g[0] + nodes, g[2] + ps
            merged |= g[1]
        groups.append((nodes, merged, ps))
    return [(nodes, side, list({id(p): p for p in ps}.values())) for nodes, side, ps in groups]


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, x: torch.Tensor
                   ) -> tuple[torch.Tensor | None, WeightWork]:
    """The gradient w.r.t. the stage input `x` (None when x needs none) and the work W does;
    the autograd graph stays alive (retained) until W has run."""
    needs = x.requires_grad
    gxs, work = backward_input_many([output] if output.requires_grad else [],
                                    None if grad is None else [grad], [x] if needs else [])
    return (gxs[0] if needs else None), work


def backward_input_many(outputs: Sequence[torch.Tensor],
                        grads: Sequence[torch.Tensor] | None, inputs: Sequence[torch.Tensor]
                        ) -> tuple[list[torch.Tensor | None], WeightWork]:
    """`backward_input` for a stage whose output and input are several tensors: `outputs`
    are the output tensors that carry a gradient (with `grads`, or None for a scalar loss),
    `inputs` the input tensors that need one. Returns one gradient per input (None where the
    output does not depend on it)."""
    if not outputs:  # nothing flows back into this stage
        return [None] * len(inputs), WeightWork([], {})
    if not inputs:
        return [], WeightWork([], {}, (outputs, grads))
    x_nodes = {n for n in map(_node_of, inputs) if n is not None}
    nodes = _graph([n for n in map(_node_of, outputs) if n is not None])
    on_path = _on_path(nodes, x_nodes)
    boundary: list[tuple[Node, set[Node], list[torch.Tensor]]] = []
    for node in nodes:
        if node not in on_path or node in x_nodes:
            continue
        heads = [fn for fn, _ in node.next_functions if fn is not None and fn not in on_path]
        side, params = _side(heads)
        if params:
            boundary.append((node, side, params))
    saved: dict[Node, Grads] = {}
    handles = [node.register_prehook(_saver(saved, node)) for node, _, _ in boundary]
    try:
        gxs = autograd.grad(outputs, inputs, grads)
    finally:
        for h in handles:
            h.remove()
    return list(gxs), WeightWork(_groups(boundary), saved)


def _saver(saved: dict[Node, Grads], node: Node) -> Callable[[Grads], None]:
    def hook(grads: Grads) -> None:
        saved[node] = grads
    return hook


def weight_nodes(work: WeightWork) -> list[Node] | None:
    """The autograd nodes `backward_weight` runs (None: all of them, when W is the whole
    backward): per group, the nodes reachable from its boundary nodes from which one of its
    parameters is reachable, which is what `torch.autograd.grad` executes. Their saved tensors
    are what W still needs after I (`pipeir.runtime.memory.SavedActivations.after_input`)."""
    if work.full is not None:
        return None
    out: dict[Node, None] = {}
    for nodes, side, params in work.groups:
        if len(nodes) == 1:
            # NOTE: one boundary node: what W runs is the node and the part of its side
            # branches that leads to its parameters (their AccumulateGrad nodes, which the
            # side walk met). Nothing below the node on the input path leads to them: a node
            # there that did would be a boundary node whose side branch shares them, merged
            # into this group. Walking the whole graph below each node instead cost more
            # than I itself (0.53 ms a micro-batch on the transformer's last stage).
            targets = {n for n in side if getattr(n, "variable", None) is not None}
            reach = [*nodes, *side]
        else:  # one autograd call through the input path between the nodes: all of it
            targets = {n for n in map(_node_of, params) if n is not None}
            reach = _graph(nodes)
        out.update(dict.fromkeys(_on_path(reach, targets)))
    return list(out)


def backward_weight(work: WeightWork) -> None:
    """Accumulate the parameter gradients into `.grad` from what `backward_input` saved."""
    if work.full is not None:
        outputs, grads = work.full  # the input needs no gradient: W is the whole backward
        autograd.backward(outputs, grads)
        return
    for nodes, _, params in work.groups:
        edges: list[GradientEdge] = []
        given: list[torch.Tensor] = []
        for node in nodes:
            for i, g in enumerate(work.saved.get(node, ())):
                if g is not None:
                    edges.append(GradientEdge(node, i))
                    given.append(g)
        if not edges:  # no gradient reached these nodes (an unused branch)
            continue
        pins = [node.register_prehook(_pin(work.saved[node])) for node in nodes
                if len(nodes) > 1 and node in work.saved]
        try:
            got = autograd.grad_from_edges(edges, params, given)
        finally:
            for h in pins:
                h.remove()
        for p, g in zip(params, got):
            if g is not None:
                if p.grad is None:
                    p.grad = g
                else:  # in place, as autograd accumulates (the grad may be a bucket's view)
                    p.grad.add_(g)


def _pin(grads: Grads) -> Callable[[Grads], Grads]:
    def hook(_: Grads) -> Grads:
        return grads
    return hook
