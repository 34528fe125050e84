"""Rule 4, *progress* (the package NOTE): all ranks run abstractly to the end; otherwise the
chain of ranks waiting on each other is named."""

from __future__ import annotations

from collections.abc import Callable

from pipeir.backend.commcheck.findings import Channel, Key, Locator, Site, describe
from pipeir.backend.commcheck.programs import is_send
from pipeir.backend.instructions import (
    Batch,
    Comm,
    Instr,
    IRecv,
    ISend,
    Lowered,
    Recv,
    Send,
    WaitRecv,
    WaitSend,
)
from pipeir.diagnostics import Diagnostic, Note


def run(lowered: Lowered) -> tuple[list[int], Callable[[int], Comm | None]]:
    """Execute all ranks abstractly; the final pcs and, per rank, what it waits on.

    Each post gets its index in its channel's queue; a blocking call or wait is done once the
    other side has posted more than that index (rules 2 and 3 made the indices agree).

    NOTE: one side of a channel is posted by one rank only (the sender's sends, the
    receiver's receives), in its program order, so every post's index is known before the
    run: `_steps` numbers them once, and the run itself only counts posts per channel and
    compares integers. A blocking send or receive is posted when its rank reaches it, before
    it waits."""
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
            mine, i, end = steps[r], pc[r], len(steps[r])
            while i < end:
                need, k, posted = mine[i]
                if not reached[r]:
                    for c in posted:
                        counts[c] += 1
                    if posted:
                        moved = True
                if need >= 0 and counts[need] <= k:
                    reached[r] = True
                    break
                reached[r] = False
                i += 1
                moved = True
            pc[r] = i

    def waits_on(rank: int) -> Comm | None:
        if pc[rank] >= len(progs[rank]):
            return None
        ins = progs[rank][pc[rank]]
        return ins if type(ins) in _WAITING else None  # type: ignore[return-value]

    return pc, waits_on


#: What a rank can wait at (by exact type: `programs.py`'s NOTE).
_WAITING = frozenset({Send, Recv, WaitSend, WaitRecv})
#: One instruction's step: the channel side it waits on (-1: none), the index there that
#: must be posted, and the sides it posts to.
Step = tuple[int, int, tuple[int, ...]]
_NOTHING: Step = (-1, 0, ())


def _steps(rank: int, prog: tuple[Instr, ...], channels: dict[tuple[bool, Channel], int]
           ) -> list[Step]:
    """Per instruction of `rank`: the channel side it waits on (-1: none) and the index there
    that must be posted, and the channel sides it posts to (numbered in `channels`)."""
    # (a few peers per rank) -> its side, the other side, what a blocking send or receive
    # posts there, and the step of a post there alone: made once per side, shared by every
    # transfer (a large program has hundreds of thousands)
    sides: dict[tuple[bool, int], tuple[int, int, tuple[int], Step]] = {}

    def side(send: bool, peer: int) -> tuple[int, int, tuple[int], Step]:
        found = sides.get((send, peer))
        if found is None:
            ch = (rank, peer) if send else (peer, rank)
            mine = channels.setdefault((send, ch), len(channels))
            theirs = channels.setdefault((not send, ch), len(channels))
            found = sides[send, peer] = (mine, theirs, (mine,), (-1, 0, (mine,)))
        return found

    own: dict[int, int] = {}  # channel side -> posts so far
    handle: dict[tuple[bool, Key], int] = {}  # a post's index, for its wait
    out: list[Step] = []
    # (a side's look-up is inline, `side` only makes it: this visits every instruction)
    for ins in prog:
        t = type(ins)
        if t is Send or t is Recv:
            send, peer = t is Send, ins.peer  # type: ignore[attr-defined]
            mine, theirs, posts_mine, _ = sides.get((send, peer)) or side(send, peer)
            k = own.get(mine, 0)
            own[mine] = k + 1
            out.append((theirs, k, posts_mine))
        elif t is WaitSend or t is WaitRecv:
            send, peer = t is WaitSend, ins.peer  # type: ignore[attr-defined]
            theirs = (sides.get((send, peer)) or side(send, peer))[1]
            # (rule 1 proved every wait follows its post; none would wait forever)
            out.append((theirs, handle.get(
                (send, (ins.tensor, ins.stage, ins.mb)), 1 << 62), ()))  # type: ignore[attr-defined]
        elif t is ISend or t is IRecv:
            send, peer = t is ISend, ins.peer  # type: ignore[attr-defined]
            mine, _, _, alone = sides.get((send, peer)) or side(send, peer)
            k = own.get(mine, 0)
            own[mine] = k + 1
            handle[(send, (ins.tensor, ins.stage, ins.mb))] = k  # type: ignore[attr-defined]
            out.append(alone)
        elif t is not Batch:
            out.append(_NOTHING)  # (one shared step for every compute)
        else:
            posted = []
            for c in ins.posts:  # type: ignore[attr-defined]
                send = is_send(c)
                mine, _, _, alone = sides.get((send, c.peer)) or side(send, c.peer)
                k = own.get(mine, 0)
                own[mine] = k + 1
                handle[(send, c.key)] = k
                posted.append(mine)
            out.append(alone if len(posted) == 1 else (-1, 0, tuple(posted)))
    return out


def explain(lowered: Lowered, pc: list[int], stuck: list[int],
             waits_on: Callable[[int], Comm | None], loc: Locator) -> Diagnostic:
    progs = lowered.programs
    chain: list[int] = [stuck[0]]
    while True:
        c = waits_on(chain[-1])
        nxt = c.peer if c is not None else None
        if nxt is None or nxt in chain:
            if nxt is not None:
                chain.append(nxt)
            break
        chain.append(nxt)
    notes = []
    for a in chain[:-1] if len(chain) > 1 else chain:
        c = waits_on(a)
        peer = c.peer if c is not None else None
        tail = (f"; rank {peer} is at #{pc[peer]} `{progs[peer][pc[peer]].mnemonic}`"
                if peer is not None and pc[peer] < len(progs[peer])
                else f"; rank {peer} has finished" if peer is not None else "")
        site = Site(a, pc[a], progs[a][pc[a]])
        notes.append(Note(f"{describe(site)} waits for rank {peer}{tail}", loc.span(site)))
    cycle = " -> ".join(f"rank {r}" for r in chain)
    first = Site(chain[0], pc[chain[0]], progs[chain[0]][pc[chain[0]]])
    return Diagnostic(f"lowered programs of '{lowered.name}' deadlock under rendezvous "
                      f"semantics: {cycle}", loc.span(first), tuple(notes))
