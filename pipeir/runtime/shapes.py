"""Shape plans: the structure, shapes, dtypes and gradient flags of everything that crosses a
stage boundary, known before any transfer so receivers allocate buffers without a per-transfer
handshake.

A stage output (and the next stage's input) may be a tensor or a nested tuple / list / dict of
tensors and non-tensor constants (torch's pytree). Its `Layout` is the tree structure, one
`TensorMeta` per tensor leaf and the constants themselves: a receiver rebuilds the whole
structure from the bytes of the tensors alone. A floating tensor that requires grad carries a
gradient back; integer and boolean tensors, and tensors that do not require grad, do not.

The plan is traced once per distinct micro-batch input layout (so micro-batches of different
sizes, e.g. variable sequence lengths, each get their own entry) on the meta device, or under a
`FakeTensorMode` where meta cannot (autocast, which meta ignores; see `ShapePlan`): no memory,
no compute. The launcher traces batch(0)'s layouts once and ships them to its ranks.

NOTE (one buffer per transfer): a structure with one tensor is sent as that tensor; with more,
the tensors' bytes are packed into one uint8 buffer (offsets aligned to 16 bytes) and unpacked
as views. A transfer stays one send/recv, so the lowered programs, tags and batched posts are
the same whatever the model passes between stages.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from pipeir.diagnostics import UsageError
from pipeir.models.spec import (
    ModelSpec,
    StageBuildError,
    autocast_dtype,
    call_stage,
    stage_modules,
)

ALIGN = 16


class PlanError(ValueError):
    """A stage cannot be built, or cannot take the previous stage's output (found while
    tracing the plan)."""


@dataclass(frozen=True, repr=False)
class TensorMeta:
    """One tensor leaf of a structure."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool  # requires grad: its gradient travels back

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize

    def __repr__(self) -> str:
        dims = "x".join(map(str, self.shape)) or "scalar"
        return f"{str(self.dtype).removeprefix('torch.')}[{dims}]" + (" (grad)" if self.grad
                                                                      else "")


@dataclass(frozen=True)
class Layout:
    """The structure of one stage output: the pytree spec, and its leaves (a `TensorMeta` for a
    tensor, the value itself for a constant)."""

    spec: pytree.TreeSpec
    leaves: tuple[Any, ...]

    @staticmethod
    def of(value: Any) -> Layout:
        leaves, spec = pytree.tree_flatten(value)
        return Layout(spec, tuple(
            TensorMeta(tuple(x.shape), x.dtype, x.requires_grad) if isinstance(x, torch.Tensor)
            else x for x in leaves))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled as its structure (TensorMeta leaves), not its TreeSpec: unpickling a
        TreeSpec's deprecated LeafSpec warns on every rank."""
        return _layout_of_structure, (pytree.tree_unflatten(list(self.leaves), self.spec),)

    @property
    def tensors(self) -> list[TensorMeta]:
        return [x for x in self.leaves if isinstance(x, TensorMeta)]

    @property
    def grads(self) -> list[TensorMeta]:
        """The tensors whose gradients travel back, in order."""
        return [t for t in self.tensors if t.grad]

    def __str__(self) -> str:
        return repr(pytree.tree_unflatten(list(self.leaves), self.spec))


def _layout_of_structure(value: Any) -> Layout:
    """The Layout whose structure (TensorMeta in place of each tensor) is `value`."""
    leaves, spec = pytree.tree_flatten(value)
    return Layout(spec, tuple(leaves))


# NOTE (one tensor): most stages pass one tensor. The helpers below take it without a pytree
# walk (flatten, unflatten: several microseconds each, several times per micro-batch).

def tensor_leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [x for x in pytree.tree_leaves(value) if isinstance(x, torch.Tensor)]


def grad_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a structure that carry a gradient back (those that require grad)."""
    return [x for x in tensor_leaves(value) if x.requires_grad]


def detached(value: Any, layout: Layout) -> Any:
    """A stage input made from a stage output: every tensor detached, the ones the layout
    marks as carrying a gradient made leaves that require grad."""
    if isinstance(value, torch.Tensor) and len(layout.leaves) == 1:
        return value.detach().requires_grad_(layout.leaves[0].grad)
    leaves, spec = pytree.tree_flatten(value)
    out = [x.detach().requires_grad_(m.grad) if isinstance(x, torch.Tensor) else x
           for x, m in zip(leaves, layout.leaves)]
    return pytree.tree_unflatten(out, spec)


def difference(got: Layout, want: Layout) -> str:
    """Where two layouts first differ: the element's path and both values (e.g.
    "[1]['mask']: None here, bool[2x16] there")."""
    a = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(got.leaves), got.spec))[0]
    b = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(want.leaves), want.spec))[0]
    for (pa, va), (pb, vb) in zip(a, b):
        if pa != pb or va != vb:
            where = pytree.keystr(pa if pa == pb or len(pa) <= len(pb) else pb) or "the output"
            return f"{where}: {va!r} here, {vb!r} there"
    longer, other = (a, "here") if len(a) > len(b) else (b, "there")
    path, value = longer[min(len(a), len(b))]
    return f"{pytree.keystr(path)}: {value!r} only {other}"


def matches(value: Any, layout: Layout) -> bool:
    """Whether a stage output that is one tensor has the layout's one tensor (False: look
    closer with `check`, which takes any structure)."""
    if type(value) is not torch.Tensor or len(layout.leaves) != 1:
        return False
    m = layout.leaves[0]
    return (type(m) is TensorMeta and value.shape == m.shape and value.dtype == m.dtype
            and value.requires_grad == m.grad)


def check(value: Any, layout: Layout, what: str) -> None:
    """Raise when an actual stage output differs from what the plan traced."""
    if matches(value, layout):
        return
    got = Layout.of(value)
    if got != layout:
        raise PlanError(f"{what} is {got}, but the shape plan traced {layout} (does the "
                        "stage's output structure depend on the data's values?)")


# ---- one buffer per transfer ---------------------------------------------------------------

def pack(tensors: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The buffer that carries `tensors` (see the module NOTE)."""
    if len(tensors) == 1:
        return tensors[0].detach().contiguous()
    metas = [TensorMeta(tuple(t.shape), t.dtype, False) for t in tensors]
    buf = torch.empty(max(1, _packed_size(metas)), dtype=torch.uint8, device=device)
    for t, (off, n) in zip(tensors, _offsets(metas)):
        if n:
            buf[off:off + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf


def empty(metas: Sequence[TensorMeta], device: torch.device) -> torch.Tensor:
    """A receive buffer for tensors `metas`."""
    if len(metas) == 1:
        return torch.empty(metas[0].shape, dtype=metas[0].dtype, device=device)
    return torch.empty(max(1, _packed_size(metas)), dtype=torch.uint8, device=device)


def unpack(buf: torch.Tensor, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """The tensors a buffer from `pack` / `empty` carries (views into it)."""
    if len(metas) == 1:
        return [buf]
    return [buf[off:off + n].view(m.dtype).view(m.shape)
            for m, (off, n) in zip(metas, _offsets(metas))]


def _offsets(metas: Sequence[TensorMeta]) -> list[tuple[int, int]]:
    out, off = [], 0
    for m in metas:
        out.append((off, m.nbytes))
        off += -(-m.nbytes // ALIGN) * ALIGN
    return out


def _packed_size(metas: Sequence[TensorMeta]) -> int:
    return sum(-(-m.nbytes // ALIGN) * ALIGN for m in metas)


def structure(layout: Layout, tensors: Sequence[torch.Tensor]) -> Any:
    """The stage input rebuilt from its layout and received tensors (gradient flags set)."""
    it = iter(tensors)
    leaves = [next(it).requires_grad_(x.grad) if isinstance(x, TensorMeta) else x
              for x in layout.leaves]
    return pytree.tree_unflatten(leaves, layout.spec)


# ---- the plan ------------------------------------------------------------------------------

class ShapePlan:
    """`act(stage, mb)`: the layout of `stage`'s output for micro-batch `mb` (the gradients sent
    back into that stage are those of its `grads` tensors).

    NOTE (meta first): the stages are built and traced on the meta device (no memory, no
    compute, and no `torch._dynamo`, which a `FakeTensorMode` imports: 1.5 s of every run's
    start-up). Meta ignores autocast, and a stage may do what meta cannot (move a tensor to
    a real device, read a value), so a spec with autocast, or any stage that fails on meta,
    is traced under a `FakeTensorMode` instead; its errors are the ones reported. Both give
    the same layouts wherever both succeed."""

    def __init__(self, spec: ModelSpec, stages: int, device: torch.device | None = None):
        self.spec = spec
        self.stages = stages
        self.device = device or torch.device("cpu")
        self._tracer: _Tracer | None = None
        self._by_input: dict[Layout, list[Layout]] = {}
        #: a tensor input's (shape, dtype, requires_grad) -> its layouts: a step's plan is
        #: looked up per micro-batch without building its Layout
        self._by_tensor: dict[tuple[Any, ...], list[Layout]] = {}
        self._mb: list[list[Layout]] = []

    def _traced_by(self) -> _Tracer:
        """The stages on meta where the spec allows it, else on fake tensors (see the NOTE)."""
        if self._tracer is None:
            meta = None if autocast_dtype(self.spec) is not None else _meta(self.spec,
                                                                            self.stages)
            self._tracer = meta if meta is not None else _fake(self.spec, self.stages,
                                                               self.device)
        return self._tracer

    def _fallback(self) -> _Tracer:
        """The fake-tensor tracer, after the meta one failed."""
        self._tracer = _fake(self.spec, self.stages, self.device)
        return self._tracer

    @property
    def layouts(self) -> dict[Layout, list[Layout]]:
        """Every input layout traced so far -> its stages' output layouts (what a launcher
        ships to its ranks: `preset`)."""
        return dict(self._by_input)

    def preset(self, layouts: Mapping[Layout, Sequence[Layout]]) -> None:
        """Take layouts traced elsewhere (the launcher's preflight), so that a rank traces
        only an input layout the preflight did not see."""
        self._by_input.update({k: list(v) for k, v in layouts.items()})

    def plan(self, inputs: Sequence[Any]) -> None:
        """Trace (or look up) the layouts for this step's micro-batch inputs: each distinct
        input shape is traced once per run, not once per micro-batch of every step."""
        out = []
        for x in inputs:
            if not isinstance(x, torch.Tensor):
                out.append(self.trace(x))
                continue
            key = (x.shape, x.dtype, x.requires_grad)
            found = self._by_tensor.get(key)
            if found is None:
                found = self._by_tensor[key] = self.trace(x)
            out.append(found)
        self._mb = out

    def trace(self, x: Any) -> list[Layout]:
        """Every stage's output layout for micro-batch input `x`."""
        key = Layout.of(x)
        found = self._by_input.get(key)
        if found is None:
            tracer = self._traced_by()
            try:
                found = tracer.trace(key, self.spec)
            except PlanError:
                if tracer.fake:
                    raise
                found = self._fallback().trace(key, self.spec)
            self._by_input[key] = found
        return found

    def trace_real(self, inputs: Sequence[Any]) -> None:
        """Run the stages for real (no autograd) on `inputs`, the micro-batches of a batch,
        and raise PlanError where a stage's output structure differs from what the plan
        traces for the same input layout: a hand-off that depends on the data's values (a
        mask that is None when a micro-batch has no padding), which the ranks would
        otherwise find only after they start. Names the stage, micro-batch and element."""
        dtype = autocast_dtype(self.spec)
        try:
            with self.device:
                real = stage_modules(self.spec, self.stages, range(self.stages))
        except StageBuildError as e:
            raise PlanError(e.message) from None
        for mb, x in enumerate(inputs):
            want = self.trace(x)
            h = x
            with torch.no_grad(), torch.autocast(self.device.type, dtype=dtype,
                                                 enabled=dtype is not None):
                for s in range(self.stages):
                    h = call_stage(real[s], h)
                    got, traced = _structure(Layout.of(h)), _structure(want[s])
                    if got != traced:
                        raise PlanError(
                            f"stage {s}'s output for micro-batch {mb} of batch(0) differs "
                            f"from the traced plan at {difference(got, traced)}: the "
                            "hand-off's structure depends on the data's values; make it "
                            "the same for every micro-batch (e.g. always pass the mask)")

    def state_bytes(self) -> list[int]:
        """Each stage's training state in bytes: parameters and buffers, the gradients of the
        trainable parameters and the optimizer's state after one step, counted on the meta
        or fake modules (no memory used). What a rank holds before its first activation."""
        tracer = self._traced_by()
        out = []
        with tracer.context(), tracer.device:
            for mod in tracer.modules:
                trainable = [p for p in mod.parameters() if p.requires_grad]
                out.append(sum(_nbytes(t) for t in (*mod.parameters(), *mod.buffers()))
                           + sum(_nbytes(p) for p in trainable)
                           + _optimizer_state(self.spec, trainable))
        return out

    def signature(self) -> tuple[int, ...]:
        """Names this step's micro-batch layouts, in order: equal for two steps whose inputs
        have the same layouts (each distinct one is traced once and kept)."""
        return tuple(map(id, self._mb))

    def act(self, stage: int, mb: int) -> Layout:
        return self._mb[mb][stage]


@dataclass(frozen=True)
class _Tracer:
    """Stages built on the meta device (`fake` False) or under a FakeTensorMode, and the
    device their inputs are made on."""

    modules: list[torch.nn.Module]
    device: torch.device
    mode: FakeTensorMode | None = None

    @property
    def fake(self) -> bool:
        return self.mode is not None

    def context(self) -> contextlib.AbstractContextManager[Any]:
        """Where tensors made while tracing go: the fake mode, or the meta device (a stage
        that makes a tensor in its forward makes it there)."""
        return self.mode if self.mode is not None else self.device

    def trace(self, key: Layout, spec: ModelSpec) -> list[Layout]:
        found: list[Layout] = []
        dtype = autocast_dtype(spec)
        with self.context():
            h = pytree.tree_unflatten(
                [torch.empty(m.shape, dtype=m.dtype, device=self.device)
                 if isinstance(m, TensorMeta) else m for m in key.leaves], key.spec)
            for s, mod in enumerate(self.modules):
                try:
                    with (contextlib.nullcontext() if dtype is None  # (meta: never autocast)
                          else torch.autocast(self.device.type, dtype=dtype)):
                        h = call_stage(mod, h)
                except UsageError as e:  # the stage explained itself (a traced stage's shapes)
                    raise PlanError(e.message) from None
                except Exception as e:
                    given = "the micro-batch input" if s == 0 else f"stage {s - 1}'s output"
                    first = str(e).strip().splitlines()[:1]  # a graph adds its trace
                    raise PlanError(f"stage {s} cannot take {given} {found[-1] if s else key}: "
                                    f"{type(e).__name__}: {''.join(first)}") from None
                found.append(Layout.of(h))
        return found


def _meta(spec: ModelSpec, stages: int) -> _Tracer | None:
    """The stages on the meta device, or None where one cannot be built there."""
    meta = torch.device("meta")
    try:
        with meta:
            built = stage_modules(spec, stages, range(stages))
    except StageBuildError:
        return None
    return _Tracer(list(built.values()), meta)


def _fake(spec: ModelSpec, stages: int, device: torch.device) -> _Tracer:
    """The stages on fake tensors (importing `torch._dynamo`).

    NOTE: torch cannot convert a fake parameter (`.to(...)`, `.float()`, `.half()`: the swap
    `Module._apply` forces on fake tensors fails), so a stage that converts itself is built
    for real instead, once, and traced with fake inputs as the others are."""
    try:
        try:
            mode = FakeTensorMode()
            with mode, device:
                built = stage_modules(spec, stages, range(stages))
        except StageBuildError as e:
            if "_apply(): Couldn't swap" not in str(e.error):
                raise
            mode = FakeTensorMode(allow_non_fake_inputs=True)
            with device:
                built = stage_modules(spec, stages, range(stages))
    except StageBuildError as e:
        raise PlanError(e.message) from None
    return _Tracer(list(built.values()), device, mode)


def _structure(layout: Layout) -> Layout:
    """The layout without gradient flags (autograd is off in `trace_real`)."""
    return Layout(layout.spec, tuple(TensorMeta(x.shape, x.dtype, False)
                                     if isinstance(x, TensorMeta) else x
                                     for x in layout.leaves))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _optimizer_state(spec: ModelSpec, params: list[torch.nn.Parameter]) -> int:
    """Bytes of the state `spec.optimizer` keeps for `params` after a step (Adam: two moments,
    SGD with momentum: one), stepped on fake gradients; 0 where the optimizer cannot step on
    fake tensors, which keeps the count a lower bound."""
    if not params:
        return 0
    try:
        opt = spec.optimizer(params)
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        return sum(_nbytes(t) for state in opt.state.values() for t in state.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)
    except Exception:  # any optimizer a user writes: the count stays a lower bound
        return 0
    finally:
        for p in params:
            p.grad = None
