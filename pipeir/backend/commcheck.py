"""The static deadlock proof for lowered programs.

Semantics are the strictest a backend may have: *rendezvous* (a blocking send completes only
once its receive is posted, and a receive once its send is posted) and *per-peer FIFO* matching
(the k-th send from a to b meets the k-th receive on b from a, whatever the tags, as in NCCL).
Posting (isend, irecv, batch) never blocks; a wait blocks until the matching side is posted.

The check runs all ranks abstractly until every program ends (proved) or no rank can move (a
deadlock). A deadlock is reported with the chain of ranks waiting on each other, each link
naming the instruction and the `.sched` line it came from. A receive matched with a send of a
different tensor is reported as a mismatch: under FIFO matching it would corrupt data.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pipeir.backend.lower import (
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
    from_json,
    lower,
)
from pipeir.diagnostics import Diagnostic, Note, UsageError, VerifyError

Channel = tuple[int, int]  # (sender, receiver)

if TYPE_CHECKING:
    from pipeir.schedule import Schedule


@dataclass(frozen=True)
class CommReport:
    """What the proof established: the number of transfers per (sender, receiver) pair."""

    transfers: dict[Channel, int]

    @property
    def total(self) -> int:
        return sum(self.transfers.values())


def _posts(ins: Instr) -> list[Comm]:
    if isinstance(ins, Batch):
        return list(ins.posts)
    if isinstance(ins, (ISend, IRecv, Send, Recv)):
        return [ins]
    return []


def _describe(rank: int, pc: int, ins: Instr) -> str:
    where = f" ({ins.op}, {ins.at})" if ins.at else (f" ({ins.op})" if ins.op else "")
    return f"rank {rank} at #{pc} `{ins.mnemonic} {ins.operands()}`{where}"


def check_comm(lowered: Lowered) -> CommReport:
    """Prove `lowered` cannot deadlock; raise VerifyError(check="comm") otherwise."""
    progs = lowered.programs
    n = len(progs)
    # Per channel: the transfer keys in posting order, on the sending and receiving side.
    sent: dict[Channel, list[tuple[str, int, int]]] = {}
    recvd: dict[Channel, list[tuple[str, int, int]]] = {}
    # Each rank's index into its channel queues for every comm instruction it posts.
    index: list[dict[int, int]] = [{} for _ in range(n)]
    handle: list[dict[tuple[str, str, int, int], int]] = [{} for _ in range(n)]
    pc = [0] * n
    posted_at: list[int] = [-1] * n  # the pc whose blocking op is already posted

    def post(rank: int, c: Comm) -> int:
        send = isinstance(c, (Send, ISend))
        ch = (rank, c.peer) if send else (c.peer, rank)
        q = (sent if send else recvd).setdefault(ch, [])
        q.append(c.key)
        return len(q) - 1

    def matched(rank: int, c: Comm, k: int) -> bool:
        send = isinstance(c, (Send, ISend, WaitSend))
        ch = (rank, c.peer) if send else (c.peer, rank)
        other = (recvd if send else sent).get(ch, [])
        return len(other) > k

    def waiting_on(rank: int) -> tuple[Comm, int] | None:
        """If rank's current instruction blocks, the comm it blocks on and its queue index."""
        ins = progs[rank][pc[rank]]
        if isinstance(ins, (Send, Recv)):
            if posted_at[rank] != pc[rank]:
                index[rank][pc[rank]] = post(rank, ins)
                posted_at[rank] = pc[rank]
            return ins, index[rank][pc[rank]]
        if isinstance(ins, (WaitSend, WaitRecv)):
            key = ("send" if isinstance(ins, WaitSend) else "recv", *ins.key)
            if key not in handle[rank]:
                raise VerifyError(Diagnostic(
                    f"{_describe(rank, pc[rank], ins)} waits for a transfer it never posted"),
                    check="comm")
            return ins, handle[rank][key]
        return None

    progress = True
    while progress:
        progress = False
        for r in range(n):
            while pc[r] < len(progs[r]):
                ins = progs[r][pc[r]]
                w = waiting_on(r)
                if w is not None and not matched(r, *w):
                    break
                for c in _posts(ins) if not isinstance(ins, (Send, Recv)) else ():
                    kind = "send" if isinstance(c, ISend) else "recv"
                    handle[r][(kind, *c.key)] = post(r, c)
                pc[r] += 1
                progress = True
    _check_fifo(sent, recvd)
    stuck = [r for r in range(n) if pc[r] < len(progs[r])]
    if stuck:
        raise VerifyError(_explain(lowered, pc, stuck, waiting_on), check="comm")
    return CommReport({ch: len(q) for ch, q in sorted(sent.items())})


def _check_fifo(sent: dict[Channel, list[tuple[str, int, int]]],
                recvd: dict[Channel, list[tuple[str, int, int]]]) -> None:
    for ch in sorted(set(sent) | set(recvd)):
        a, b = sent.get(ch, []), recvd.get(ch, [])
        for k, (x, y) in enumerate(zip(a, b)):
            if x != y:
                raise VerifyError(Diagnostic(
                    f"rank {ch[0]} -> rank {ch[1]}: transfer #{k} is sent as {_key(x)} but "
                    f"received as {_key(y)}; per-peer FIFO matching would mix them up"),
                    check="comm")


def _key(k: tuple[str, int, int]) -> str:
    return f"{k[0]} of stage {k[1]} mb {k[2]}"


def _explain(lowered: Lowered, pc: list[int], stuck: list[int], waiting_on: object
             ) -> Diagnostic:
    progs = lowered.programs
    assert callable(waiting_on)

    def peer_of(r: int) -> int | None:
        w = waiting_on(r)
        return w[0].peer if w is not None else None

    chain: list[int] = [stuck[0]]
    while True:
        nxt = peer_of(chain[-1])
        if nxt is None or nxt in chain:
            if nxt is not None:
                chain.append(nxt)
            break
        chain.append(nxt)
    notes = []
    for a in chain[:-1] if len(chain) > 1 else chain:
        ins = progs[a][pc[a]]
        peer = peer_of(a)
        tail = (f"; rank {peer} is at #{pc[peer]} `{progs[peer][pc[peer]].mnemonic}`"
                if peer is not None and pc[peer] < len(progs[peer])
                else f"; rank {peer} has finished" if peer is not None else "")
        notes.append(Note(f"{_describe(a, pc[a], ins)} waits for rank {peer}{tail}"))
    cycle = " -> ".join(f"rank {r}" for r in chain)
    return Diagnostic(f"lowered programs of '{lowered.name}' deadlock under rendezvous "
                      f"semantics: {cycle}", None, tuple(notes))


def summary(lowered: Lowered, report: CommReport) -> str:
    kind = "asynchronous (overlap)" if lowered.overlap else "blocking"
    return (f"lowered ok: {report.total} {kind} transfers over {len(report.transfers)} rank "
            f"pairs; deadlock-free under rendezvous semantics with per-peer FIFO matching")


def check_schedule(schedule: Schedule) -> str:
    """Lower `schedule` (blocking communication) and prove it; a one-line summary."""
    lowered = lower(schedule)
    return summary(lowered, check_comm(lowered))


def check_json(path: str) -> str:
    """Prove the lowered programs in a `lowered.json` file; `path: summary`."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a readable JSON file: {e}") from None
    lowered = from_json(data)
    return f"{path}: {summary(lowered, check_comm(lowered))}"
