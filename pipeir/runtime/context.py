"""The execution context of one rank: what every lowered instruction does.

Generated per-rank programs are straight-line calls on a `Context`, one call per lowered
instruction (so `ctx.pc` is the instruction index, and an error names the instruction and the
`.sched` line it came from). Every call is timed for the measured bubble and `--trace`.

Tensor state, keyed by (stage, micro-batch). Inputs and outputs are structures (a tensor, or
a nested tuple / list / dict of tensors and constants, see `pipeir.runtime.shapes`); gradients
are lists, one per tensor of the structure that carries a gradient (in pytree order):
  inputs    the stage input (its tensors that carry a gradient are leaves requiring grad)
  outputs   the stage output (for the last stage: the scaled loss)
  out_grads the gradients w.r.t. a stage output (received, or handed off locally)
  in_grads  the gradients w.r.t. a stage input, waiting to be sent or handed off
  weight_work what an I left for its W (saved gradients at the weight-feeding nodes)
Entries are popped as soon as the backward that needs them has run, which frees activations.

NOTE (CUDA): compute runs on the current stream and point-to-point ops on a separate comm
stream. Before a send the comm stream waits for the compute stream (the tensor is ready);
after a receive completes the compute stream waits for the comm stream. On CPU the
asynchronous work objects (gloo's, or the pipes' of `pipeir.runtime.pipes` between ranks on
one host) are the overlap and no streams are used.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from pipeir.models.spec import ModelSpec, autocast_dtype, call_stage
from pipeir.runtime import autograd, shapes, splitgrad
from pipeir.runtime import dist as pdist
from pipeir.runtime.deviceclock import DeviceClock, cuda_clock
from pipeir.runtime.memory import SavedActivations
from pipeir.runtime.mesh import Mesh
from pipeir.runtime.optim import Optim, StepStats
from pipeir.runtime.shapes import Layout, ShapePlan, TensorMeta

Key = tuple[int, int]
#: reusable, and made once: `_autocast` runs around every forward and loss
_NO_AUTOCAST: contextlib.nullcontext[None] = contextlib.nullcontext()
_now = time.perf_counter


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
    layout: Layout | None = None  # a receive: what the buffer carries
    metas: Sequence[TensorMeta] = ()


class Context:
    """One rank's modules, optimizer, tensors and timers."""

    #: data parallelism: this replica's place and groups (None: one replica; peers in the
    #: generated code are then global ranks)
    mesh: Mesh | None = None

    def __init__(self, spec: ModelSpec, modules: dict[int, torch.nn.Module], stages: int,
                 device: torch.device, plan: ShapePlan, optim: Optim,
                 on_instr: Callable[[int], None] | None = None, record_every_step: bool = True):
        self.spec = spec
        self.modules = modules
        self.stages = stages
        self.device = device
        self.plan = plan
        self.optim = optim
        self.autocast = autocast_dtype(spec)
        self.stats = StepStats(None, False, None)
        self.on_instr = on_instr
        self.cuda = device.type == "cuda"
        self.comm_stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                            if self.cuda else None)
        #: a group per directed channel (NCCL: `pipeir.runtime.dist`'s NOTE)
        self.per_channel = pdist.per_channel(device)
        #: CPU ranks on one host: transfers through pipes (`pipeir.runtime.pipes`)
        self.pipes = pdist.pipes()
        #: saved activations per (stage, micro-batch), their bytes, offloads and recomputes
        #: (`record_every_step` False: only steps with new micro-batch layouts are recorded,
        #: see `SavedActivations.begin_step`; a program with memory ops or split backwards
        #: needs every step)
        self.saved = SavedActivations(device, (p for m in modules.values()
                                               for p in m.parameters()), record_every_step)
        self.pc = -1
        #: (pc, start, end) of each instruction run this step, in host-clock seconds (on
        #: CUDA, when its work ran on the device: `pipeir.runtime.deviceclock`)
        self.times: list[tuple[int, float, float]] = []
        self.clock: DeviceClock | None = cuda_clock() if self.cuda else None
        #: data parallelism: (stage, when its all-reduce finished), in the order waited for
        self.reduced: list[tuple[int, float]] = []
        self.loss_sum = 0.0
        #: this step's losses, (micro-batch, the unscaled loss, its weight): read once, at
        #: the end of the step (`end_step`), not with a device sync per micro-batch
        self.losses: list[tuple[int, torch.Tensor, float]] = []
        #: the loss of each micro-batch as a number, after `end_step`
        self.loss_values: dict[int, float] = {}
        self._reset()

    # ---- step framing (called by the worker, not by generated code) -----------------------
    def _reset(self) -> None:
        self.inputs: dict[Key, Any] = {}
        self.outputs: dict[Key, Any] = {}
        self.out_grads: dict[Key, list[torch.Tensor]] = {}
        self.in_grads: dict[Key, list[torch.Tensor]] = {}
        self.weight_work: dict[Key, splitgrad.WeightWork] = {}
        self.targets: dict[int, Any] = {}
        #: sends posted and not yet waited, in posting order (by `id`: `wait-send` removes
        #: one without a scan, which was quadratic in a step's sends)
        self.sends: dict[int, Handle] = {}

    def begin_step(self, xs: Sequence[Any], ys: Sequence[Any]) -> None:
        self._reset()
        self.xs, self.ys = xs, ys
        self.plan.plan(xs)
        self.saved.begin_step(self.plan.signature())
        self.pc = -1
        self.times = []
        if self.clock is not None:
            self.clock.begin()
            self._now = self.clock.mark
        self.reduced = []
        self.loss_sum = 0.0
        self.losses = []
        self.loss_values = {}

    def end_step(self) -> None:
        """After the step's program: `loss_sum` and `loss_values` from this step's losses,
        read off the device in one transfer (the per-step NaN check reads them, see
        `pipeir.runtime.guards`)."""
        self.saved.end_step()
        if self.clock is not None:  # (marks so far: the worker synchronized the device)
            self.times = self.clock.resolve(self.times)
            self._now = _now  # (between steps: the host clock)
        if not self.losses:
            return
        vals = [v for _, v, _ in self.losses]
        if all(v.dim() == 0 and v.dtype == vals[0].dtype for v in vals):
            values = torch.stack(vals).float().tolist()
        else:  # a loss that is not one number: its sum, as before any backward
            values = [float(v.float().sum()) for v in vals]
        self.loss_values = {mb: x for (mb, _, _), x in zip(self.losses, values)}
        self.loss_sum = sum(x * w for (_, _, w), x in zip(self.losses, values))

    #: the time of now: the host clock, or on CUDA a mark on the stream (`DeviceClock`)
    _now: Callable[[], float] = staticmethod(_now)

    def _enter(self) -> float:
        pc = self.pc = self.pc + 1
        if self.on_instr is not None:
            self.on_instr(pc)
        return self._now()

    def _leave(self, t0: float) -> None:
        self.times.append((self.pc, t0, self._now()))

    # ---- compute ---------------------------------------------------------------------------
    def zero_grad(self) -> None:
        t0 = self._enter()
        self.optim.zero_grad()
        self._leave(t0)

    def step(self) -> None:
        t0 = self._enter()
        self._wait_sends()  # (none left where the proof accepted the program)
        self.stats = self.optim.step()
        self._leave(t0)

    def load(self, mb: int, part: str) -> None:
        t0 = self._enter()
        if part == "input":
            self.inputs[(0, mb)] = self._to_device(self.xs[mb])
        else:
            self.targets[mb] = self._to_device(self.ys[mb])
        self._leave(t0)

    def forward(self, stage: int, mb: int) -> None:
        t0 = self._enter()
        key = (stage, mb)
        with self._autocast(), self.saved.recording(key):
            self.outputs[key] = call_stage(self.modules[stage], self.inputs[key])
        self._leave(t0)

    def forward_checkpoint(self, stage: int, mb: int) -> None:
        """FC: the forward without autograd (only the input stays, and the RNG state)."""
        t0 = self._enter()
        key = (stage, mb)
        self.saved.checkpoint(key, self.inputs[key])
        with self._autocast(), torch.no_grad():
            out = call_stage(self.modules[stage], self.inputs[key])
        # the output goes on as if autograd had made it (the same gradient flags); its RC
        # makes the real one before the backward
        self.outputs[key] = shapes.detached(out, self.plan.act(stage, mb))
        self._leave(t0)

    def recompute(self, stage: int, mb: int) -> None:
        """RC: the forward of an FC again, under autograd with the FC's RNG state. Buffers
        the forward updates (BatchNorm's running statistics) are put back afterwards: the FC
        has updated them once, as the one forward of single-process training does."""
        t0 = self._enter()
        key = (stage, mb)
        module = self.modules[stage]
        # by name: a forward may update a buffer in place (BatchNorm) or assign a new one
        # (`self.ema = 0.9 * self.ema + ...`); either way the FC's value is what stays
        kept = [(name, b, b.detach().clone()) for name, b in module.named_buffers()]
        with self.saved.replaying(key), self._autocast():
            self.outputs[key] = call_stage(module, self.inputs[key])
        with torch.no_grad():
            for name, b, before in kept:
                b.copy_(before)
                owner, _, leaf = name.rpartition(".")
                module.get_submodule(owner)._buffers[leaf] = b
        self._leave(t0)

    def offload(self, stage: int, mb: int) -> None:
        t0 = self._enter()
        self.saved.offload((stage, mb))
        self._leave(t0)

    def reload(self, stage: int, mb: int) -> None:
        t0 = self._enter()
        self.saved.reload((stage, mb))
        self._leave(t0)

    def loss(self, stage: int, mb: int, scale: float) -> None:
        t0 = self._enter()
        with self._autocast():
            value = self.spec.loss(self.outputs[(stage, mb)], self.targets.pop(mb))
        self.losses.append((mb, value.detach(), scale))
        if self.mesh is not None:  # the all-reduce sums the replicas' gradients: 1/D each
            scale /= self.mesh.shape.dp
        scaled = value * scale
        self.outputs[(stage, mb)] = scaled * self.optim.scale if self.optim.fp16 else scaled
        self._leave(t0)

    def backward(self, stage: int, mb: int) -> None:
        t0 = self._enter()
        key = (stage, mb)
        self.saved.ready(key)
        roots, grads = self._roots(key)
        if roots:
            autograd.backward(roots, grads)
        self.saved.release(key)
        x = self.inputs.pop(key)
        if stage > 0:
            self.in_grads[key] = [_or_zeros(t.grad, t) for t in shapes.grad_leaves(x)]
        self._leave(t0)

    def backward_input(self, stage: int, mb: int) -> None:
        """I: the input gradients only; what W needs is kept in `weight_work` (see
        `pipeir.runtime.splitgrad`), so W does not redo the activation-gradient path."""
        t0 = self._enter()
        key = (stage, mb)
        self.saved.ready(key)
        roots, grads = self._roots(key)
        xs = shapes.grad_leaves(self.inputs.pop(key)) if stage > 0 else []
        gxs, work = splitgrad.backward_input_many(roots, grads, xs)
        if stage > 0:
            self.in_grads[key] = [_or_zeros(g, x) for g, x in zip(gxs, xs)]
        self.weight_work[key] = work
        self.saved.after_input(key, splitgrad.weight_nodes(work))
        self._leave(t0)

    def backward_weight(self, stage: int, mb: int) -> None:
        """W: parameter gradients from the gradients I saved; frees the activations (a no-op
        for a stage without parameters)."""
        t0 = self._enter()
        splitgrad.backward_weight(self.weight_work.pop((stage, mb)))
        self.saved.release((stage, mb))
        self._leave(t0)

    def handoff(self, tensor: str, stage: int, mb: int) -> None:
        t0 = self._enter()
        if tensor == "act":
            layout = self.plan.act(stage, mb)
            self.inputs[(stage + 1, mb)] = shapes.detached(self._sent_act(stage, mb, layout),
                                                           layout)
        else:
            self.out_grads[(stage - 1, mb)] = self.in_grads.pop((stage, mb))
        self._leave(t0)

    def _roots(self, key: Key) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """The output tensors a backward starts from, and their gradients (None: the loss)."""
        out = self.outputs.pop(key)
        if key[0] == self.stages - 1:
            return [out], None
        return shapes.grad_leaves(out), self.out_grads.pop(key)

    def _sent_act(self, stage: int, mb: int, layout: Layout) -> Any:
        """Stage `stage`'s output for `mb`, checked against its `layout` in the shape plan."""
        out = self.outputs[(stage, mb)]
        if not shapes.matches(out, layout):
            shapes.check(out, layout, f"stage {stage}'s output (micro-batch {mb})")
        return out

    def _to_device(self, value: Any) -> Any:
        """A batch value on this rank's device: a tensor is moved only when elsewhere; a
        structure is walked only on CUDA (on CPU its tensors are already where the rank
        computes, and the walk cost 13 us per micro-batch)."""
        if isinstance(value, torch.Tensor):
            return value if value.device == self.device else value.to(self.device)
        return to_device(value, self.device) if self.cuda else value

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast is None:
            return _NO_AUTOCAST
        return torch.autocast(self.device.type, dtype=self.autocast)

    # ---- data parallelism (pipeir.runtime.mesh) ---------------------------------------------
    def reduce_grad(self, stage: int) -> None:
        """Start averaging `stage`'s gradients over its replicas (asynchronous)."""
        t0 = self._enter()
        if self.mesh is not None:
            self._run_comm(lambda: self.mesh.start_reduce(stage),  # type: ignore[union-attr]
                           stream=False)
        self._leave(t0)

    def wait_reduce(self, stage: int) -> None:
        t0 = self._enter()
        if self.mesh is not None:
            self._run_comm(lambda: self.mesh.finish_reduce(stage),  # type: ignore[union-attr]
                           stream=False)
            done = self.mesh.done.pop(stage, None)
            if done is not None:
                self.reduced.append((stage, done))
        self._leave(t0)

    def _peer(self, peer: int) -> int:
        """The global rank of pipeline rank `peer` in this replica."""
        return peer if self.mesh is None else self.mesh.peer(peer)

    def _group(self, kind: str, peer: int) -> Any:
        """The group a send to / receive from pipeline rank `peer` goes through (None: the
        default group; on NCCL, its channel's: `pipeir.runtime.dist`'s NOTE)."""
        me, other = dist.get_rank(), self._peer(peer)
        return pdist.channel(me, other) if kind == "send" else pdist.channel(other, me)

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
        self.sends[id(h)] = h
        self._leave(t0)
        return h

    def irecv(self, tensor: str, stage: int, mb: int, peer: int, tag: int) -> Handle:
        t0 = self._enter()
        h = self._post("recv", tensor, stage, mb, peer, tag)
        self._leave(t0)
        return h

    def batch(self, *posts: tuple[str, str, int, int, int, int]) -> list[Handle]:
        """Post several (kind, tensor, stage, mb, peer, tag) at once (batch_isend_irecv).

        NOTE: with a group per channel (NCCL: `pipeir.runtime.dist`'s NOTE) or pipes each
        post goes on its own (a pipe's posts are bookkeeping: nothing to batch). NCCL runs a
        batch as one grouped kernel with one work for all of it, so waiting for a batch's
        first receive would wait for its last, whose sender may need this rank to go on
        first; on a channel, posts in order already run in order, and a send and a receive
        to one peer are on two channels that cannot hold each other."""
        t0 = self._enter()
        handles = [self._handle(*p) for p in posts]
        if self.per_channel or self.pipes is not None:
            for h, (_, _, _, _, peer, tag) in zip(handles, posts):
                self._issue(h, peer, tag)
        else:
            ops = [dist.P2POp(dist.isend if h.kind == "send" else dist.irecv, h.buf,
                              self._peer(peer), tag=tag)
                   for h, (_, _, _, _, peer, tag) in zip(handles, posts)]
            works = self._batch_works(ops)
            for i, h in enumerate(handles):
                # NCCL coalesces a batch into one work object; gloo returns one per op.
                h.work = works[i] if len(works) == len(handles) else works[-1]
            if self.comm_stream is not None:
                for h in handles:
                    h.buf.record_stream(self.comm_stream)
        for h in handles:
            if h.kind == "send":
                self.sends[id(h)] = h
        self._leave(t0)
        return handles

    def _batch_works(self, ops: list[dist.P2POp]) -> Any:
        return self._run_comm(lambda: dist.batch_isend_irecv(ops))

    def wait_send(self, h: Handle) -> None:
        t0 = self._enter()
        self._wait(h)
        self.sends.pop(id(h), None)
        self._leave(t0)

    def wait_sends(self) -> None:
        t0 = self._enter()
        self._wait_sends()
        self._leave(t0)

    def wait_recv(self, h: Handle) -> None:
        t0 = self._enter()
        self._wait(h)
        self._leave(t0)

    # ---- helpers ---------------------------------------------------------------------------
    def _wait_sends(self) -> None:
        """Wait every send posted and not yet waited, in posting order."""
        sends, self.sends = self.sends, {}
        for h in sends.values():
            self._wait(h)

    def _handle(self, kind: str, tensor: str, stage: int, mb: int, peer: int, tag: int
                ) -> Handle:
        if kind == "send":
            if tensor == "act":
                sent = shapes.tensor_leaves(self._sent_act(stage, mb, self.plan.act(stage, mb)))
            else:
                sent = self.in_grads.pop((stage, mb))
            return Handle(kind, tensor, stage, mb, None, shapes.pack(sent, self.device))
        layout = self.plan.act(stage if tensor == "act" else stage - 1, mb)
        metas = layout.tensors if tensor == "act" else layout.grads
        return Handle(kind, tensor, stage, mb, None, shapes.empty(metas, self.device), layout,
                      metas)

    def _post(self, kind: str, tensor: str, stage: int, mb: int, peer: int, tag: int
              ) -> Handle:
        h = self._handle(kind, tensor, stage, mb, peer, tag)
        self._issue(h, peer, tag)
        return h

    def _issue(self, h: Handle, peer: int, tag: int) -> None:
        """Post `h`'s transfer on its own, through its channel's pipe or group."""
        pipes = self.pipes
        if pipes is not None:
            to = self._peer(peer)
            if pipes.carries(h.kind, to, h.buf.nbytes):
                post = pipes.isend if h.kind == "send" else pipes.irecv
                h.work = self._run_comm(lambda: post(h.buf, to, tag), stream=False)
                return
        op = dist.isend if h.kind == "send" else dist.irecv
        group = self._group(h.kind, peer)
        h.work = self._run_comm(lambda: op(h.buf, self._peer(peer), group=group, tag=tag))
        if self.comm_stream is not None:  # the comm stream uses a compute-stream allocation
            h.buf.record_stream(self.comm_stream)

    def _run_comm(self, post: Callable[[], Any], stream: bool = True) -> Any:
        try:
            if self.comm_stream is None or not stream:
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
            got = shapes.unpack(h.buf, h.metas)
            if h.tensor == "act":
                assert h.layout is not None
                self.inputs[(h.stage + 1, h.mb)] = shapes.structure(h.layout, got)
            else:
                self.out_grads[(h.stage - 1, h.mb)] = got


def to_device(value: Any, device: torch.device) -> Any:
    """A batch value (tensor or structure) with its tensors moved to `device`."""
    return pytree.tree_map(
        lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, value)


def _or_zeros(grad: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """A stage input that got no gradient (the stage does not use it) sends zeros."""
    return torch.zeros_like(like) if grad is None else grad
