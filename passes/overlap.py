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

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipeir.backend.instructions import (
    Backward,
    BackwardInput,
    Batch,
    Comm,
    Forward,
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

    max_posted: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_posted, int) or self.max_posted < 0:
            raise OptionError("max_posted", "max_posted must be a non-negative integer "
                                            "(0 = no bound)")

    def run(self, lowered: Lowered, ctx: PassContext = DEFAULT_CONTEXT) -> Lowered:
        """The same programs with asynchronous, early-posted communication."""
        if lowered.overlap:
            return lowered
        return lowered.with_programs([self._rank(p) for p in lowered.programs], overlap=True)

    def _rank(self, prog: Sequence[Instr]) -> list[Instr]:
        recvs = [i for i in prog if isinstance(i, (Recv, IRecv))]
        consumer = {r.key: _consumer_index(prog, r) for r in recvs}
        limit = self.max_posted or len(recvs)
        out: list[Instr] = []
        # Not yet posted, per peer in original order (per-peer FIFO must not change).
        queues: dict[int, list[Recv | IRecv]] = {}
        for r in recvs:
            queues.setdefault(r.peer, []).append(r)
        outstanding: set[tuple[str, int, int]] = set()
        sends: list[Send] = []

        def post_next() -> tuple[str, int, int]:
            # The head (of any peer's queue) whose consumer comes first.
            peer = min((q[0] for q in queues.values() if q), key=lambda r: consumer[r.key]).peer
            r = queues[peer].pop(0)
            out.append(IRecv(r.tensor, r.stage, r.mb, r.peer, r.tag, op=r.op, at=r.at))
            outstanding.add(r.key)
            return r.key

        def post_upto(need: tuple[str, int, int] | None) -> None:
            while any(queues.values()) and len(outstanding) < limit:
                post_next()
            while need is not None and need not in outstanding:
                post_next()  # only when a peer's FIFO order differs from consumer order

        waits_at: dict[int, list[Recv | IRecv]] = {}
        for r in recvs:
            waits_at.setdefault(consumer[r.key], []).append(r)
        for i, ins in enumerate(prog):
            if isinstance(ins, ZeroGrad):
                out.append(ins)
                post_upto(None)
                continue
            for r in waits_at.get(i, []):
                post_upto(r.key)
                out.append(WaitRecv(r.tensor, r.stage, r.mb, r.peer, r.tag, op=r.op, at=r.at))
                outstanding.discard(r.key)
                post_upto(None)
            if isinstance(ins, (Recv, IRecv, WaitRecv)):
                continue
            if isinstance(ins, Send):
                sends.append(ins)
                out.append(ISend(ins.tensor, ins.stage, ins.mb, ins.peer, ins.tag,
                                 op=ins.op, at=ins.at))
                continue
            if isinstance(ins, OptimizerStep):
                out.extend(WaitSend(s.tensor, s.stage, s.mb, s.peer, s.tag, op=s.op, at=s.at)
                           for s in sends)
            out.append(ins)
        return _batch(out)


def _consumer_index(prog: Sequence[Instr], r: Recv | IRecv) -> int:
    """The index of the compute instruction that first uses what `r` receives (of the first
    instruction of its overlapped pair, if it is in one)."""
    start = prog.index(r)
    stage = r.stage + 1 if r.tensor == "act" else r.stage - 1
    kinds = (Forward,) if r.tensor == "act" else (Backward, BackwardInput)
    for j in range(start + 1, len(prog)):
        ins = prog[j]
        if isinstance(ins, kinds) and ins.stage == stage and ins.mb == r.mb:
            while j > 0 and prog[j].paired:
                j -= 1
            return j
    return start + 1  # pragma: no cover - lowering always emits the consumer


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
        if isinstance(ins, (ISend, IRecv)):
            if run and run[0].peer != ins.peer:
                flush()
            run.append(ins)
            continue
        flush()
        out.append(ins)
    flush()
    return out
