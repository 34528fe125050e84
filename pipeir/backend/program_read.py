"""Reading lowered programs back: `load` reads a `lowered.json` (`pipeirc check --lowered`, a
compiled directory's main.py) and `from_json` its parsed JSON, checking a hand-edited file
value by value before anything runs on it (the format: `pipeir.backend.program_io`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import fields
from typing import Any, get_args

from pipeir import jsonread, limits
from pipeir._gc import paused_gc
from pipeir.backend.instructions import (
    BUILD,
    BY_MNEMONIC,
    MNEMONICS,
    Instr,
    IRecv,
    ISend,
    Lowered,
)
from pipeir.backend.program_io import (
    BOOL,
    COLUMNS,
    FLOAT,
    HINTS,
    INT,
    PAIRED,
    POSTS,
    PROVED,
    STR,
    VERSION,
    columns_json,
    kind_of,
)
from pipeir.diagnostics import Source, Span, UsageError

# NOTE (reading lowered JSON): a lowered.json may be edited by hand, so `from_json` checks
# its shape and types before building anything: the rules of `commcheck` compare stages and
# micro-batches with numbers, and a string or list there was a TypeError traceback. Integers
# are 64-bit and non-negative (bool, a subclass of int, is refused), the header's sizes are
# positive and agree with the placement and the number of programs. Ranges against the header
# (a micro-batch past the count, a peer that runs no such stage) are findings of the checks,
# which name the instruction in their own words. A fault is raised as `_Fault` with the JSON
# path of the value it is about; `from_json` turns it into a UsageError at that value's line
# and column when it has the file's text (a hand-edited file is edited in an editor).


class _Fault(Exception):
    """A malformed lowered JSON value: the message and the path of the value."""

    def __init__(self, path: jsonread.Path, message: str) -> None:
        super().__init__(message)
        self.path, self.message = path, message


_SIZES = ("ranks", "stages", "microbatches", "accumulate")


def _shown(value: object) -> str:
    """A JSON value as the file spells it, shortened."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _wanted(value: object, hint: Any) -> str | None:
    """What a field of type `hint` must be, when `value` is not that; None when it is."""
    if hint is int:
        ok = type(value) is int and 0 <= value <= limits.MAX_INT
        return None if ok else "a non-negative integer (64-bit)"
    if hint is float:
        ok = (type(value) is float and math.isfinite(value)) or \
            (type(value) is int and not limits.int_overflow(value))
        return None if ok else "a finite number"
    if hint is str:
        return None if type(value) is str else "a string"
    if hint is bool:
        return None if type(value) is bool else "true or false"
    choices = get_args(hint)  # a Literal
    if type(value) is str and value in choices:
        return None
    return "one of " + ", ".join(json.dumps(c) for c in choices)


def _row_from(row: object, where: str, path: jsonread.Path, origins: list[tuple[str, str]],
              in_batch: bool = False) -> Instr:
    """One instruction row at `path` (the NOTE on the instruction table); `where` names it
    ("rank 0, instruction 3"), `origins` are its program's."""
    if type(row) is not list or not row or type(row[0]) is not str:
        raise _Fault(path, f"{where}: expected an instruction row [\"mnemonic\", origin, ...], "
                           f"got {_shown(row)}")
    name = row[0]
    cls = BY_MNEMONIC.get(name)
    if cls is None:
        raise _Fault((*path, 0), f"{where}: unknown instruction {_shown(name)}")
    where = f"{where} ({name})"
    if in_batch and cls not in (ISend, IRecv):
        raise _Fault(path, f"{where}: a batch holds only isend and irecv posts")
    cols = COLUMNS[cls]
    n = 2 + len(cols)
    if len(row) != n and len(row) != n + 1:
        shape = ", ".join((json.dumps(name), "origin", *cols))
        raise _Fault(path, f"{where}: expected {n} values [{shape}], then \"paired\" where "
                           f"it runs back to back with the instruction before; got {len(row)}")
    paired = len(row) == n + 1
    if paired and row[n] != PAIRED:
        raise _Fault((*path, n), f"{where}: only \"paired\" may follow the "
                                 f"{cols[-1] if cols else 'origin'}, got {_shown(row[n])}")
    o = row[1]
    if type(o) is not int or not 0 <= o < len(origins):
        have = f"0 to {len(origins) - 1}" if origins else "it is empty"
        raise _Fault((*path, 1), f"{where}: the origin must be an index into the program's "
                                 f"\"origins\" ({have}), got {_shown(o)}")
    op, at = origins[o]
    kw: dict[str, Any] = {}
    for k, (field_name, hint) in enumerate(HINTS[cls], start=2):
        value = row[k]
        if field_name == "posts":
            if type(value) is not list or not value:
                raise _Fault((*path, k), f"{where}: \"posts\" must be a non-empty list of "
                                         f"isend and irecv rows, got {_shown(value)}")
            kw["posts"] = tuple(_row_from(p, f"{where}, post {j}", (*path, k, j), origins,
                                          in_batch=True) for j, p in enumerate(value))
            continue
        want = _wanted(value, hint)
        if want is not None:
            raise _Fault((*path, k),
                         f"{where}: \"{field_name}\" must be {want}, got {_shown(value)}")
        kw[field_name] = value
    return cls(**kw, op=op, at=at, paired=paired)  # type: ignore[no-any-return]


def _program_from(prog: dict[str, Any], r: int, texts: dict[str, str]) -> tuple[Instr, ...]:
    """Rank `r`'s program object (a dict: `_header` checked), every fault explained."""
    path: jsonread.Path = ("programs", r)
    known = ("origins", "table")
    extra = [k for k in prog if k not in known]
    if extra:
        raise _Fault((*path, extra[0]), f"the program of rank {r}: unknown field "
                                        f"{_shown(extra[0])} (a program has origins, table)")
    for key in known:
        if key not in prog:
            raise _Fault(path, f"the program of rank {r}: missing field \"{key}\"")
    origins, table = prog["origins"], prog["table"]
    if type(origins) is not list:
        raise _Fault((*path, "origins"), f"\"origins\" of rank {r} must be a list of "
                                         f"[op, .sched line] pairs, got {_shown(origins)}")
    for k, pair in enumerate(origins):
        if type(pair) is not list or len(pair) != 2 or \
                type(pair[0]) is not str or type(pair[1]) is not str:
            raise _Fault((*path, "origins", k), f"origin {k} of rank {r} must be a pair of "
                                                f"strings [op, .sched line], got {_shown(pair)}")
    pairs = _fast_origins(origins, texts)
    assert pairs is not None
    if type(table) is not list:
        raise _Fault((*path, "table"), f"\"table\" of rank {r} must be a list of instruction "
                                       f"rows, got {_shown(table)}")
    return tuple(_fast(row, pairs, texts) or _row_from(
        row, f"rank {r}, instruction {pc}", (*path, "table", pc), pairs)
        for pc, row in enumerate(table))


def _rows(prog: tuple[Instr, ...] | dict[str, Any]) -> int:
    """How many instructions a program holds, read or not (0 where its table is malformed)."""
    if type(prog) is tuple:
        return len(prog)
    table = prog.get("table")  # type: ignore[union-attr]
    return len(table) if type(table) is list else 0


def _check_columns(columns: object) -> None:
    """Each instruction the file's "columns" name has this pipeir's columns. NOTE: a subset
    is fine: an earlier pipeir of this version wrote every instruction it knew (this one
    added `wait-sends`), and its files read exactly as they did."""
    ours = columns_json()
    if type(columns) is not dict or any(ours.get(k, None) != v for k, v in columns.items()):
        raise _Fault(("columns",), "\"columns\" are not this pipeir's instructions (another "
                                   "version wrote the file? compile the schedule again)")


def _header(data: object, read: bool = False) -> dict[str, Any]:
    """The checked top-level object (module NOTE on reading lowered JSON); with `read`, its
    programs are read already (`load`)."""
    if type(data) is not dict or data.get("format") != "pipeir-lowered":
        raise _Fault((), "not a pipeir lowered-program JSON file "
                         "(format != pipeir-lowered)")
    if "version" not in data:
        raise _Fault((), "missing field \"version\"")
    version = data["version"]
    if version != VERSION or type(version) is not int:
        older = type(version) is int and 1 <= version < VERSION
        raise _Fault(("version",), f"\"version\" {_shown(version)} is not one this pipeir reads "
                     f"({VERSION})" + ("; an earlier pipeir wrote it: compile the schedule again"
                                       if older else ""))
    for key in ("name", *_SIZES, "placement", "programs"):
        if key not in data:
            raise _Fault((), f"missing field \"{key}\"")
    known = ("format", "version", *(f.name for f in fields(Lowered)), "columns", PROVED)
    extra = [k for k in data if k not in known]
    if extra:  # a "dp": 2 here reads as if it meant something; nothing reads it
        raise _Fault((extra[0],), f"unknown field {_shown(extra[0])} (the header has "
                         f"{', '.join(known)})")
    if "columns" in data:
        _check_columns(data["columns"])
    for key, hint in (("name", str), ("overlap", bool), (PROVED, str)):
        want = _wanted(data[key], hint) if key in data else None
        if want is not None:
            raise _Fault((key,), f"\"{key}\" must be {want}, got {_shown(data[key])}")
    for key in _SIZES:
        value = data[key]
        if type(value) is not int or not 1 <= value <= limits.MAX_INT:
            raise _Fault((key,), f"\"{key}\" must be a positive integer (64-bit), got "
                             f"{_shown(value)}")
    ranks, stages = data["ranks"], data["stages"]
    placement, programs = data["placement"], data["programs"]
    if type(programs) is not list:
        raise _Fault(("programs",), f"\"programs\" must be a list of programs (one per rank), "
                         f"got {_shown(programs)}")
    if len(programs) != ranks:
        raise _Fault(("ranks",), f"\"ranks\" is {ranks}, but there are {len(programs)} "
                         "programs (one per rank)")
    if type(placement) is not list or len(placement) != stages:
        raise _Fault(("placement",), f"\"placement\" must be a list of {stages} ranks (one per "
                         f"stage, \"stages\": {stages}), got {_shown(placement)}")
    for s, r in enumerate(placement):
        if type(r) is not int or not 0 <= r < ranks:
            raise _Fault(("placement", s), f"placement of stage {s} must be a rank 0 to "
                         f"{ranks - 1} (\"ranks\": {ranks}), got {_shown(r)}")
    owners = set(placement)
    idle = next((r for r in range(ranks) if r not in owners), None)
    if idle is not None:  # as PipelineConfig: a rank that owns no stage is a wrong "ranks"
        raise _Fault(("placement",), f"rank {idle} owns no stage ({stages} stages on {ranks} "
                         f"ranks, \"placement\": {_shown(placement)})")
    for r, prog in enumerate(programs):
        if type(prog) is not (tuple if read else dict):
            raise _Fault(("programs", r), f"the program of rank {r} must be an object "
                         f"{{\"origins\": [...], \"table\": [...]}}, got {_shown(prog)}")
    # NOTE: the checks run over every (stage, micro-batch): a header that claims far more
    # than its programs hold would make them loop for hours over what cannot be there
    mbs, have = data["microbatches"] * data["accumulate"], sum(map(_rows, programs))
    if 2 * stages * mbs > have:
        raise _Fault(("microbatches",), f"\"stages\" {stages} x \"microbatches\" "
                         f"{data['microbatches']} x \"accumulate\" {data['accumulate']} need "
                         f"{2 * stages * mbs:,} computes at least (a forward and a backward "
                         f"each), but the programs hold {have:,} instructions in all")
    return data


# NOTE (the fast reader): `_row_from` names the fault exactly, and costs microseconds per
# instruction doing it. `_fast` reads the common case, a well-formed row, with a reader
# generated per class from its fields (one straight pass, as `dataclasses` generates
# `__init__`: `_reader`), and gives up (None) at the first thing it would have to explain;
# `_row_from` then reads the same row and raises. So the two accept exactly the same rows
# (tests/test_check_inputs.py compares them on mutated rows). Strings repeat (a `.sched` line
# in many origins, the tensor kinds): the reader shares one object per distinct text.


_MAX = limits.MAX_INT


def _reader(cls: type) -> Callable[..., Instr | None]:
    """The fast reader of one instruction class (the NOTE above), generated from its fields
    as program_io's `_encoder` is: one straight pass, no loop over the fields."""
    n = 2 + len(COLUMNS[cls])
    lines = ["def read(row, origins, texts):", "    n = len(row)",
             f"    if n == {n}: paired = False",
             f"    elif n == {n + 1} and row[{n}] == PAIRED: paired = True",
             "    else: return None",
             "    o = row[1]",
             "    if type(o) is not int or not 0 <= o < len(origins): return None",
             "    op, at = origins[o]"]
    scope: dict[str, Any] = {"build": BUILD[cls], "PAIRED": PAIRED, "MAX": _MAX,
                             "isfinite": math.isfinite, "overflow": limits.int_overflow,
                             "posts": _fast_posts}
    args = []
    for k, (_, hint) in enumerate(HINTS[cls], start=2):
        want, x = kind_of(hint), f"v{k}"
        lines.append(f"    {x} = row[{k}]")
        if want is STR:
            lines += [f"    if type({x}) is not str: return None",
                      f"    {x} = texts.setdefault({x}, {x})"]
        elif want is INT:
            lines.append(f"    if type({x}) is not int or not 0 <= {x} <= MAX: return None")
        elif want is BOOL:
            lines.append(f"    if type({x}) is not bool: return None")
        elif want is FLOAT:
            lines.append(f"    if not ((type({x}) is float and isfinite({x})) or "
                         f"(type({x}) is int and not overflow({x}))): return None")
        elif want is POSTS:
            lines += [f"    if type({x}) is not list or not {x}: return None",
                      f"    {x} = posts({x}, origins, texts)",
                      f"    if {x} is None: return None"]
        else:  # a Literal of strings: each read as the one object of its text
            assert isinstance(want, frozenset)
            scope[f"c{k}"] = {c: c for c in want}
            lines += [f"    if type({x}) is not str: return None",
                      f"    {x} = c{k}.get({x})",
                      f"    if {x} is None: return None"]
        args.append(x)
    lines.append(f"    return build({''.join(a + ', ' for a in args)}op, at, paired)")
    exec("\n".join(lines), scope)
    return scope["read"]  # type: ignore[no-any-return]


def _fast_posts(rows: list[Any], origins: list[tuple[str, str]], texts: dict[str, str]
                ) -> tuple[Instr, ...] | None:
    out = []
    for row in rows:
        post = _fast(row, origins, texts, True)
        if post is None:
            return None
        out.append(post)
    return tuple(out)


_READERS: dict[str, Callable[..., Instr | None]] = {
    name: _reader(cls) for name, cls in BY_MNEMONIC.items()}
_POSTABLE = frozenset({MNEMONICS[ISend], MNEMONICS[IRecv]})


def _fast(row: object, origins: list[tuple[str, str]], texts: dict[str, str],
          in_batch: bool = False) -> Instr | None:
    """`row` as an instruction if `_row_from` would accept it, else None (the NOTE above)."""
    if type(row) is not list or not row:
        return None
    name = row[0]
    read = _READERS.get(name) if type(name) is str else None
    if read is None or (in_batch and name not in _POSTABLE):
        return None
    return read(row, origins, texts)


def _fast_origins(value: object, texts: dict[str, str]) -> list[tuple[str, str]] | None:
    """A program's "origins" as (op, .sched line) pairs, or None where `_program_from` would
    explain something."""
    if type(value) is not list:
        return None
    out = []
    for pair in value:
        if type(pair) is not list or len(pair) != 2:
            return None
        op, at = pair
        if type(op) is not str or type(at) is not str:
            return None
        out.append((texts.setdefault(op, op), texts.setdefault(at, at)))
    return out


def _fast_program(prog: object, texts: dict[str, str]) -> tuple[Instr, ...] | None:
    """A program object read as `_program_from` reads it, or None where it would explain."""
    if type(prog) is not dict or len(prog) != 2:
        return None
    origins = _fast_origins(prog.get("origins"), texts)
    table = prog.get("table")
    if origins is None or type(table) is not list:
        return None
    out = []
    readers = _READERS  # (`_fast` inline: a call less per instruction)
    for row in table:
        if type(row) is not list or not row:
            return None
        name = row[0]
        read = readers.get(name) if type(name) is str else None
        ins = read(row, origins, texts) if read is not None else None
        if ins is None:
            return None
        out.append(ins)
    return tuple(out)


@paused_gc()  # (pipeir._gc: an instruction object per row, no cycles)
def from_json(data: object, where: str = "lowered JSON", source: Source | None = None) -> Lowered:
    """Read what `to_json` wrote; malformed input is a UsageError naming the rank, the
    instruction and the field, at its line and column in `source` (the file's text) when
    given, else prefixed with `where` (the file)."""
    try:
        d = _header(data)
        texts: dict[str, str] = {}
        programs = tuple(_fast_program(prog, texts) or _program_from(prog, r, texts)
                         for r, prog in enumerate(d["programs"]))
    except _Fault as e:
        span = _span_at(source, e.path) if source is not None else None
        raise UsageError(e.message if span is not None else f"{where}: {e.message}",
                         span) from None
    return Lowered(d["name"], d["ranks"], d["stages"], d["microbatches"], d["accumulate"],
                   tuple(d["placement"]), programs, d.get("overlap", False))


def _span_at(source: Source, path: jsonread.Path) -> Span:
    """Where the value at `path` (or the nearest enclosing one) is written: its key for an
    object member, the element for an array element, the file's start for the top level."""
    places = jsonread.positions(source)
    for k in range(len(path), 0, -1):
        place = places.get(path[:k])
        if place is not None:
            return place.key or place.whole
    return Span(source, 1, 1, 1, 2)


def instruction_spans(source: Source) -> dict[tuple[int, int], Span]:
    """(rank, position) -> the span of that instruction's mnemonic in `source`, a valid
    lowered JSON file: the line a reader of the file looks for."""
    places = jsonread.positions(source)
    out: dict[tuple[int, int], Span] = {}
    for path, place in places.items():
        if len(path) == 4 and path[0] == "programs" and path[2] == "table" and \
                isinstance(path[1], int) and isinstance(path[3], int):
            mnemonic = places.get((*path, 0))
            out[path[1], path[3]] = (mnemonic or place).whole
    return out


def load(path: str) -> tuple[Lowered, Source]:
    """The lowered programs in the file `path` (`pipeirc check --lowered`, a compiled
    directory's main.py) and its text; every malformed input is one UsageError at the fault.

    NOTE: read a program at a time (`jsonread.loads_streamed`, `_fast_program`), so the JSON
    values of one rank's table exist at once, not of all; anything that reader would have to
    explain sends the whole file through `from_json`, which explains it as it always has."""
    source = limits.read_input(path, "lowered-program JSON", limits.BYTES_PER_JSON_BYTE)
    texts: dict[str, str] = {}

    def program(r: int, prog: Any) -> Any:
        read = _fast_program(prog, texts)
        if read is None:
            raise _Fault(("programs", r), "")
        return read
    with paused_gc():  # (pipeir._gc: an instruction object per row, no cycles)
        try:
            data = jsonread.loads_streamed(source, "programs", program)
            d = _header(data, read=True) if data is not None else None
        except _Fault:
            d = None
    if d is None:
        return from_json(jsonread.loads(source, "lowered-program JSON file", "field"), path,
                         source), source
    return Lowered(d["name"], d["ranks"], d["stages"], d["microbatches"], d["accumulate"],
                   tuple(d["placement"]), tuple(d["programs"]), d.get("overlap", False)), source


