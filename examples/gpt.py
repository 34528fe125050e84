"""A GPT-style language model for `pipeirc run`: token + position embeddings on the first stage,
pre-norm causal attention blocks spread over the stages, and an output head on the last stage
tied to the token embedding (one weight, `tied`). Stages hand over two tensors, the hidden
states and the padding mask (a bool tensor, which carries no gradient). Trained with AdamW,
a cosine LR schedule, clipping by the global gradient norm and bf16 autocast, on a synthetic
corpus of variable-length, padded sequences (token i+1 = token i + stride mod VOCAB, the stride
given by each sequence's first two tokens), so the loss falls within a few steps.

    pipeirc run examples/1f1b.sched --model examples/gpt.py:spec --steps 20
    pipeirc run examples/1f1b.sched --model examples/gpt.py:spec --set ranks=2 --check
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from pipeir.models import ModelSpec

IGNORE = -100


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        # no bias: the key bias's gradient is zero in exact arithmetic, so Adam would turn
        # rounding noise into updates and no two runs would agree
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln1(h)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        causal = torch.ones(t, t, dtype=torch.bool, device=h.device).tril()
        allowed = causal & mask[:, None, None, :]  # no attention to padding
        a = functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        h = h + self.proj(a.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = h + self.mlp(self.ln2(h))
        return out


class Stage(nn.Module):
    """Stage s of n: (ids, mask) or (hidden, mask) in; (hidden, mask) or logits out."""

    def __init__(self, s: int, n: int, vocab: int, dim: int, heads: int, layers: int,
                 seq: int) -> None:
        super().__init__()
        self.first, self.last = s == 0, s == n - 1
        if self.first:
            self.tok = nn.Embedding(vocab, dim)
            self.pos = nn.Embedding(seq, dim)
            for emb in (self.tok, self.pos):
                nn.init.normal_(emb.weight, std=0.02)
        lo, hi = s * layers // n, (s + 1) * layers // n
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(lo, hi))
        if self.last:
            self.ln_f = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab, bias=False)  # tied to tok.weight

    def forward(self, x: Any, mask: torch.Tensor | None = None) -> Any:
        # stage 0 takes the batch's dict; a later one the (h, mask) stage s - 1 returns, as
        # positional arguments (torch's PipelineStage convention)
        if self.first:
            ids, mask = x["ids"], x["mask"]
            h = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        else:
            h = x
        for block in self.blocks:
            h = block(h, mask)
        if self.last:
            return self.head(self.ln_f(h))
        return h, mask


def _loss(vocab: int, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return functional.cross_entropy(logits.float().reshape(-1, vocab), target.reshape(-1),
                                    ignore_index=IGNORE)


def _batch(vocab: int, seq: int, batch: int, step: int) -> tuple[dict[str, torch.Tensor],
                                                                  torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    t = seq - (seq // 4) * (step % 2)  # the sequence length changes from step to step
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(t + 1)) % vocab
    lengths = torch.randint(t // 2, t + 1, (batch, 1), generator=g)
    mask = torch.arange(t + 1) < lengths  # padded after each sequence's length
    ids = tokens.masked_fill(~mask, 0)
    target = ids[:, 1:].masked_fill(~mask[:, 1:], IGNORE)
    return {"ids": ids[:, :-1], "mask": mask[:, :-1]}, target


def _tokens(inputs: dict[str, torch.Tensor]) -> int:
    return int(inputs["mask"].sum())


def _adamw(lr: float, params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(list(params), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _cosine(lr: float, optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=200, eta_min=lr / 10)


def _tied(stages: int) -> list[list[tuple[int, str]]]:
    return [[(0, "tok.weight"), (stages - 1, "head.weight")]]


def spec(vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 4, seq: int = 32,
         batch: int = 32, lr: float = 3e-3, autocast: str | None = "bf16") -> ModelSpec:
    return ModelSpec(
        stage=partial(Stage, vocab=vocab, dim=dim, heads=heads, layers=layers, seq=seq),
        loss=partial(_loss, vocab), batch=partial(_batch, vocab, seq, batch),
        optimizer=partial(_adamw, lr), scheduler=partial(_cosine, lr), clip_grad_norm=1.0,
        autocast=autocast, tied=_tied, tokens=_tokens)


def tiny() -> ModelSpec:
    """The test size, full precision (equal to single-process training at rtol 1e-5)."""
    return spec(vocab=32, dim=16, heads=2, layers=4, seq=8, batch=8, autocast=None)


def tiny_bf16() -> ModelSpec:
    return spec(vocab=32, dim=16, heads=2, layers=4, seq=8, batch=8)
