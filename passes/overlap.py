"""`overlap{max_posted=K}`: asynchronous communication on lowered programs.

- every receive (a blocking `recv`, or the `irecv` and `wait-recv` of the default lowering)
  becomes an `irecv` posted early and a `wait-recv` right before the instruction that consumes
  it (before the whole pair when the consumer is half of an overlapped pair). Receives are
  posted earliest consumer first, keeping each peer's receives in their original order (so
  per-peer FIFO matching is unchanged), at most K ahead of their waits (K = 0: no bound, all
  posted at the start of the step). Only when two receives from one peer are consumed in the
  opposite order of their sends can K be exceeded, since per-peer posting order cannot change;
- every blocking send becomes an `isend` where it was, waited at the end of the step (send
  buffers are never reused within a step, so nothing needs them sooner);
- posts to the same peer at the same point become one `batch` (`batch_isend_irecv`).

The result is proved deadlock-free by `pipeir.backend.commcheck` like any lowered program.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipeir.backend.instructions import (
    Backward,
    BackwardInput,
    Batch,
    Comm,
    Forward,
    ForwardCheckpoint,
    Instr,
    IRecv,
    ISend,
    Lowered,
    OptimizerStep,
    Recv,
    Send,
    WaitRecv,
    WaitSend,
    ZeroGrad,
)
from pipeir.passes.base import LoweredPass, OptionError
from pipeir.passes.context import DEFAULT_CONTEXT, CommModel, PassContext


@dataclass(frozen=True)
class Overlap(LoweredPass):
    """Overlap communication with compute (lowered level)."""

    name: ClassVar[str] = "overlap"
    summary: ClassVar[str] = ("post receives early and send asynchronously, batching "
                              "same-peer posts; max_posted bounds receives posted ahead")
    comm: ClassVar[CommModel | None] = "overlapped"
    rank_local: ClassVar[bool] = True

    max_posted: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_posted, int) or self.max_posted < 0:
            raise OptionError("max_posted", "max_posted must be a non-negative integer "
                                            "(0 = no bound)")

    def run(self, lowered: Lowered, ctx: PassContext = DEFAULT_CONTEXT) -> Lowered:
        """The same programs with asynchronous, early-posted communication."""
        if lowered.overlap:
            return lowered
        return lowered.with_programs([self.run_rank(p) for p in lowered.programs], overlap=True)

    def run_rank(self, prog: Sequence[Instr]) -> tuple[Instr, ...]:
        """One rank's program with its communication overlapped (the module docstring)."""
        # NOTE (linear): every look-up here is by index or key, never a scan of the
        # program: finding each receive's consumer by scanning (and its own place by
        # `tuple.index`, which compares instructions field by field) made the pass
        # quadratic: 43 s of a 65k-op compile, against 0.3 s now. The receives are known by
        # their number in program order (`recvs`), not by their key: a key is a tuple made
        # per look-up.
        found = [(i, ins) for i, ins in enumerate(prog) if type(ins) is Recv or type(ins) is IRecv]
        recvs = [r for _, r in found]
        consumers = _consumers(prog)
        consumer = [_consumer_index(prog, consumers, i, r) for i, r in found]
        limit = self.max_posted or len(recvs)
        out: list[Instr] = []
        # Not yet posted, per peer in original order (per-peer FIFO must not change).
        queues: dict[int, deque[int]] = {}
        for j, r in enumerate(recvs):
            queues.setdefault(r.peer, deque()).append(j)
        # the queues' heads by (consumer, the peer's place in `queues`): what `min` over the
        # heads in dict order would pick, without visiting every peer per post
        place = {peer: k for k, peer in enumerate(queues)}
        heads = [(consumer[q[0]], place[peer], peer) for peer, q in queues.items()]
        heapq.heapify(heads)
        outstanding: set[int] = set()
        sends: list[Send] = []

        def post_next() -> None:
            # The head (of any peer's queue) whose consumer comes first.
            _, k, peer = heapq.heappop(heads)
            q = queues[peer]
            j = q.popleft()
            if q:
                heapq.heappush(heads, (consumer[q[0]], k, peer))
            r = recvs[j]
            # (an unpaired IRecv is its own post: kept, not built again)
            out.append(r if type(r) is IRecv and not r.paired else
                       IRecv(r.tensor, r.stage, r.mb, r.peer, r.tag, op=r.op, at=r.at))
            outstanding.add(j)

        def post_upto(need: int | None) -> None:
            while heads and len(outstanding) < limit:
                post_next()
            while need is not None and need not in outstanding:
                post_next()  # only when a peer's FIFO order differs from consumer order

        waits_at: dict[int, list[int]] = {}
        for j, c in enumerate(consumer):
            waits_at.setdefault(c, []).append(j)
        # the program's own waits, kept where they are what this pass would build
        had = {ins.key: ins for ins in prog if type(ins) is WaitRecv}  # type: ignore[attr-defined]
        # (`type(x) is C`, a fifth of `isinstance`'s cost on every instruction: none of
        # these classes has a subclass; `ForwardCheckpoint`, a `Forward`, is named in
        # `_consumers`)
        for i, ins in enumerate(prog):
            t = type(ins)
            if t is ZeroGrad:
                out.append(ins)
                post_upto(None)
                continue
            waiting = waits_at.get(i)
            if waiting is not None:
                for j in waiting:
                    post_upto(j)
                    r = recvs[j]
                    w = had.get(r.key) if had else None
                    out.append(w if w is not None and not w.paired and w.peer == r.peer and
                               w.tag == r.tag and w.op == r.op and w.at == r.at else
                               WaitRecv(r.tensor, r.stage, r.mb, r.peer, r.tag, op=r.op,
                                        at=r.at))
                    outstanding.discard(j)
                    post_upto(None)
            if t is Recv or t is IRecv or t is WaitRecv:
                continue
            if t is Send:
                assert isinstance(ins, Send)
                sends.append(ins)
                out.append(ISend(ins.tensor, ins.stage, ins.mb, ins.peer, ins.tag,
                                 op=ins.op, at=ins.at))
                continue
            if t is OptimizerStep:
                out.extend(WaitSend(s.tensor, s.stage, s.mb, s.peer, s.tag, op=s.op, at=s.at)
                           for s in sends)
            out.append(ins)
        # (a tuple here, which `with_programs` keeps: all ranks' lists, then their tuples,
        # were a tenth of a large program's overlap peak)
        return tuple(_batch(out))


def _consumers(prog: Sequence[Instr]) -> dict[tuple[str, int, int], list[int]]:
    """(the tensor consumed, stage, micro-batch) -> the indices of the compute instructions
    that consume it, in program order: forwards (checkpointed ones too) consume activations,
    backwards (whole or input halves) gradients."""
    out: dict[tuple[str, int, int], list[int]] = {}
    for j, ins in enumerate(prog):
        t = type(ins)
        if t is Forward or t is ForwardCheckpoint:
            out.setdefault(("act", ins.stage, ins.mb), []).append(j)  # type: ignore[attr-defined]
        elif t is Backward or t is BackwardInput:
            out.setdefault(("grad", ins.stage, ins.mb), []).append(j)  # type: ignore[attr-defined]
    return out


def _consumer_index(prog: Sequence[Instr], consumers: dict[tuple[str, int, int], list[int]],
                    start: int, r: Recv | IRecv) -> int:
    """The index of the compute instruction that first uses what `r` (at `start`) receives
    (of the first instruction of its overlapped pair, if it is in one)."""
    stage = r.stage + 1 if r.tensor == "act" else r.stage - 1
    at = consumers.get((r.tensor, stage, r.mb), [])
    k = bisect_right(at, start)
    if k == len(at):  # pragma: no cover - lowering always emits the consumer
        return start + 1
    j = at[k]
    while j > 0 and prog[j].paired:
        j -= 1
    return j


def _batch(prog: list[Instr]) -> list[Instr]:
    """Merge runs of adjacent posts to the same peer into one `batch`."""
    out: list[Instr] = []
    run: list[Comm] = []

    def flush() -> None:
        if len(run) > 1:
            out.append(Batch(tuple(run), op=run[0].op, at=run[0].at))
        else:
            out.extend(run)
        run.clear()

    for ins in prog:
        t = type(ins)
        if t is ISend or t is IRecv:
            assert isinstance(ins, Comm)
            if run and run[0].peer != ins.peer:
                flush()
            run.append(ins)
            continue
        if run:
            flush()
        out.append(ins)
    flush()
    return out
