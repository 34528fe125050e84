"""Helpers shared by the bring-your-own-module tests (test_byom, test_compare,
test_hf_examples): the models of byom_models.py, single-process training of an unsplit
module with plain torch (the oracle), and a compiled job of a `--model` reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import pipeir
from pipeir.backend.codegen import rank_source
from pipeir.models import ModuleSpec
from pipeir.runtime.worker import Job, split_batch
from pipeir.schedule import Schedule
from pipeir.sim import CostModel

HERE = Path(__file__).parent
MODELS = HERE / "byom_models.py"
TIMEOUT = 90.0




def train_unsplit(spec: ModuleSpec, microbatches: int, steps: int
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Plain torch: the unsplit module, one optimizer, mean loss over micro-batches, clip.
    Returns (state_dict, last step's gradients by every parameter name)."""
    torch.manual_seed(spec.seed)
    module = spec.module() if not isinstance(spec.module, nn.Module) else spec.module
    if spec.weights is not None:
        module.load_state_dict(torch.load(spec.weights, weights_only=True))  # type: ignore[arg-type]
    opt = spec.optimizer(module.parameters())
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        xs, ys = split_batch(spec.batch(step), microbatches)
        for x, y in zip(xs, ys):
            loss = spec.loss(flat_output(module(x)), y) / microbatches
            loss.backward()
        if spec.clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(module.parameters(), spec.clip_grad_norm)
        opt.step()
    grads = {n: p.grad.clone() for n, p in module.named_parameters(remove_duplicate=False)
             if p.grad is not None}
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, grads


def flat_output(output: Any) -> Any:
    """A module's output as a traced last stage returns it: torch.export's leaves (a Hugging
    Face ModelOutput without labels: its logits)."""
    leaves = pytree.tree_leaves(output)
    return leaves[0] if len(leaves) == 1 else tuple(leaves)


def byom_job(schedule: Schedule, model: str, steps: int) -> Job:
    """`model` (a `--model` reference; a bare name is a function of byom_models.py)."""
    low = pipeir.compile(schedule, None).lowered
    ref = model if ":" in model else f"{MODELS}:{model}"
    return Job(low, tuple(rank_source(low, r) for r in range(low.ranks)), ref, steps,
               collect=True)


def synthesised() -> Schedule:
    """A schedule synthesised for two ranks and four micro-batches (skips without the
    `synth` extra, OR-Tools)."""
    pytest.importorskip("ortools")
    from pipeir.search.synth import synth

    return synth(CostModel(F=1.0, B=2.0), 2, 4, v=1, time_limit=5).schedule
