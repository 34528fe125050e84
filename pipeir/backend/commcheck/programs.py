"""The programs under check (`Programs`), with the look-ups several rules share: the posts of
an instruction, the transfers each side posts per channel, and the transfers the placement
implies."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from pipeir.backend.commcheck.findings import Channel, Key, Site
from pipeir.backend.instructions import (
    COMPUTE,
    Batch,
    Comm,
    ForwardCheckpoint,
    Instr,
    IRecv,
    ISend,
    Lowered,
    Recv,
    Send,
    WaitSend,
)

#: NOTE: the instruction set is closed by exact type (`MNEMONICS` is keyed by it, so a
#: subclass would have no mnemonic and could be neither printed nor written): these look-ups
#: test `type(...)` in a set, several times cheaper than `isinstance` over a tuple, and they
#: run for every instruction of every rule.
SENDS = frozenset({Send, ISend, WaitSend})
SINGLE_POSTS = frozenset({ISend, IRecv, Send, Recv})
#: the compute instructions (COMPUTE with its subclass)
COMPUTE_TYPES = frozenset({*COMPUTE, ForwardCheckpoint})


def is_send(c: Instr) -> bool:
    """The sending side of a transfer (a send, its post or its wait)."""
    return type(c) in SENDS


def posts(ins: Instr) -> tuple[Comm, ...]:
    """The transfers `ins` posts: a batch's, its own for a send or receive, else none."""
    t = type(ins)
    if t in SINGLE_POSTS:
        return (ins,)  # type: ignore[return-value]
    if t is Batch:
        return ins.posts  # type: ignore[attr-defined, no-any-return]
    return ()


class Programs:
    """One set of programs under check, with what several rules look up in them; each rule
    module subclasses it and adds its `rule_*` methods, which yield findings."""

    def __init__(self, lowered: Lowered, shared: Programs | None = None) -> None:
        """`shared`: other rules' view of the same programs, whose look-ups this one reuses
        instead of computing them again."""
        self.low = lowered
        self.last = lowered.stages - 1
        self.mbs = lowered.microbatches * lowered.accumulate
        self._shared = shared
        self._sides: tuple[dict[Channel, list[Site]], dict[Channel, list[Site]]] | None = None

    def find(self, rank: int, pred: Callable[[Instr], bool], start: int = 0) -> Site | None:
        """The first instruction of `rank` from `start` on (a batch's posts included) that
        satisfies `pred`."""
        for pc in range(start, len(self.low.programs[rank])):
            for ins in (self.low.programs[rank][pc], *posts(self.low.programs[rank][pc])):
                if pred(ins):
                    return Site(rank, pc, ins)
        return None

    def sides(self) -> tuple[dict[Channel, list[Site]], dict[Channel, list[Site]]]:
        """Per channel, the sends and the receives in posting order (computed once); each
        site's `ins` is the post (a `Comm`: its `key` names the transfer). NOTE: sites only,
        not (key, site) pairs: a large program's proof holds two of these per transfer, and
        a key tuple and a pair were more than half of their memory."""
        if self._shared is not None:
            return self._shared.sides()
        if self._sides is None:
            self._sides = self._find_sides()
        return self._sides

    def _find_sides(self) -> tuple[dict[Channel, list[Site]], dict[Channel, list[Site]]]:
        sent: dict[Channel, list[Site]] = {}
        recvd: dict[Channel, list[Site]] = {}
        for rank, prog in enumerate(self.low.programs):
            for pc, ins in enumerate(prog):
                for c in posts(ins):
                    send = is_send(c)
                    ch = (rank, c.peer) if send else (c.peer, rank)
                    (sent if send else recvd).setdefault(ch, []).append(Site(rank, pc, c))
        return sent, recvd

    def expected(self) -> Iterator[tuple[Channel, Key]]:
        place = self.low.placement
        for s in range(self.last):
            if place[s] != place[s + 1]:
                for mb in range(self.mbs):
                    yield (place[s], place[s + 1]), ("act", s, mb)
                    yield (place[s + 1], place[s]), ("grad", s + 1, mb)
