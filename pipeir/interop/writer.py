"""Export schedules to torch.distributed.pipelining's CSV, for `_PipelineScheduleRuntime._load_csv`.

Two formats, as torch names them:

* ``compute_only``: each rank's F/B/I/W in program order, an overlapped pair as
  `(a;b)OVERLAP_F_B`. torch adds REDUCE_GRAD and the communication itself when it loads it.
* ``compute_comms``: the same plus REDUCE_GRAD after each stage's last backward and every
  SEND/RECV, placed exactly as torch's own lowering (`_add_send_recv`) places them: ranks take
  turns in rank order; a rank appends its next compute action once its inputs are available
  (received or produced locally), followed by the action's sends, and the matching receive is
  appended to the receiving rank at the same moment. So a file pipeir writes loads and runs
  in torch exactly as if torch had lowered the compute-only file, and idle cells are dropped.

FSDP's UNSHARD/RESHARD are not written: without FSDP they do nothing.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from typing import Final

from pipeir.diagnostics import UsageError
from pipeir.interop.actions import FORMATS, OVERLAP, Action
from pipeir.ops import MEMORY_KINDS
from pipeir.schedule import Schedule, expect_schedule
from pipeir.verify import verify

__all__ = ["FORMATS", "comms_actions", "compute_actions", "dumps_csv"]

_B_LIKE: Final = ("B", "I")


def compute_actions(schedule: Schedule) -> list[list[Action]]:
    """Each rank's compute actions in program order (pairs become OVERLAP_F_B)."""
    expect_schedule(schedule, "compute_actions")
    memory = next((op for op in schedule if op.kind in MEMORY_KINDS), None)
    if memory is not None:
        raise UsageError(f"torch's schedule format has no {memory.kind} (activation "
                         f"recomputation and offloading are pipeir ops); {memory} cannot be "
                         "exported", schedule.span_of(memory))
    out: list[list[Action]] = []
    for prog in schedule.programs:
        row: list[Action] = []
        skip = False
        for op in prog:
            if skip:
                skip = False
                continue
            partner = schedule.pair_next(op)
            if partner is not None:
                row.append(Action(-1, OVERLAP, None, (_act(op.kind, op.stage, op.mb),
                                                      _act(partner.kind, partner.stage,
                                                           partner.mb))))
                skip = True
            else:
                row.append(_act(op.kind, op.stage, op.mb))
        out.append(row)
    return out


def _act(kind: str, stage: int, mb: int | None) -> Action:
    if kind == "R":  # the gradient all-reduce
        return Action(stage, "REDUCE_GRAD")
    return Action(stage, kind, mb)


def _with_reduce_grad(row: list[Action], microbatches: int) -> list[Action]:
    """torch's `_add_reduce_grad`: REDUCE_GRAD right after a stage's m-th B or W (unless the
    schedule places its own: R ops)."""
    if any(a.kind == "REDUCE_GRAD" for a in row):
        return row
    count: dict[int, int] = {}
    out: list[Action] = []
    for a in row:
        out.append(a)
        for x in a.sub or (a,):
            if x.kind in ("B", "W"):
                count[x.stage] = count.get(x.stage, 0) + 1
                if count[x.stage] == microbatches:
                    out.append(Action(x.stage, "REDUCE_GRAD"))
    return out


def comms_actions(schedule: Schedule) -> list[list[Action]]:
    """Compute, REDUCE_GRAD and SEND/RECV actions per rank, in torch's `_add_send_recv` order,
    of a schedule verified first (its transfers follow from its placement: a schedule missing
    an op would export the sends of work it never does)."""
    expect_schedule(schedule, "comms_actions")
    verify(schedule)
    cfg = schedule.config
    place, last = cfg.placement, cfg.stages - 1

    def crosses(a: Action) -> bool:
        if a.kind == "F":
            return a.stage != last and place[a.stage + 1] != place[a.stage]
        if a.kind in _B_LIKE:
            return a.stage != 0 and place[a.stage - 1] != place[a.stage]
        return False

    def ready(a: Action, seen: set[tuple[int, str, int | None]]) -> bool:
        if a.kind == "F" and a.stage != 0:
            return (a.stage, "RECV_F", a.mb) in seen or (a.stage - 1, "F", a.mb) in seen
        if a.kind in _B_LIKE and a.stage != last:
            return ((a.stage, "RECV_B", a.mb) in seen or (a.stage + 1, "I", a.mb) in seen
                    or (a.stage + 1, "B", a.mb) in seen)
        return True

    todo = [_with_reduce_grad(row, cfg.microbatches) for row in compute_actions(schedule)]
    out: list[list[Action]] = [[] for _ in todo]
    seen: list[set[tuple[int, str, int | None]]] = [set() for _ in todo]
    heads = [0] * len(todo)
    while any(h < len(row) for h, row in zip(heads, todo)):
        progress = False
        for r, row in enumerate(todo):
            if heads[r] >= len(row):
                continue
            action = row[heads[r]]
            parts = action.sub or (action,)
            if not all(ready(a, seen[r]) for a in parts):
                continue
            out[r].append(action)
            for a in parts:
                seen[r].add((a.stage, a.kind, a.mb))
                if crosses(a):
                    fwd = a.kind == "F"
                    send = Action(a.stage, "SEND_F" if fwd else "SEND_B", a.mb)
                    recv = Action(a.stage + 1 if fwd else a.stage - 1,
                                  "RECV_F" if fwd else "RECV_B", a.mb)
                    out[r].append(send)
                    seen[r].add((send.stage, send.kind, send.mb))
                    dst = place[recv.stage]
                    out[dst].append(recv)
                    seen[dst].add((recv.stage, recv.kind, recv.mb))
            heads[r] += 1
            progress = True
        if not progress:  # pragma: no cover - a verified schedule always makes progress
            raise AssertionError("cannot place sends and receives: the schedule deadlocks")
    return out


def dumps_csv(schedule: Schedule, format: str = "compute_only") -> str:
    """The CSV text torch's `_load_csv(path, format)` reads (rows end in CRLF, as torch's
    `csv.writer` writes them)."""
    if format not in FORMATS:
        raise UsageError(f"unknown format '{format}' (expected {' or '.join(FORMATS)})")

    if format == "compute_only":
        verify(schedule)
        return rows_to_csv(compute_actions(schedule))
    return rows_to_csv(comms_actions(schedule))  # (which verifies)


def rows_to_csv(rows: Sequence[Sequence[Action | None]]) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf)
    for row in rows:
        writer.writerow(["" if a is None else str(a) for a in row])
    return buf.getvalue()

