"""`overlap{max_posted=K}`: asynchronous communication on lowered programs.

- every receive (a blocking `recv`, or the `irecv` and `wait-recv` of the default lowering)
  becomes an `irecv` posted early and a `wait-recv` right before the instruction that consumes
  it (before the whole pair when the consumer is half of an overlapped pair). Receives are
  posted earliest consumer first, keeping each peer's receives in their original order (so
  per-peer FIFO matching is unchanged), at most K ahead of their waits (K = 0: no bound, all
  posted at the start of the step, one `batch` per peer). Receives consumed by one pair are
  waited, and at equal consumers posted, in the order the pair consumes them. Only when two
  receives from one peer are consumed in the opposite order of their sends can K be
  exceeded, since per-peer posting order cannot change;
- every blocking send becomes an `isend` where it was, and one `wait-sends` before the
  optimizer step waits for them all (send buffers are never reused within a step, so nothing
  needs them sooner: torch's runtime waits its sends there too);
- posts to the same peer at the same point become one `batch` (`batch_isend_irecv`).

The result is proved deadlock-free by `pipeir.backend.commcheck` like any lowered program.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pipeir.backend.instructions import (
    Batch,
    Comm,
    Instr,
    IRecv,
    ISend,
    Lowered,
    OptimizerStep,
    Send,
    WaitRecv,
    WaitSends,
    ZeroGrad,
    builder,
)
from pipeir.backend.split import Split, split_program
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
    splits: ClassVar[bool] = True

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
        return self.run_split(split_program(prog))

    def run_split(self, split: Split) -> tuple[Instr, ...]:
        """`run_rank` of the program `split` was made from: all it reads of a program
        (lowering hands it over without making the program, `pipeir.backend.split`)."""
        rest, recvs, needs = split.rest, split.recvs, split.needs
        wait_recv, isend = builder(WaitRecv), builder(ISend)
        # A receive is waited right before its consumer, or before the consumer's whole
        # overlapped pair
        consumer = list(needs)
        n = len(rest)
        for j, c in enumerate(consumer):
            while 0 < c < n and rest[c].paired:
                c -= 1
            consumer[j] = c
        limit = self.max_posted or len(recvs)
        # Not yet posted, per peer in original order (per-peer FIFO must not change).
        queues: dict[int, deque[int]] = {}
        for j, r in enumerate(recvs):
            queues.setdefault(r.peer, deque()).append(j)
        # NOTE (order): the queues' heads by (consumer, the consuming instruction, peer): a
        # total order that depends only on each peer's order of receives and on where they
        # are consumed, which lowering knows without the order it would have given all
        # receives (and which `_post_early` changes); a heap, so that a post does not
        # visit every peer.
        heads = [(consumer[q[0]], needs[q[0]], peer) for peer, q in queues.items()]
        heapq.heapify(heads)
        posted = bytearray(len(recvs))
        ahead = 0  # posted and not yet waited
        sends = False  # a blocking send became an `isend`
        out: list[Instr] = []
        # NOTE (one pass): posts to one peer that end up adjacent are merged into a `batch`
        # as they are emitted (`run`, flushed before anything else is), not in a second pass
        # over the program
        run: list[Comm] = []

        def flush() -> None:
            if len(run) > 1:
                out.append(Batch(tuple(run), op=run[0].op, at=run[0].at))
            else:
                out.extend(run)
            run.clear()
        # (below, a run of one post is emitted inline: `flush` was called before most
        # instructions of a program)

        def post_next() -> None:
            # The head (of any peer's queue) whose consumer comes first.
            nonlocal ahead
            _, _, peer = heapq.heappop(heads)
            q = queues[peer]
            j = q.popleft()
            if q:
                heapq.heappush(heads, (consumer[q[0]], needs[q[0]], peer))
            if run and run[0].peer != peer:
                flush()
            run.append(_post(recvs[j]))
            posted[j] = 1
            ahead += 1

        def post_upto(need: int | None) -> None:
            while heads and ahead < limit:
                post_next()
            while need is not None and not posted[need]:
                post_next()  # only when a peer's FIFO order differs from consumer order

        waits_at: dict[int, list[int]] = {}
        for j, c in enumerate(consumer):
            at = waits_at.get(c)
            if at is None:
                waits_at[c] = [j]
            else:  # (a pair consuming two tensors: waited in the order they are consumed)
                at.append(j)
                at.sort(key=lambda j: (needs[j], recvs[j].peer))
        # (`type(x) is C`, a fifth of `isinstance`'s cost on every instruction: none of
        # these classes has a subclass)
        for i, ins in enumerate(rest):
            t = type(ins)
            waiting = waits_at.get(i)
            if waiting is not None:
                for j in waiting:
                    if not posted[j] or (heads and ahead < limit):
                        post_upto(j)
                    if run:
                        if len(run) == 1:
                            out.append(run.pop())
                        else:
                            flush()
                    r = recvs[j]
                    out.append(wait_recv(r.tensor, r.stage, r.mb, r.peer, r.tag, r.op,
                                         r.at, False))
                    ahead -= 1
                    if heads and ahead < limit:
                        post_upto(None)
            if t is Send or t is ISend:
                assert isinstance(ins, Comm)
                if t is Send:
                    sends = True
                    ins = isend(ins.tensor, ins.stage, ins.mb, ins.peer, ins.tag, ins.op,
                                ins.at, False)
                if run and run[0].peer != ins.peer:
                    flush()
                run.append(ins)
                continue
            if run:
                if len(run) == 1:
                    out.append(run.pop())
                else:
                    flush()
            if t is OptimizerStep and sends:
                out.append(WaitSends())
            out.append(ins)
            if t is ZeroGrad:
                if limit < len(recvs):
                    post_upto(None)
                    continue
                # NOTE (no bound): every receive is posted here, so their order across peers
                # changes nothing (posting never blocks, and matching is per peer): each
                # peer's are one `batch`, in its order, the peer whose receive is consumed
                # first first. A post each in consumer order was a quarter of a large
                # program's instructions, for every later layer to walk.
                for _, _, peer in sorted(heads):
                    run.extend(_post(recvs[j]) for j in queues[peer])
                    flush()
                posted = bytearray(b"\x01") * len(recvs)
                ahead, heads = len(recvs), []
        flush()
        # (a tuple here, which `with_programs` keeps: all ranks' lists, then their tuples,
        # were a tenth of a large program's overlap peak)
        return tuple(out)


def _post(r: Comm) -> IRecv:
    """The `irecv` that posts receive `r` (an unpaired `irecv` is its own: kept, not built
    again)."""
    if type(r) is IRecv and not r.paired:
        return r
    return IRecv(r.tensor, r.stage, r.mb, r.peer, r.tag, op=r.op, at=r.at)
