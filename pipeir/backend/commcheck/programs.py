"""The programs under check (`Programs`), with the look-ups several rules share: the posts of
an instruction, the transfers each side posts per channel, and the transfers the placement
implies."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pipeir.backend.commcheck.findings import Channel, Key, Site
from pipeir.backend.instructions import (
    Batch,
    Comm,
    Instr,
    IRecv,
    ISend,
    Lowered,
    Recv,
    Send,
    WaitSend,
)


def is_send(c: Instr) -> bool:
    """The sending side of a transfer (a send, its post or its wait)."""
    return isinstance(c, (Send, ISend, WaitSend))


def posts(ins: Instr) -> tuple[Comm, ...]:
    """The transfers `ins` posts: a batch's, its own for a send or receive, else none."""
    if isinstance(ins, Batch):
        return ins.posts
    if isinstance(ins, (ISend, IRecv, Send, Recv)):
        return (ins,)
    return ()


class Programs:
    """One set of programs under check, with what several rules look up in them; each rule
    module subclasses it and adds its `rule_*` methods, which yield findings."""

    def __init__(self, lowered: Lowered) -> None:
        self.low = lowered
        self.last = lowered.stages - 1
        self.mbs = lowered.microbatches * lowered.accumulate

    def find(self, rank: int, pred: Callable[[Instr], bool], start: int = 0) -> Site | None:
        """The first instruction of `rank` from `start` on (a batch's posts included) that
        satisfies `pred`."""
        for pc in range(start, len(self.low.programs[rank])):
            for ins in (self.low.programs[rank][pc], *posts(self.low.programs[rank][pc])):
                if pred(ins):
                    return Site(rank, pc, ins)
        return None

    def sides(self) -> tuple[dict[Channel, list[tuple[Key, Site]]],
                             dict[Channel, list[tuple[Key, Site]]]]:
        """Per channel, the sends and the receives in posting order."""
        sent: dict[Channel, list[tuple[Key, Site]]] = {}
        recvd: dict[Channel, list[tuple[Key, Site]]] = {}
        for rank, prog in enumerate(self.low.programs):
            for pc, ins in enumerate(prog):
                for c in posts(ins):
                    send = is_send(c)
                    ch = (rank, c.peer) if send else (c.peer, rank)
                    (sent if send else recvd).setdefault(ch, []).append(
                        (c.key, Site(rank, pc, c)))
        return sent, recvd

    def expected(self) -> Iterator[tuple[Channel, Key]]:
        place = self.low.placement
        for s in range(self.last):
            if place[s] != place[s + 1]:
                for mb in range(self.mbs):
                    yield (place[s], place[s + 1]), ("act", s, mb)
                    yield (place[s + 1], place[s]), ("grad", s + 1, mb)
