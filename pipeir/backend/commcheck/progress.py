"""Rule 4, *progress* (the package NOTE): all ranks run abstractly to the end; otherwise the
chain of ranks waiting on each other is named."""

from __future__ import annotations

from collections.abc import Callable

from pipeir.backend.commcheck.findings import Channel, Key, Locator, Site, describe
from pipeir.backend.commcheck.programs import is_send, posts
from pipeir.backend.instructions import (
    Comm,
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
    other side has posted the same index (rules 2 and 3 made the indices agree)."""
    progs = lowered.programs
    n = len(progs)
    counts: dict[tuple[bool, Channel], int] = {}
    index: dict[tuple[int, int, int], int] = {}  # (rank, pc, j) -> queue index
    handle: list[dict[tuple[bool, Key], int]] = [{} for _ in range(n)]
    pc = [0] * n

    def channel(rank: int, c: Comm) -> tuple[bool, Channel]:
        send = is_send(c)
        return send, ((rank, c.peer) if send else (c.peer, rank))

    def number(rank: int, at: int, j: int, c: Comm) -> int:
        if (rank, at, j) not in index:
            ch = channel(rank, c)
            index[(rank, at, j)] = counts.get(ch, 0)
            counts[ch] = index[(rank, at, j)] + 1
        return index[(rank, at, j)]

    def blocked_on(rank: int) -> tuple[Comm, int] | None:
        ins = progs[rank][pc[rank]]
        if isinstance(ins, (Send, Recv)):
            return ins, number(rank, pc[rank], 0, ins)
        if isinstance(ins, (WaitSend, WaitRecv)):
            return ins, handle[rank][(isinstance(ins, WaitSend), ins.key)]
        return None

    def done(rank: int, c: Comm, k: int) -> bool:
        send, ch = channel(rank, c)
        return counts.get((not send, ch), 0) > k

    moved = True
    while moved:
        moved = False
        for r in range(n):
            while pc[r] < len(progs[r]):
                w = blocked_on(r)
                if w is not None and not done(r, *w):
                    break
                ins = progs[r][pc[r]]
                if not isinstance(ins, (Send, Recv)):
                    for j, c in enumerate(posts(ins)):
                        handle[r][(is_send(c), c.key)] = number(r, pc[r], j, c)
                pc[r] += 1
                moved = True

    def waits_on(rank: int) -> Comm | None:
        w = blocked_on(rank) if pc[rank] < len(progs[rank]) else None
        return w[0] if w is not None else None

    return pc, waits_on


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
