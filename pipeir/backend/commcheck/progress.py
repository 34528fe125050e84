"""Rule 4, *progress* (the package NOTE): all ranks run abstractly to the end; otherwise the
chain of ranks waiting on each other is named."""

from __future__ import annotations

from array import array
from collections.abc import Callable

from pipeir.backend.commcheck.findings import Channel, Key, Locator, Site, describe
from pipeir.backend.commcheck.programs import is_send
from pipeir.backend.instructions import (
    Batch,
    Instr,
    IRecv,
    ISend,
    Lowered,
    Recv,
    Send,
    WaitRecv,
    WaitSend,
    WaitSends,
)
from pipeir.diagnostics import Diagnostic, Note


def run(lowered: Lowered) -> tuple[list[int], Callable[[int], int | None]]:
    """Execute all ranks abstractly; the final pcs and, per rank, the peer it waits on.

    Each post gets its index in its channel's queue; a blocking call or wait is done once the
    other side has posted more than that index (rules 2 and 3 made the indices agree).

    NOTE: one side of a channel is posted by one rank only (the sender's sends, the
    receiver's receives), in its program order, so every post's index is known before the
    run: `_steps` numbers them once, and the run itself only counts posts per channel and
    compares integers. A blocking send or receive is posted when its rank reaches it, before
    it waits. A `wait-sends` waits, per peer, for the receive of the last send posted to it
    (per-pair FIFO: the earlier ones are matched by then)."""
    progs = lowered.programs
    n = len(progs)
    channels: dict[tuple[bool, Channel], int] = {}
    steps = [_steps(r, prog, channels) for r, prog in enumerate(progs)]
    counts = [0] * len(channels)
    pc = [0] * n
    reached = [False] * n  # the rank's current blocking post is posted already
    moved = True
    while moved:
        moved = False
        for r in range(n):
            needs, indices, posts, batches, alls = steps[r]
            i, end = pc[r], len(needs)
            while i < end:
                if not reached[r]:
                    p = posts[i]
                    if p >= 0:
                        counts[p] += 1
                        moved = True
                    elif p < -1:
                        for c in batches[-2 - p]:
                            counts[c] += 1
                        moved = True
                need = needs[i]
                if need >= 0:
                    if counts[need] <= indices[i]:
                        reached[r] = True
                        break
                elif need < -1 and any(counts[c] <= k for c, k, _ in alls[-2 - need]):
                    reached[r] = True
                    break
                reached[r] = False
                i += 1
                moved = True
            pc[r] = i

    def waits_on(rank: int) -> int | None:
        if pc[rank] >= len(progs[rank]):
            return None
        ins = progs[rank][pc[rank]]
        if type(ins) is WaitSends:
            alls = steps[rank][4][-2 - steps[rank][0][pc[rank]]]
            return next((peer for c, k, peer in alls if counts[c] <= k), None)
        return ins.peer if type(ins) in _WAITING else None  # type: ignore[attr-defined]

    return pc, waits_on


#: What a rank can wait at (by exact type: `programs.py`'s NOTE).
_WAITING = frozenset({Send, Recv, WaitSend, WaitRecv})  # (and `wait-sends`)
#: The index a wait without a post waits for (rule 1 reports such a wait first).
_NEVER = 2**31 - 1
#: A rank's steps, one per instruction, as three columns: the channel side it waits on (-1:
#: none; -2 - j: each (side, index, peer) of `alls[j]`, a `wait-sends`), the index there that
#: must be posted, and what it posts (a channel side; -1: nothing; -2 - j: the sides of
#: `batches[j]`, a batch's posts), then `batches` and `alls`.
#: NOTE (memory): columns of 32-bit integers, not a tuple per instruction: a wait's tuple
#: and its index (an int object) were the largest part of a large program's proof.
Steps = tuple["array[int]", "array[int]", "array[int]", list[tuple[int, ...]],
              list[tuple[tuple[int, int, int], ...]]]


def _steps(rank: int, prog: tuple[Instr, ...], channels: dict[tuple[bool, Channel], int]
           ) -> Steps:
    """Per instruction of `rank`: the channel side it waits on (-1: none) and the index there
    that must be posted, and the channel sides it posts to (numbered in `channels`)."""
    # per side (receiving, sending; indexed by "is a send"), (a few peers per rank) -> its
    # side and the other side: made once per side, shared by every transfer (a large
    # program has hundreds of thousands). NOTE: per side, keyed by peer, and a post's index
    # per side keyed by transfer: a (send, ...) tuple made and hashed per instruction was a
    # sixth of this walk.
    sides: tuple[dict[int, tuple[int, int]], dict[int, tuple[int, int]]] = ({}, {})

    def side(send: bool, peer: int) -> tuple[int, int]:
        found = sides[send].get(peer)
        if found is None:
            ch = (rank, peer) if send else (peer, rank)
            mine = channels.setdefault((send, ch), len(channels))
            theirs = channels.setdefault((not send, ch), len(channels))
            found = sides[send][peer] = (mine, theirs)
        return found

    own: dict[int, int] = {}  # channel side -> posts so far
    handle: tuple[dict[Key, int], dict[Key, int]] = ({}, {})  # a post's index, for its wait
    needs, indices, posts = array("i"), array("i"), array("i")
    batches: list[tuple[int, ...]] = []
    alls: list[tuple[tuple[int, int, int], ...]] = []
    need, index, post = needs.append, indices.append, posts.append
    # (a side's look-up is inline, `side` only makes it: this visits every instruction)
    for ins in prog:
        t = type(ins)
        if t is Send or t is Recv:
            send, peer = t is Send, ins.peer  # type: ignore[attr-defined]
            mine, theirs = sides[send].get(peer) or side(send, peer)
            k = own.get(mine, 0)
            own[mine] = k + 1
            need(theirs)
            index(k)
            post(mine)
        elif t is WaitSend or t is WaitRecv:
            send, peer = t is WaitSend, ins.peer  # type: ignore[attr-defined]
            theirs = (sides[send].get(peer) or side(send, peer))[1]
            # (rule 1 proved every wait follows its post; none would wait forever)
            need(theirs)
            index(handle[send].get((ins.tensor, ins.stage, ins.mb), _NEVER))  # type: ignore[attr-defined]
            post(-1)
        elif t is ISend or t is IRecv:
            send, peer = t is ISend, ins.peer  # type: ignore[attr-defined]
            mine = (sides[send].get(peer) or side(send, peer))[0]
            k = own.get(mine, 0)
            own[mine] = k + 1
            handle[send][(ins.tensor, ins.stage, ins.mb)] = k  # type: ignore[attr-defined]
            need(-1)
            index(0)
            post(mine)
        elif t is WaitSends:  # per peer sent to, the last send's index
            need(-2 - len(alls))
            index(0)
            post(-1)
            alls.append(tuple((theirs, own[mine] - 1, peer)
                              for peer, (mine, theirs) in sides[True].items()
                              if own.get(mine, 0)))
        elif t is not Batch:
            need(-1)  # (a compute)
            index(0)
            post(-1)
        else:
            posted = []
            for c in ins.posts:  # type: ignore[attr-defined]
                send = is_send(c)
                mine = (sides[send].get(c.peer) or side(send, c.peer))[0]
                k = own.get(mine, 0)
                own[mine] = k + 1
                handle[send][(c.tensor, c.stage, c.mb)] = k
                posted.append(mine)
            need(-1)
            index(0)
            if len(posted) == 1:
                post(posted[0])
            else:
                post(-2 - len(batches))
                batches.append(tuple(posted))
    return needs, indices, posts, batches, alls


def explain(lowered: Lowered, pc: list[int], stuck: list[int],
             waits_on: Callable[[int], int | None], loc: Locator) -> Diagnostic:
    progs = lowered.programs
    chain: list[int] = [stuck[0]]
    while True:
        nxt = waits_on(chain[-1])
        if nxt is None or nxt in chain:
            if nxt is not None:
                chain.append(nxt)
            break
        chain.append(nxt)
    notes = []
    for a in chain[:-1] if len(chain) > 1 else chain:
        peer = waits_on(a)
        tail = (f"; rank {peer} is at #{pc[peer]} `{progs[peer][pc[peer]].mnemonic}`"
                if peer is not None and pc[peer] < len(progs[peer])
                else f"; rank {peer} has finished" if peer is not None else "")
        site = Site(a, pc[a], progs[a][pc[a]])
        notes.append(Note(f"{describe(site)} waits for rank {peer}{tail}", loc.span(site)))
    cycle = " -> ".join(f"rank {r}" for r in chain)
    first = Site(chain[0], pc[chain[0]], progs[chain[0]][pc[chain[0]]])
    return Diagnostic(f"lowered programs of '{lowered.name}' deadlock under rendezvous "
                      f"semantics: {cycle}", loc.span(first), tuple(notes))
