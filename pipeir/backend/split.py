"""A rank's program with its receives taken out: the form a rank-local pass that places every
receive itself (the `overlap` pass) works on.

Such a pass keeps everything but the receives where it is and decides where each receive is
posted and waited; what it needs of a program is that rest, the receives (each peer's in
program order: per-peer FIFO matching depends on it; their order across peers says nothing)
and, per receive, the instruction that consumes it. `split_program` finds them in any
program. Lowering knows them as it places communication, and hands them over without
building the program it would have split (`pipeir.backend.lower`'s `split`): at p = 64
(1.3 M instructions) the blocking program made only to be taken apart again was about a
quarter of lowering and overlapping it.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from pipeir.backend.instructions import (
    Backward,
    BackwardInput,
    Comm,
    Forward,
    ForwardCheckpoint,
    Instr,
    IRecv,
    Recv,
    WaitRecv,
)


@dataclass(frozen=True, slots=True)
class Split:
    """One rank's program as `rest` (every instruction but its receives, `recv` or `irecv`,
    and their `wait-recv`s, in program order), `recvs` (each peer's in program order; lowering
    lists them by peer, `split_program` as the program does) and `needs`: per
    receive, the index in `rest` of the compute that consumes it (a forward the activation,
    a whole or input-half backward the gradient), or of the instruction after the receive
    where none does (a hand-written program's)."""

    rest: list[Instr]
    recvs: list[Comm]
    needs: list[int]


def split_program(prog: Sequence[Instr]) -> Split:
    """`prog` as a `Split` (the module docstring): the first consumer after each receive."""
    # NOTE (linear): consumers are found by key and bisection, never by scanning the program
    # (a scan per receive made the overlap pass quadratic: 43 s of a 65k-op compile)
    rest: list[Instr] = []
    recvs: list[Comm] = []
    at: list[int] = []  # per receive, its place in `rest`
    consumers: dict[tuple[str, int, int], list[int]] = {}
    for ins in prog:
        t = type(ins)
        if t is Recv or t is IRecv:
            recvs.append(ins)  # type: ignore[arg-type]
            at.append(len(rest))
            continue
        if t is WaitRecv:
            continue
        # (`type(x) is C`, a fifth of `isinstance`'s cost: none of these has a subclass but
        # Forward, whose one, ForwardCheckpoint, is named)
        if t is Forward or t is ForwardCheckpoint:
            consumers.setdefault(("act", ins.stage, ins.mb), []).append(len(rest))  # type: ignore[attr-defined]
        elif t is Backward or t is BackwardInput:
            consumers.setdefault(("grad", ins.stage, ins.mb), []).append(len(rest))  # type: ignore[attr-defined]
        rest.append(ins)
    needs = []
    for r, start in zip(recvs, at):
        stage = r.stage + 1 if r.tensor == "act" else r.stage - 1
        found = consumers.get((r.tensor, stage, r.mb), ())
        k = bisect_left(found, start)
        needs.append(found[k] if k < len(found) else start)
    return Split(rest, recvs, needs)
