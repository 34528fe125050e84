"""The programs under check (`Programs`), with the look-ups several rules share: the posts of
an instruction, the transfers each side posts per channel, and the transfers the placement
implies."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Sequence
from itertools import repeat
from typing import overload

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


class Side(Sequence[Site]):
    """One side of a channel: the transfers one rank posts to it (its sends, or its
    receives), in posting order, each a `Site` when asked for.

    NOTE (memory): the posts and their places, not a site per post: the rank is the side's
    own, and a site (a tuple and its pc, an int object) per post was the largest part of a
    large program's proof. The common paths (`_paired`, the order rule) read `posts` alone;
    sites are made for findings."""

    __slots__ = ("pcs", "posts", "rank")

    def __init__(self, rank: int) -> None:
        self.rank = rank
        #: each post's place in the rank's program (a batch's place, for a post in it)
        self.pcs = array("q")
        #: the posts (`Comm`s: their `key` names the transfer)
        self.posts: list[Comm] = []

    def __len__(self) -> int:
        return len(self.posts)

    @overload
    def __getitem__(self, k: int) -> Site: ...
    @overload
    def __getitem__(self, k: slice) -> Sequence[Site]: ...
    def __getitem__(self, k: int | slice) -> Site | Sequence[Site]:
        if isinstance(k, slice):
            return [self[j] for j in range(len(self))[k]]
        return Site(self.rank, self.pcs[k], self.posts[k])

    def __iter__(self) -> Iterator[Site]:
        return map(Site, repeat(self.rank), self.pcs, self.posts)


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
        self._sides: tuple[dict[Channel, Side], dict[Channel, Side]] | None = None

    def find(self, rank: int, pred: Callable[[Instr], bool], start: int = 0) -> Site | None:
        """The first instruction of `rank` from `start` on (a batch's posts included) that
        satisfies `pred`."""
        for pc in range(start, len(self.low.programs[rank])):
            for ins in (self.low.programs[rank][pc], *posts(self.low.programs[rank][pc])):
                if pred(ins):
                    return Site(rank, pc, ins)
        return None

    def sides(self) -> tuple[dict[Channel, Side], dict[Channel, Side]]:
        """Per channel, the sends and the receives in posting order (computed once); each
        site's `ins` is the post (a `Comm`: its `key` names the transfer). NOTE: sites only,
        not (key, site) pairs: a large program's proof holds two of these per transfer, and
        a key tuple and a pair were more than half of their memory."""
        if self._shared is not None:
            return self._shared.sides()
        if self._sides is None:
            self._sides = self._find_sides()
        return self._sides

    def _find_sides(self) -> tuple[dict[Channel, Side], dict[Channel, Side]]:
        sent: dict[Channel, Side] = {}
        recvd: dict[Channel, Side] = {}
        for rank, prog in enumerate(self.low.programs):
            # per side (receiving, sending: indexed by "is a send"), peer -> its side (no
            # (sending, peer) tuple made and hashed per post)
            mine: tuple[dict[int, Side], dict[int, Side]] = ({}, {})
            for pc, ins in enumerate(prog):
                t = type(ins)
                if t not in SINGLE_POSTS and t is not Batch:
                    continue
                for c in posts(ins):
                    send = type(c) in SENDS
                    side = mine[send].get(c.peer)
                    if side is None:
                        side = mine[send][c.peer] = Side(rank)
                        if send:
                            sent[rank, c.peer] = side
                        else:
                            recvd[c.peer, rank] = side
                    side.pcs.append(pc)
                    side.posts.append(c)
        return sent, recvd

    def expected(self) -> Iterator[tuple[Channel, Key]]:
        place = self.low.placement
        for s in range(self.last):
            if place[s] != place[s + 1]:
                for mb in range(self.mbs):
                    yield (place[s], place[s + 1]), ("act", s, mb)
                    yield (place[s + 1], place[s]), ("grad", s + 1, mb)
