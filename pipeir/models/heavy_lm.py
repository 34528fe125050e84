"""Built-in `heavy-lm`: a language model whose embedding and LM head outweigh a block, as real
ones do (vocabulary 128x the hidden size, the transformer's blocks'): the case where cutting
the blocks evenly leaves the first and last stages lopsided, which `pipeirc plan` exists to
fix. Small enough for CPU tests.

Same data as `transformer` (next token = previous + 1 mod V, a sequence length that varies by
step), with more blocks; `--model heavy-lm` cuts the blocks evenly (`uniform_points`);
`heavy-lm@blocks.2,norm` or a plan cuts it anywhere.
"""

from __future__ import annotations

import functools

from torch import nn

from pipeir.models.chain import ChainModel
from pipeir.models.spec import ModelSpec
from pipeir.models.transformer import DIM, lm_loss, pieces, token_stream

VOCAB = 4096
LAYERS = 8
SEQ = 32
BATCH = 32


_batch = functools.partial(token_stream, vocab=VOCAB, batch=BATCH, seq=SEQ, seed=7)


def splittable() -> ChainModel:
    """The model as a `Splittable`: cut at any block or before the final norm and head."""
    def unused(s: int, stages: int) -> nn.Module:
        raise AssertionError("ChainModel replaces the stage builder")

    return ChainModel(pieces(VOCAB, DIM, LAYERS),
                      ModelSpec(stage=unused, loss=lm_loss, batch=_batch))


def spec() -> ModelSpec:
    """The blocks cut evenly for whatever number of stages runs it."""
    return splittable().spec()
