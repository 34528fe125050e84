"""Single-process reference training: the same model, data, loss scaling and optimizer as a
pipelined run, without a pipeline. Pipelined parameters must match these (the correctness
tests and `bench/runtime.py` compare against it)."""

from __future__ import annotations

import torch

from pipeir.models.spec import ModelSpec, build_stage
from pipeir.runtime.worker import split_batch


def train_reference(spec: ModelSpec, stages: int, microbatches: int, accumulate: int,
                    steps: int) -> tuple[dict[int, dict[str, torch.Tensor]],
                                         dict[int, dict[str, torch.Tensor]]]:
    """Train `steps` optimizer steps; returns (stage -> state dict, stage -> gradients of
    the last step)."""
    modules = [build_stage(spec, s, stages) for s in range(stages)]
    opt = spec.optimizer([p for m in modules for p in m.parameters()])
    n = microbatches * accumulate
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        xs, ys = split_batch(spec.batch(step), n)
        for x, y in zip(xs, ys):
            h = x
            for m in modules:
                h = m(h)
            torch.autograd.backward(spec.loss(h, y) / n)
        opt.step()
    state = {s: {k: v.detach().clone() for k, v in m.state_dict().items()}
             for s, m in enumerate(modules)}
    grads = {s: {k: v.grad.detach().clone() for k, v in m.named_parameters()
                 if v.grad is not None} for s, m in enumerate(modules)}
    return state, grads
