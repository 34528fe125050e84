"""Built-in `transformer`: a tiny causal language model (embedding, pre-norm blocks, head)
on a synthetic token stream with a learnable pattern (next token = previous + 1 mod V), with
a sequence length that changes from step to step.

Stage 0 owns the embedding, the last stage the final norm and head; blocks are spread evenly.
`splittable()` is the same network as a `Splittable` (`transformer@blocks.1,norm` on the
command line, or a `pipeirc plan`): cut at any block or before the norm and head.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from pipeir.models.chain import ChainModel, Part
from pipeir.models.spec import ModelSpec

VOCAB = 64
DIM = 32
HEADS = 2
LAYERS = 4
SEQ = 16
BATCH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        attended: torch.Tensor = self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        x = x + attended
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class Stage(nn.Module):
    def __init__(self, s: int, stages: int) -> None:
        super().__init__()
        per = max(1, LAYERS // stages)
        self.embed = nn.Embedding(VOCAB, DIM) if s == 0 else None
        self.blocks = nn.Sequential(*(Block() for _ in range(per)))
        last = s == stages - 1
        self.norm = nn.LayerNorm(DIM) if last else None
        self.head = nn.Linear(DIM, VOCAB) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        x = self.blocks(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position of every sequence."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def token_stream(step: int, *, vocab: int, batch: int, seq: int, seed: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch of the synthetic stream (next token = previous + 1 mod `vocab`).
    The sequence length varies from step to step (`seq`, `seq - 4`, ...): the runtime's shape
    plan is per micro-batch input shape, so no transfer needs a shape handshake."""
    g = torch.Generator().manual_seed(seed + step)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    length = seq - 4 * (step % 2)
    tokens = (start + torch.arange(length + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


_batch = functools.partial(token_stream, vocab=VOCAB, batch=BATCH, seq=SEQ, seed=99)


def spec() -> ModelSpec:
    return ModelSpec(stage=Stage, loss=lm_loss, batch=_batch)


def pieces(vocab: int, dim: int, layers: int) -> list[list[Part]]:
    """Embedding, `layers` blocks, then the final norm and head, as a chain's pieces."""
    blocks: list[list[Part]] = [[(f"blocks.{i}", Block)] for i in range(layers)]
    return [[("embed", lambda: nn.Embedding(vocab, dim))], *blocks,
            [("norm", lambda: nn.LayerNorm(dim)), ("head", lambda: nn.Linear(dim, vocab))]]


def splittable() -> ChainModel:
    """The built-in transformer as a `Splittable` (see the module docstring)."""
    return ChainModel(pieces(VOCAB, DIM, LAYERS), spec())
