"""Single-process reference training: the same model, data, loss scaling and training loop as
a pipelined run, written the ordinary torch way without a pipeline: one module list, tied
parameters as one shared tensor, one optimizer (and LR scheduler) over all parameters,
`torch.nn.utils.clip_grad_norm_`, `torch.autocast` and `torch.amp.GradScaler`. Pipelined
parameters must match these (the correctness tests, `pipeirc run --check` and
`bench/runtime.py` compare against it)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from pipeir.models.spec import ModelSpec, autocast_dtype, build_stage, call_stage, tied_groups
from pipeir.runtime.worker import split_batch

#: stage -> parameter (or buffer) name -> tensor
State = dict[int, dict[str, torch.Tensor]]


def build_model(spec: ModelSpec, stages: int) -> list[torch.nn.Module]:
    """Every stage, with each tied group made one shared parameter (its first member)."""
    modules = [build_stage(spec, s, stages) for s in range(stages)]
    for g in tied_groups(spec, stages):
        (s0, n0), rest = g[0], g[1:]
        shared = modules[s0].get_parameter(n0)
        for s, name in rest:
            owner, _, leaf = name.rpartition(".")
            setattr(modules[s].get_submodule(owner), leaf, shared)
    return modules


def train_reference(spec: ModelSpec, stages: int, microbatches: int, accumulate: int,
                    steps: int, dp: int = 1, reverse: bool = False) -> tuple[State, State]:
    """Train `steps` optimizer steps; returns (stage -> state dict, stage -> gradients of
    the last step). Runs on one intra-op thread, as each rank does: kernels then reduce in the
    same order, which matters under bf16 autocast (one rounding flip is a 0.4% difference).
    With `dp` data-parallel replicas the batch is cut into the micro-batches of all of them
    (replica r's i-th is the (r * microbatches * accumulate + i)-th), each weighted alike.
    `reverse` sums each step's micro-batch gradients last to first (the forwards run in
    order, drawing the same random numbers): the same training summed in another order,
    whose difference is the rounding noise `--check` allows."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(spec, stages, microbatches * dp, accumulate, steps, reverse)
    finally:
        torch.set_num_threads(threads)


def _train(spec: ModelSpec, stages: int, microbatches: int, accumulate: int, steps: int,
           reverse: bool) -> tuple[State, State]:
    modules = build_model(spec, stages)
    params = list({id(p): p for m in modules for p in m.parameters() if p.requires_grad}
                  .values())
    opt = spec.optimizer(params)
    sched = spec.scheduler(opt) if spec.scheduler is not None else None
    dtype = autocast_dtype(spec)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    n = microbatches * accumulate
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        xs, ys = split_batch(spec.batch(step), n)
        parts: list[tuple[torch.Tensor | None, ...]] = []
        for x, y in zip(xs, ys):
            with _autocast(dtype):
                h: Any = x
                for m in modules:
                    h = call_stage(m, h)
                loss = spec.loss(h, y)
            if not reverse:
                torch.autograd.backward(scaler.scale(loss / n))
            else:  # each micro-batch's gradients apart, summed last to first below
                parts.append(torch.autograd.grad(scaler.scale(loss / n), params,
                                                 allow_unused=True))
        for part in reversed(parts):
            for p, g in zip(params, part):
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
        if spec.clip_grad_norm is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, spec.clip_grad_norm)
        scaler.step(opt)
        scaler.update()
        if sched is not None:
            sched.step()
    state = {s: {k: v.detach().clone() for k, v in m.state_dict().items()}
             for s, m in enumerate(modules)}
    grads = {s: {k: v.grad.detach().clone() for k, v in m.named_parameters(remove_duplicate=False)
                 if v.grad is not None} for s, m in enumerate(modules)}
    return state, grads


def _autocast(dtype: torch.dtype | None) -> contextlib.AbstractContextManager[Any]:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=dtype)
