"""Saved activations at run time: where autograd's saved tensors live, how many bytes they
hold, and what the memory ops (FC, RC, OFF, RELOAD) do with them.

Every forward runs under `torch.autograd.graph.saved_tensors_hooks`: the pack hook puts each
tensor autograd saves (parameters excepted: they are not activations) into the stash of its
(stage, micro-batch) and hands autograd a ticket; the unpack hook turns the ticket back into
the tensor during the backward. Because the stash holds the tensors:

* an offload (OFF) swaps a stash's tensors for host copies (pinned memory, on a copy stream,
  on CUDA; on CPU the tensors already are in host memory and nothing moves) and a reload
  (RELOAD) brings them back; the backward waits for the copy stream first;
* the bytes are counted where they are (each tensor's own bytes, once per stash): `live` is
  the bytes of saved activations on the device, plus the inputs a checkpointed forward keeps,
  and `peak` its maximum over the step (the measured counterpart of
  `pipeir.verify.peak_bytes`);
* an input gradient I frees the tensors its weight gradient W does not need
  (`after_input`: those no node of W's autograd graph saved), so what stays until W is
  the Zero Bubble paper's M_W (`memory_w_bytes`); `w_per_stage` records it;
* the last backward of a (stage, micro-batch) releases its stash (`release`).

A checkpointed forward (FC) runs without autograd, keeping its RNG state; its recompute (RC)
runs the forward again under autograd with that RNG state restored (as
`torch.utils.checkpoint` does), so dropout draws the same mask and the backward (full, or
split into I and W) sees the same graph.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import Node
from torch.utils import _pytree as pytree

Key = tuple[int, int]
_NOT_RECORDING: contextlib.nullcontext[None] = contextlib.nullcontext()


@dataclass
class _Stash:
    tensors: list[torch.Tensor | None] = field(default_factory=list)  # None: freed by I
    seen: set[tuple[int, int]] = field(default_factory=set)
    bytes: int = 0
    on_host: bool = False


@dataclass(frozen=True)
class RngState:
    """The random-number state a forward started with (CPU, and the device's on CUDA)."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None


class SavedActivations:
    """One rank's saved activations per (stage, micro-batch), with their byte count."""

    def __init__(self, device: torch.device, params: Iterator[torch.nn.Parameter],
                 every_step: bool = True):
        self.device = device
        #: record every step, not only steps with micro-batch layouts not recorded before
        #: (see `begin_step`); the memory ops (FC, RC, OFF, RELOAD) need every stash, and an
        #: I frees from its stash what W does not need (`after_input`)
        self.every_step = every_step
        self.on = True  # this step's forwards are recorded
        self._layouts: Hashable | None = None
        #: a recorded step's micro-batch layouts -> its peak
        self._peaks: dict[Hashable, int] = {}
        self.cuda = device.type == "cuda"
        # NOTE: by address and size, not identity: autograd may save an alias of a parameter
        # (a Linear saves its weight for the input gradient as a new tensor object)
        self._params = {_identity(p) for p in params}
        self._stash: dict[Key, _Stash] = {}
        self._kept: dict[Key, int] = {}  # bytes of the input an FC keeps
        self._rng: dict[Key, RngState] = {}
        self.copy_stream = (torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
                            if self.cuda else None)
        self.live = 0
        self.peak = 0
        #: per stage, the most bytes one micro-batch's forward saved (what `profile` measures)
        self.per_stage: dict[int, int] = {}
        #: per stage, the most bytes of input a checkpointed forward kept
        self.inputs_per_stage: dict[int, int] = {}
        #: per stage, the most bytes one micro-batch's W still needed after its I
        self.w_per_stage: dict[int, int] = {}
        self._probed: list[Any] | None = None  # tickets unpacked while probing (after_input)

    def begin_step(self, layouts: Hashable | None = None) -> None:
        """A new step; `layouts` names its micro-batch input layouts, in order.

        NOTE (hot path): the pack and unpack hooks are Python calls on every tensor autograd
        saves, the largest part of the runtime's cost per instruction on a small model. A
        step whose layouts, in the same order, a recorded step had runs the same forwards on
        the same shapes, so autograd saves the same bytes: it runs without the hooks (unless
        `every_step`) and reports that step's peak. Stage maxima (`per_stage`) hold across
        steps anyway."""
        self._stash.clear()
        self._kept.clear()
        self._rng.clear()
        self.live = self.peak = 0
        self._layouts = layouts
        self.on = self.every_step or layouts is None or layouts not in self._peaks

    def end_step(self) -> None:
        """After the step: remember a recorded step's peak, or report the one recorded."""
        if self._layouts is None:
            return
        if self.on:
            self._peaks[self._layouts] = self.peak
        else:
            self.peak = self._peaks[self._layouts]

    def _add(self, n: int) -> None:
        self.live += n
        if self.live > self.peak:
            self.peak = self.live

    # ---- forward ---------------------------------------------------------------------------
    def recording(self, key: Key) -> contextlib.AbstractContextManager[None]:
        """Autograd saves the tensors of the forward run inside into `key`'s stash (where
        this step records, see `begin_step`)."""
        return _Recording(self, key) if self.on else _NOT_RECORDING

    def _unpack(self, ticket: Any) -> torch.Tensor:
        if isinstance(ticket, torch.Tensor):
            return ticket
        k: Key = ticket[0]
        i: int = ticket[1]
        if self._probed is not None:
            self._probed.append(ticket)
        got = self._stash[k]
        if got.on_host:
            raise RuntimeError(f"the backward of stage {k[0]}, micro-batch {k[1]} needs "
                               "activations that are offloaded and were not reloaded")
        t = got.tensors[i]
        if t is None:
            raise RuntimeError(f"the weight gradient of stage {k[0]}, micro-batch {k[1]} "
                               "needs a saved tensor that its input gradient freed")
        return t

    def checkpoint(self, key: Key, inputs: Any) -> RngState:
        """An FC: remember the RNG state to run the forward with and count the input it
        keeps. Returns the state (the forward runs with it now)."""
        state = RngState(torch.get_rng_state(),
                         torch.cuda.get_rng_state(self.device) if self.cuda else None)
        self._rng[key] = state
        n = input_bytes(inputs)
        self._kept[key] = n
        self.inputs_per_stage[key[0]] = max(self.inputs_per_stage.get(key[0], 0), n)
        self._add(n)
        return state

    @contextlib.contextmanager
    def replaying(self, key: Key) -> Iterator[None]:
        """An RC: run inside with the RNG state the FC had, recording the saved tensors; the
        RNG state outside is left as it was."""
        state = self._rng.pop(key)
        devices = [self.device] if self.cuda else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(state.cpu)
            if state.cuda is not None:
                torch.cuda.set_rng_state(state.cuda, self.device)
            with torch.enable_grad(), self.recording(key):
                yield

    # ---- offload ---------------------------------------------------------------------------
    def offload(self, key: Key) -> None:
        """OFF: move `key`'s saved activations to host memory."""
        stash = self._stash[key]
        stash.tensors = [None if t is None else self._copy(t, torch.device("cpu"))
                         for t in stash.tensors]
        stash.on_host = True
        self.live -= stash.bytes

    def reload(self, key: Key) -> None:
        """RELOAD: bring them back (the backward waits for the copy in `ready`)."""
        stash = self._stash[key]
        stash.tensors = [None if t is None else self._copy(t, self.device)
                         for t in stash.tensors]
        stash.on_host = False
        self._add(stash.bytes)

    def _copy(self, t: torch.Tensor, to: torch.device) -> torch.Tensor:
        if self.copy_stream is None or t.device == to:
            return t  # CPU: host memory is where the tensor already is
        stream = self.copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if to.type == "cpu":
                out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                out.copy_(t, non_blocking=True)
            else:
                out = t.to(to, non_blocking=True)
        # the allocator must not reuse t before the copy is done; a pinned host tensor has no
        # record_stream (the pinned allocator tracks its own non-blocking copies)
        if t.is_cuda:
            t.record_stream(stream)
        return out

    def ready(self, key: Key) -> None:
        """Before a backward: the compute stream waits for reloads still in flight."""
        if self.copy_stream is not None and key in self._stash:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self.copy_stream)
            for t in self._stash[key].tensors:
                if t is not None and t.device.type == "cuda":
                    t.record_stream(cur)

    # ---- backward --------------------------------------------------------------------------
    def after_input(self, key: Key, nodes: Iterable[Node] | None) -> None:
        """I ran: free the saved tensors of `key` that none of W's autograd `nodes` saved
        (`pipeir.runtime.splitgrad.weight_nodes`; None: W needs them all), so only what the
        weight gradient needs stays until W; record that per stage (`w_per_stage`).

        NOTE: which tickets a node saved is found by reading its `_saved_*` attributes (and a
        custom Function's `saved_tensors`), which unpacks them through `recording`'s hook."""
        stash = self._stash.get(key)
        if stash is None:
            return
        if nodes is not None:
            self._probed = []
            try:
                for node in nodes:
                    for name in _saved_names(node):
                        with contextlib.suppress(RuntimeError):
                            getattr(node, name)
                needed = {i for k, i in self._probed if k == key}
            finally:
                self._probed = None
            kept: dict[tuple[int, int], None] = {}
            for i, t in enumerate(stash.tensors):
                if t is None:
                    continue
                if i in needed:
                    kept[_identity(t)] = None
                else:
                    stash.tensors[i] = None
            freed = stash.bytes - sum(n for _, n in kept)
            stash.seen = set(kept)
            stash.bytes -= freed
            if not stash.on_host:
                self.live -= freed
        self.w_per_stage[key[0]] = max(self.w_per_stage.get(key[0], 0), stash.bytes)

    def release(self, key: Key) -> None:
        """The last backward of `key` ran: its activations (and a kept input) are freed.

        NOTE: the tensors are dropped from the stash itself, not only the stash from this
        object: autograd keeps the pack hook, which holds the stash, for as long as anything
        (an output, a retained graph) keeps the graph alive."""
        stash = self._stash.pop(key, None)
        if stash is not None:
            stash.tensors.clear()
            if not stash.on_host:
                self.live -= stash.bytes
        self.live -= self._kept.pop(key, 0)


class _Recording:
    """`SavedActivations.recording`: a class, not a generator context manager (one generator
    and its frame per forward, on the runtime's hot path)."""

    __slots__ = ("hooks", "key", "owner", "stash")

    def __init__(self, owner: SavedActivations, key: Key):
        self.owner, self.key = owner, key
        self.stash = owner._stash.setdefault(key, _Stash())
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, owner._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        owner, stash = self.owner, self.stash
        seen = _identity(t)
        if seen in owner._params:
            return t
        stash.tensors.append(t)
        if seen not in stash.seen:
            stash.seen.add(seen)
            stash.bytes += seen[1]
            owner._add(seen[1])
        return (self.key, len(stash.tensors) - 1)

    def __enter__(self) -> None:
        self.hooks.__enter__()

    def __exit__(self, *exc: object) -> None:
        self.hooks.__exit__(*exc)
        per_stage, stage = self.owner.per_stage, self.key[0]
        per_stage[stage] = max(per_stage.get(stage, 0), self.stash.bytes)


def _saved_names(node: Node) -> list[str]:
    """The attributes of an autograd node that hold what it saved."""
    names = [a for a in dir(node) if a.startswith("_saved_")]
    if hasattr(type(node), "saved_tensors"):  # a custom autograd.Function's node
        names.append("saved_tensors")
    return names


def _identity(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's (address, bytes): one tensor saved twice (or the same view) counts once; a
    view counts its own bytes, not its whole storage's (a micro-batch slice of the batch)."""
    return t.data_ptr(), t.numel() * t.element_size()


def input_bytes(x: Any) -> int:
    """Bytes of a stage input (a structure): what a checkpointed forward keeps."""
    return sum(n for _, n in {_identity(t) for t in pytree.tree_leaves(x)
                              if isinstance(t, torch.Tensor)})
