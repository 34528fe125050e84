"""`causal_lm`: a `ModuleSpec` for a causal language model, so that training a Hugging Face
(or any) `...ForCausalLM` takes its config and one call:

    def spec() -> ModuleSpec:
        return causal_lm(lambda: LlamaForCausalLM(config), vocab=config.vocab_size)

The boring part is pipeir's: the data (random tokens seeded by the step, the same on every
rank: inputs are a sequence, targets the sequence shifted by one), the next-token
cross-entropy on the logits, the example micro-batch torch's tracer needs, and the token
count for the tokens/s metric.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.utils import _pytree as pytree

from pipeir.diagnostics import UsageError
from pipeir.models.module import ModuleSource, ModuleSpec
from pipeir.models.transformer import lm_loss


def random_tokens(step: int, *, vocab: int, batch: int, seq: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch: `batch` sequences of `seq + 1` random tokens (seeded by the
    step), as (tokens[:, :-1], tokens[:, 1:]). The length is the same every step: a traced
    stage keeps the example's shapes."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def logits_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on the model's logits: the output itself, or its first
    tensor (a Hugging Face `CausalLMOutput` without labels holds only its logits)."""
    logits = output if isinstance(output, torch.Tensor) else next(
        x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor))
    return lm_loss(logits, target)


def causal_lm(module: ModuleSource, *, vocab: int, batch: int = 8, seq: int = 16,
              microbatches: int = 4, **options: Any) -> ModuleSpec:
    """`module` (a model mapping token ids to logits, or a function building it) trained on
    `random_tokens` with `logits_loss`; the example torch's tracer cuts it with is one of
    `microbatches` micro-batches of batch(0) (a run cutting the batch otherwise is refused
    before it starts, naming the shapes). Other keyword arguments (`points`, `weights`,
    `optimizer`, `clip_grad_norm`, ...) are `ModuleSpec`'s."""
    for name, value in (("vocab", vocab), ("batch", batch), ("seq", seq),
                        ("microbatches", microbatches)):
        if type(value) is not int or value < 1:
            raise UsageError(f"causal_lm: {name} must be a positive integer, got {value!r}")
    data = functools.partial(random_tokens, vocab=vocab, batch=batch, seq=seq)
    return ModuleSpec(module=module, batch=data, loss=logits_loss,
                      example=data(0)[0][:max(1, batch // microbatches)], tokens=_count,
                      **options)


def _count(inputs: torch.Tensor) -> int:
    return int(inputs.numel())
