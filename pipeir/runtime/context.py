"""The execution context of one rank: what every lowered instruction does.

Generated per-rank programs are straight-line calls on a `Context`, one call per lowered
instruction (so `ctx.pc` is the instruction index, and an error names the instruction and the
`.sched` line it came from). Every call is timed for the measured bubble and `--trace`.

Tensor state, keyed by (stage, micro-batch):
  inputs    the stage input (a leaf that requires grad for stages > 0)
  outputs   the stage output (for the last stage: the scaled loss)
  out_grads the gradient w.r.t. a stage output (received, or handed off locally)
  in_grads  the gradient w.r.t. a stage input, waiting to be sent or handed off
  weight_work what an I left for its W (saved gradients at the weight-feeding nodes)
Entries are popped as soon as the backward that needs them has run, which frees activations.

NOTE (CUDA): compute runs on the current stream and point-to-point ops on a separate comm
stream. Before a send the comm stream waits for the compute stream (the tensor is ready);
after a receive completes the compute stream waits for the comm stream. On CPU (gloo) the
asynchronous work objects are the overlap and no streams are used.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from pipeir.models.spec import ModelSpec
from pipeir.runtime import splitgrad
from pipeir.runtime.shapes import ShapePlan

Key = tuple[int, int]


class CommFailure(RuntimeError):
    """A communication op failed, usually because a peer died first."""


@dataclass
class Handle:
    """An outstanding isend/irecv."""

    kind: str  # "send" | "recv"
    tensor: str
    stage: int
    mb: int
    work: Any
    buf: torch.Tensor


class Context:
    """One rank's modules, optimizer, tensors and timers."""

    def __init__(self, spec: ModelSpec, modules: dict[int, torch.nn.Module], stages: int,
                 device: torch.device, plan: ShapePlan,
                 on_instr: Callable[[int], None] | None = None):
        self.spec = spec
        self.modules = modules
        self.stages = stages
        self.device = device
        self.plan = plan
        params = [p for m in modules.values() for p in m.parameters()]
        self.optimizer = spec.optimizer(params)
        self.on_instr = on_instr
        self.cuda = device.type == "cuda"
        self.comm_stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                            if self.cuda else None)
        self.pc = -1
        self.times: list[tuple[int, float, float]] = []
        self.loss_sum = 0.0
        self._reset()

    # ---- step framing (called by the worker, not by generated code) -----------------------
    def _reset(self) -> None:
        self.inputs: dict[Key, torch.Tensor] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.out_grads: dict[Key, torch.Tensor] = {}
        self.in_grads: dict[Key, torch.Tensor] = {}
        self.weight_work: dict[Key, splitgrad.WeightWork] = {}
        self.targets: dict[int, torch.Tensor] = {}
        self.sends: list[Handle] = []

    def begin_step(self, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]) -> None:
        self._reset()
        self.xs, self.ys = xs, ys
        self.plan.plan(xs)
        self.pc = -1
        self.times = []
        self.loss_sum = 0.0

    def _enter(self) -> float:
        self.pc += 1
        if self.on_instr is not None:
            self.on_instr(self.pc)
        return time.perf_counter()

    def _leave(self, t0: float) -> None:
        self.times.append((self.pc, t0, time.perf_counter()))

    # ---- compute ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        t0 = self._enter()
        self.optimizer.zero_grad(set_to_none=True)
        self._leave(t0)

    def step(self) -> None:
        t0 = self._enter()
        for h in self.sends:  # sends not waited yet (none without overlap)
            self._wait(h)
        self.sends = []
        self.optimizer.step()
        self._leave(t0)

    def load(self, mb: int, part: str) -> None:
        t0 = self._enter()
        if part == "input":
            self.inputs[(0, mb)] = self.xs[mb].to(self.device)
        else:
            self.targets[mb] = self.ys[mb].to(self.device)
        self._leave(t0)

    def forward(self, stage: int, mb: int) -> None:
        t0 = self._enter()
        self.outputs[(stage, mb)] = self.modules[stage](self.inputs[(stage, mb)])
        self._leave(t0)

    def loss(self, stage: int, mb: int, scale: float) -> None:
        t0 = self._enter()
        value = self.spec.loss(self.outputs[(stage, mb)], self.targets.pop(mb))
        self.loss_sum += float(value.detach()) * scale
        self.outputs[(stage, mb)] = value * scale
        self._leave(t0)

    def backward(self, stage: int, mb: int) -> None:
        t0 = self._enter()
        key = (stage, mb)
        out = self.outputs.pop(key)
        torch.autograd.backward(out, self.out_grads.pop(key, None))
        x = self.inputs.pop(key)
        if stage > 0:
            self.in_grads[key] = _grad_of(x)
        self._leave(t0)

    def backward_input(self, stage: int, mb: int) -> None:
        """I: the input gradient only; what W needs is kept in `weight_work` (see
        `pipeir.runtime.splitgrad`), so W does not redo the activation-gradient path."""
        t0 = self._enter()
        key = (stage, mb)
        x = self.inputs.pop(key)
        gx, work = splitgrad.backward_input(self.outputs.pop(key), self.out_grads.pop(key, None),
                                            x)
        if stage > 0:
            if gx is None:
                raise RuntimeError("the stage input got no gradient: does the stage use its "
                                   "input?")
            self.in_grads[key] = gx
        self.weight_work[key] = work
        self._leave(t0)

    def backward_weight(self, stage: int, mb: int) -> None:
        """W: parameter gradients from the gradients I saved; frees the activations."""
        t0 = self._enter()
        splitgrad.backward_weight(self.weight_work.pop((stage, mb)))
        self._leave(t0)

    def handoff(self, tensor: str, stage: int, mb: int) -> None:
        t0 = self._enter()
        if tensor == "act":
            out = self.outputs[(stage, mb)]
            self.inputs[(stage + 1, mb)] = out.detach().requires_grad_(out.is_floating_point())
        else:
            self.out_grads[(stage - 1, mb)] = self.in_grads.pop((stage, mb))
        self._leave(t0)

    # ---- communication ---------------------------------------------------------------------
    def send(self, tensor: str, stage: int, mb: int, peer: int, tag: int) -> None:
        t0 = self._enter()
        self._wait(self._post("send", tensor, stage, mb, peer, tag))
        self._leave(t0)

    def recv(self, tensor: str, stage: int, mb: int, peer: int, tag: int) -> None:
        t0 = self._enter()
        self._wait(self._post("recv", tensor, stage, mb, peer, tag))
        self._leave(t0)

    def isend(self, tensor: str, stage: int, mb: int, peer: int, tag: int) -> Handle:
        t0 = self._enter()
        h = self._post("send", tensor, stage, mb, peer, tag)
        self.sends.append(h)
        self._leave(t0)
        return h

    def irecv(self, tensor: str, stage: int, mb: int, peer: int, tag: int) -> Handle:
        t0 = self._enter()
        h = self._post("recv", tensor, stage, mb, peer, tag)
        self._leave(t0)
        return h

    def batch(self, *posts: tuple[str, str, int, int, int, int]) -> list[Handle]:
        """Post several (kind, tensor, stage, mb, peer, tag) at once (batch_isend_irecv)."""
        t0 = self._enter()
        handles = [self._handle(*p) for p in posts]
        ops = [dist.P2POp(dist.isend if h.kind == "send" else dist.irecv, h.buf, peer,
                          tag=tag) for h, (_, _, _, _, peer, tag) in zip(handles, posts)]
        works = self._run_comm(lambda: dist.batch_isend_irecv(ops))
        if self.comm_stream is not None:
            for h in handles:
                h.buf.record_stream(self.comm_stream)
        for i, h in enumerate(handles):
            # NCCL coalesces a batch into one work object; gloo returns one per op.
            h.work = works[i] if len(works) == len(handles) else works[-1]
            if h.kind == "send":
                self.sends.append(h)
        self._leave(t0)
        return handles

    def wait_send(self, h: Handle) -> None:
        t0 = self._enter()
        self._wait(h)
        self.sends = [s for s in self.sends if s is not h]
        self._leave(t0)

    def wait_recv(self, h: Handle) -> None:
        t0 = self._enter()
        self._wait(h)
        self._leave(t0)

    # ---- helpers ---------------------------------------------------------------------------
    def _handle(self, kind: str, tensor: str, stage: int, mb: int, peer: int, tag: int
                ) -> Handle:
        if kind == "send":
            src = (self.outputs[(stage, mb)] if tensor == "act"
                   else self.in_grads.pop((stage, mb)))
            buf = src.detach().contiguous()
        else:
            shape, dtype = self.plan.act(stage if tensor == "act" else stage - 1, mb)
            buf = torch.empty(shape, dtype=dtype, device=self.device)
        return Handle(kind, tensor, stage, mb, None, buf)

    def _post(self, kind: str, tensor: str, stage: int, mb: int, peer: int, tag: int
              ) -> Handle:
        h = self._handle(kind, tensor, stage, mb, peer, tag)
        op = dist.isend if kind == "send" else dist.irecv
        h.work = self._run_comm(lambda: op(h.buf, peer, tag=tag))
        if self.comm_stream is not None:  # the comm stream uses a compute-stream allocation
            h.buf.record_stream(self.comm_stream)
        return h

    def _run_comm(self, post: Callable[[], Any]) -> Any:
        try:
            if self.comm_stream is None:
                return post()
            self.comm_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.comm_stream):
                return post()
        except RuntimeError as e:
            raise CommFailure(str(e)) from e

    def _wait(self, h: Handle) -> None:
        try:
            h.work.wait()
        except RuntimeError as e:
            raise CommFailure(str(e)) from e
        if self.comm_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.comm_stream)
        if h.kind == "recv":
            if h.tensor == "act":
                self.inputs[(h.stage + 1, h.mb)] = h.buf.requires_grad_(
                    h.buf.is_floating_point())
            else:
                self.out_grads[(h.stage - 1, h.mb)] = h.buf


def _grad_of(x: torch.Tensor) -> torch.Tensor:
    if x.grad is None:
        raise RuntimeError("the stage input got no gradient: does the stage use its input?")
    return x.grad
