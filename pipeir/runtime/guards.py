"""Run-time guards users expect from a training loop, kept apart from the runtime's hot path:

- a non-finite loss stops the run naming the step and the micro-batch (with
  `allow_nonfinite`, it is a warning on stderr, once per step, and training goes on); it is
  checked once per step, on the summed loss, after the step's program has run;
- every rank checks once, at its first step, that `batch(step)` gives it the same data as
  every other rank (a cheap hash compared across ranks), since a data source that depends on
  the process (an unseeded generator, the rank) trains a model on mismatched inputs and
  targets without any other sign.

The worker calls `Guard.install` once after building its `Context` and `guard.begin_step`
and `guard.end_step` once per step; nothing else in the runtime knows about them.
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Mapping
from typing import Any

import torch

from pipeir.backend.instructions import Loss, Lowered


class NonFiniteLoss(RuntimeError):
    """The loss of a micro-batch is NaN or infinite."""


class BatchMismatch(RuntimeError):
    """Ranks disagree about `batch(step)`."""


class Guard:
    """One rank's guards for one job; see the module docstring."""

    def __init__(self, ctx: Any, lowered: Lowered, rank: int, allow_nonfinite: bool):
        self.ctx = ctx
        self.lowered = lowered
        self.rank = rank
        self.allow_nonfinite = allow_nonfinite
        self.step = -1
        self.checked = False
        self.warned_step = -1

    @classmethod
    def install(cls, ctx: Any, lowered: Lowered, rank: int, allow_nonfinite: bool) -> Guard:
        """Guard `ctx` (the worker then calls `begin_step` and `end_step` around each step)."""
        return cls(ctx, lowered, rank, allow_nonfinite)

    def begin_step(self, step: int, batch: Any) -> None:
        """Called before each step with `batch(step)` (the global batch, before any
        data-parallel sharding); compares it across every rank once."""
        self.step = step
        if not self.checked:
            self.checked = True
            check_same_batch(step, batch, self.ctx.device)

    def end_step(self) -> None:
        """Called after each step's program and `ctx.end_step()`: the loss check.

        NOTE (once per step): checking each micro-batch's loss where it is computed costs a
        device sync per micro-batch (6.5 us each on CPU, a pipeline stall on CUDA). The sum
        of the step's losses is finite unless one of them is not; only then are the
        micro-batches searched for the first culprit, and the instruction that computed its
        loss is reported as the one running (so the run's error names it)."""
        if math.isfinite(self.ctx.loss_sum):
            return
        mb, x = next(((mb, x) for mb, x in sorted(self.ctx.loss_values.items())
                      if not math.isfinite(x)), (None, self.ctx.loss_sum))
        where = f"step {self.step + 1} (batch({self.step})), micro-batch " + (
            "?" if mb is None else str(mb))
        if not self.allow_nonfinite:
            pc = self._loss_pc(mb)
            if pc is not None and self.ctx.on_instr is not None:
                self.ctx.pc = pc
                self.ctx.on_instr(pc)
            raise NonFiniteLoss(f"the loss is {x} at {where}; stopped (run with "
                                "--allow-nonfinite to only warn)")
        if self.warned_step != self.step:
            self.warned_step = self.step
            print(f"warning: the loss is {x} at {where} (--allow-nonfinite: training goes on)",
                  file=sys.stderr, flush=True)

    def _loss_pc(self, mb: int | None) -> int | None:
        """The index of the instruction that computed micro-batch `mb`'s loss."""
        return next((pc for pc, ins in enumerate(self.lowered.program(self.rank))
                     if isinstance(ins, Loss) and ins.mb == mb), None)


def batch_digest(data: Any) -> int:
    """A 63-bit hash of a batch: every tensor's dtype, shape and bytes, in nesting order
    (tuples, lists and dicts of tensors, as data sources return them)."""
    h = hashlib.blake2b(digest_size=8)
    _feed(h, data)
    return int.from_bytes(h.digest(), "little") >> 1


def _feed(h: Any, data: Any) -> None:
    if isinstance(data, torch.Tensor):
        t = data.detach().to("cpu").contiguous().reshape(-1)
        h.update(f"T{t.dtype}{tuple(data.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(data, Mapping):
        h.update(b"{")
        for k in sorted(data, key=str):
            h.update(str(k).encode())
            _feed(h, data[k])
        h.update(b"}")
    elif isinstance(data, list | tuple):
        h.update(b"(")
        for x in data:
            _feed(h, x)
        h.update(b")")
    else:
        h.update(repr(data).encode())


def check_same_batch(step: int, data: Any, device: torch.device) -> None:
    """Raise BatchMismatch on every rank unless all ranks hold the same `data` for `step`."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.tensor([batch_digest(data)], dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    digests = [int(t.item()) for t in every]
    if len(set(digests)) == 1:
        return
    groups: dict[int, list[int]] = {}
    for r, d in enumerate(digests):
        groups.setdefault(d, []).append(r)
    agree = " | ".join(", ".join(map(str, g)) for g in groups.values())
    raise BatchMismatch(f"batch({step}) is not the same on every rank (ranks that agree: "
                        f"{agree}); make the data source depend only on step (seed its "
                        "generator with it)")
