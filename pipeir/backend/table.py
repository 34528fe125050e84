"""The compact form of one rank's program: an instruction table that the generated rank file
interprets, so that the code written per rank does not grow with the micro-batch count.

A row is `(kind, code, args, slot)`: `code` indexes `CALLS` (the `Context` method, by
mnemonic), `args` are the instruction's own fields in declaration order (exactly what the
straight-line form passes), and `kind` says what happens to the result:

- `CALL`: the result is dropped (`ctx.forward(stage, mb)`);
- `POST`: an `isend`/`irecv` handle, kept in handle slot `slot`;
- `BATCH`: a `batch`'s handles, kept in the slots of the tuple `slot` (one per post);
- `WAIT`: `wait-send`/`wait-recv` of the handle in slot `slot` (the slot is cleared first,
  so a received buffer lives no longer than in the straight-line form, and reused);
- `WAITS`: `wait-sends`, after clearing the slots of the tuple `slot` (every send posted and
  not yet waited: the context keeps them, and waits them all).

NOTE (why a table and not the schedule's loops): lowering places communication by simulated
time (`pipeir.backend.lower`), so a rank's program is not the `.sched` loops unrolled but an
interleaving the loops do not contain; recovering loops from it is pattern matching that
can miss. A table is exact for any program (hand-edited `lowered.json` included), is built
from the same `Lowered` that `check --lowered` proves, and keeps one `ctx` call per row, so
the context's instruction counter still equals the index in the lowered program. The table
is built in the worker from `lowered.json`, never written as code: what runs is what was
proved. Rows are plain tuples of ints and strings (unpacked by the interpreter's `for`
statement, no attribute lookups), which keeps the interpreter's dispatch cost per
instruction to a tuple unpack, one comparison and an indexed call.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from pipeir.backend.instructions import (
    MNEMONICS,
    Batch,
    Comm,
    Instr,
    IRecv,
    ISend,
    Lowered,
    WaitRecv,
    WaitSend,
    WaitSends,
)

#: What the interpreter does with a row's result (module docstring).
CALL, POST, BATCH, WAIT, WAITS = 0, 1, 2, 3, 4

#: The `Context` method of each opcode: the mnemonic with `-` as `_` (`wait-recv` ->
#: `wait_recv`), in `MNEMONICS` order; the generated interpreter binds them in this order.
CALLS: tuple[str, ...] = tuple(m.replace("-", "_") for m in MNEMONICS.values())
_CODE: dict[type, int] = {cls: k for k, cls in enumerate(MNEMONICS)}
_SKIP = ("op", "at", "paired")

Row = tuple[int, int, tuple[Any, ...], Any]
#: Per instruction class, the names of the fields passed to its `Context` method.
_ARGS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls) if f.name not in _SKIP) for cls in MNEMONICS}


def _post_args(c: Comm) -> tuple[str, str, int, int, int, int]:
    return ("send" if isinstance(c, ISend) else "recv", c.tensor, c.stage, c.mb, c.peer,
            c.tag)


def handle_key(c: Comm) -> tuple[bool, str, int, int]:
    """What pairs a post with its wait: (a send?, tensor, stage, micro-batch)."""
    return (isinstance(c, (ISend, WaitSend)), c.tensor, c.stage, c.mb)


def rank_table(lowered: Lowered, rank: int) -> tuple[Row, ...]:
    """Rank `rank`'s program as interpreter rows (module docstring). A wait whose post is
    not in the program (only a hand-edited file has one; `check --lowered` refuses it) gets
    a slot no post fills, and fails at run time naming its instruction like any other."""
    rows: list[Row] = []
    slots: dict[tuple[bool, str, int, int], int] = {}
    free: list[int] = []
    used = 0

    def bind(c: Comm) -> int:
        nonlocal used
        if free:
            slot = free.pop()
        else:
            slot, used = used, used + 1
        slots[handle_key(c)] = slot
        return slot

    for ins in lowered.program(rank):
        cls = type(ins)
        code = _CODE[cls]
        if cls is ISend or cls is IRecv:
            assert isinstance(ins, Comm)
            rows.append((POST, code, _args(ins), bind(ins)))
        elif cls is WaitSend or cls is WaitRecv:
            assert isinstance(ins, Comm)
            key = handle_key(ins)
            if key in slots:
                slot = slots.pop(key)
                free.append(slot)
            else:  # never filled: the wait gets None and fails in the runtime
                slot, used = used, used + 1
            rows.append((WAIT, code, (), slot))
        elif cls is WaitSends:
            sent = [key for key in slots if key[0]]
            rows.append((WAITS, code, (), tuple(slots.pop(key) for key in sent)))
            free.extend(rows[-1][3])
        elif cls is Batch:
            assert isinstance(ins, Batch)
            rows.append((BATCH, code, tuple(_post_args(p) for p in ins.posts),
                         tuple(bind(p) for p in ins.posts)))
        else:
            rows.append((CALL, code, _args(ins), None))
    return tuple(rows)


def _args(ins: Instr) -> tuple[Any, ...]:
    return tuple(getattr(ins, name) for name in _ARGS[type(ins)])
