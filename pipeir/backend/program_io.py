"""The text and JSON forms of lowered programs: `format_lowered` prints the readable text
(`pipeirc compile --emit lowered`), `to_json`/`dumps` write `lowered.json` (its format is
defined here), and `is_proved` tells the text compile proved. `pipeir.backend.program_read`
reads the file back.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from typing import Any, Final, get_args, get_type_hints

from pipeir.backend.instructions import MNEMONICS, Batch, Instr, Lowered


def expect_lowered(value: object, where: str) -> Lowered:
    """`value` if it is lowered programs; else a TypeError saying how to get them (what
    `pipeir.compile` returns holds them)."""
    if isinstance(value, Lowered):
        return value
    hint = ": give its .lowered" if isinstance(getattr(value, "lowered", None), Lowered) else ""
    raise TypeError(f"{where}: expected lowered programs (a Lowered), got "
                    f"{type(value).__name__}{hint}")


def format_lowered(lowered: Lowered) -> str:
    """The readable text form (`pipeirc compile --emit lowered`)."""
    expect_lowered(lowered, "format_lowered")
    lines = [f"# lowered {lowered.name}: {lowered.ranks} ranks, {lowered.stages} stages, "
             f"{lowered.microbatches} micro-batches, accumulate {lowered.accumulate}"
             f"{', overlap' if lowered.overlap else ''}",
             f"# placement {' '.join(map(str, lowered.placement))}"]
    for r, prog in enumerate(lowered.programs):
        lines.append(f"rank {r} {{")
        lines.extend(f"  {i:3d}  {ins}" for i, ins in enumerate(prog))
        lines.append("}")
    return "\n".join(lines) + "\n"


# NOTE (the instruction table): lowered.json holds each rank's program as a table, a row per
# instruction, not an object per instruction. A row is the mnemonic, the index of its origin
# in its program's "origins" (the op and its `.sched` line, written once per op, not on each
# of the op's instructions), then the instruction's own fields in the order the header's
# "columns" names them, and last "paired" where the instruction runs back to back with the one
# before it (an overlapped pair):
#     ["irecv", 5, "act", 3, 0, 3, 6]     (tensor, stage, mb, peer, tag; origin 5)
# Objects with their keys on every instruction were 2.7x the bytes, and `json` took 3.5x the
# time to decode them (a dict per object, and the duplicate-key check called on each): at
# p = 64 reading them was most of `check --lowered`. `pipeirc compile --emit lowered` prints
# the programs as readable text.
VERSION: Final = 2
PAIRED: Final = "paired"
_BASE = ("op", "at", "paired")  # (the fields every instruction has: the origin and "paired")
#: Per instruction class, the columns of its row after the mnemonic and the origin.
COLUMNS: dict[type, tuple[str, ...]] = {
    cls: tuple(f.name for f in fields(cls) if f.name not in _BASE) for cls in MNEMONICS}
#: Per instruction class, a getter of (op, at, paired, *columns) at once (read once:
#: `dataclasses.fields` and `getattr` per field were a third of writing a large lowered.json).
_VALUES: dict[type, Callable[[Instr], tuple[Any, ...]]] = {
    cls: operator.attrgetter(*_BASE, *cols) for cls, cols in COLUMNS.items()}
#: Per instruction class, its columns' (name, type) from the dataclass itself, so that a new
#: instruction or field is read and written without touching this module.
HINTS: dict[type, tuple[tuple[str, Any], ...]] = {
    cls: tuple((n, get_type_hints(cls)[n]) for n in cols) for cls, cols in COLUMNS.items()}


def columns_json() -> dict[str, list[str]]:
    """The header's "columns": per mnemonic, its row's fields after the origin."""
    return {MNEMONICS[cls]: list(cols) for cls, cols in COLUMNS.items()}


#: What `kind_of` tells of a field's type (else a frozenset: a Literal's strings).
INT, FLOAT, STR, BOOL, POSTS = range(5)


def kind_of(hint: Any) -> int | frozenset[str]:
    """A field's type as the fast reader and writer check it."""
    if hint is int:
        return INT
    if hint is float:
        return FLOAT
    if hint is str:
        return STR
    if hint is bool:
        return BOOL
    if get_args(hint) and all(type(c) is str for c in get_args(hint)):
        return frozenset(get_args(hint))  # a Literal of strings
    return POSTS


def _origin(index: dict[tuple[str, str], int], op: str, at: str) -> int:
    key = (op, at)
    k = index.get(key)
    if k is None:
        k = index[key] = len(index)
    return k


def _row(ins: Instr, index: dict[tuple[str, str], int]) -> list[Any]:
    """One instruction's row (the NOTE above); `index` numbers its program's origins."""
    cls = type(ins)
    op, at, paired, *values = _VALUES[cls](ins)
    row = [MNEMONICS[cls], _origin(index, op, at)]
    if cls is Batch:
        row.append([_row(p, index) for p in values[0]])
    else:
        row += values
    if paired:
        row.append(PAIRED)
    return row


def _program_json(prog: Sequence[Instr]) -> dict[str, Any]:
    index: dict[tuple[str, str], int] = {}
    table = [_row(i, index) for i in prog]
    return {"origins": [list(k) for k in index], "table": table}


def _header_json(lowered: Lowered) -> dict[str, Any]:
    return {"format": "pipeir-lowered", "version": VERSION, "name": lowered.name,
            "ranks": lowered.ranks, "stages": lowered.stages,
            "microbatches": lowered.microbatches, "accumulate": lowered.accumulate,
            "placement": list(lowered.placement),
            "columns": columns_json()}


def to_json(lowered: Lowered) -> dict[str, Any]:
    expect_lowered(lowered, "to_json")
    return {**_header_json(lowered),
            "programs": [_program_json(prog) for prog in lowered.programs],
            "overlap": lowered.overlap}


# NOTE (the fast writer): `json.dumps` of `_row`'s list per instruction was most of writing a
# large lowered.json (a list built, then encoded). `_ENCODERS` holds, per instruction class, a
# function generated once from its fields (as `dataclasses` generates `__init__`) that writes
# the same text straight from the fields, each string encoded once per file. It gives up
# (None) on any value of another type than the field's, and `_program_text` then encodes that
# instruction through `json.dumps(_row(...))`: the text is the same either way
# (tests/test_backend.py compares them).
def _encoder(cls: type) -> Callable[..., str | None]:
    n = len(_BASE) + len(COLUMNS[cls])
    lines = ["def encode(ins, index, strs, string, posts):",
             f"    {', '.join(f'v{k}' for k in range(n))}{',' if n == 1 else ''} = values(ins)",
             "    if type(v0) is not str or type(v1) is not str or type(v2) is not bool:",
             "        return None",
             "    key = (v0, v1)", "    o = index.get(key)",
             "    if o is None:", "        o = index[key] = len(index)"]
    text = "[" + json.dumps(MNEMONICS[cls]) + ", {o}"
    for k, (_, hint) in enumerate(HINTS[cls], start=len(_BASE)):
        want, x = kind_of(hint), f"v{k}"
        if want is STR or isinstance(want, frozenset):
            lines.append(f"    if type({x}) is not str: return None")
            text += f", {{strs.get({x}) or string({x})}}"
        elif want is INT:
            lines.append(f"    if type({x}) is not int: return None")
            text += f", {{{x}}}"  # (an int exactly: formatted as its repr)
        elif want is FLOAT:
            lines.append(f"    if type({x}) is not float or not isfinite({x}): return None")
            text += f", {{{x}!r}}"
        elif want is BOOL:
            lines += [f"    if type({x}) is not bool: return None",
                      f"    b{k} = 'true' if {x} else 'false'"]
            text += f", {{b{k}}}"
        else:  # a batch's posts
            lines += [f"    p{k} = posts({x}, index, strs, string)",
                      f"    if p{k} is None: return None"]
            text += f", {{p{k}}}"
    lines.append(f"    paired = {', ' + json.dumps(PAIRED)!r} if v2 else ''")
    lines.append(f"    return f{text + '{paired}]'!r}")
    scope: dict[str, Any] = {"values": _VALUES[cls], "isfinite": math.isfinite}
    exec("\n".join(lines), scope)
    return scope["encode"]  # type: ignore[no-any-return]


def _posts(items: object, index: dict[tuple[str, str], int], strs: dict[str, str],
           string: Callable[[str], str]) -> str | None:
    if type(items) is not tuple:
        return None
    out = []
    for ins in items:
        encode = _ENCODERS.get(type(ins))
        text = encode(ins, index, strs, string, _posts) if encode is not None else None
        if text is None:
            return None
        out.append(text)
    return "[" + ", ".join(out) + "]"


_ENCODERS: dict[type, Callable[..., str | None]] = {cls: _encoder(cls) for cls in MNEMONICS}


def _program_text(prog: Sequence[Instr], strs: dict[str, str], lines: bool = False) -> str:
    """`json.dumps(_program_json(prog))`, written faster (the NOTE above); with `lines`, the
    table starts on a new line and has a row per line. `strs` holds the strings encoded so
    far."""
    def string(s: str) -> str:
        strs[s] = text = json.dumps(s)
        return text
    index: dict[tuple[str, str], int] = {}
    rows = []
    for ins in prog:
        encode = _ENCODERS.get(type(ins))
        text = encode(ins, index, strs, string, _posts) if encode is not None else None
        rows.append(text if text is not None else json.dumps(_row(ins, index)))
    origins = json.dumps(list(index))  # (json writes the (op, at) tuples as arrays)
    if not lines:
        return f'{{"origins": {origins}, "table": [{", ".join(rows)}]}}'
    table = ",\n    ".join(rows)
    return f'{{"origins": {origins},\n   "table": [\n    {table}]}}'


def dumps(lowered: Lowered, proof: str | None = None) -> str:
    """`to_json` as text, one instruction per line. With `proof` (the caller proved the
    programs under the rules `proof` names: `pipeirc compile`), the last line records a digest
    of the text under that proof (`is_proved`)."""
    expect_lowered(lowered, "dumps")
    return "".join(dump_parts(lowered, proof))


def dump_parts(lowered: Lowered, proof: str | None = None) -> Iterator[str]:
    """`dumps`'s text in parts (a header, one part per rank, a trailer), each made when it is
    asked for: `pipeir.files` writes each before the next is made, so the text of a large
    program (18 MB at 65k ops, 0.28 KB per op) never exists whole, nor encoded whole.

    NOTE: written a program at a time by the fast writer, one instruction per line (`json`'s
    own `indent` is pure Python: it was half of compiling a large schedule). The digest (the
    NOTE on the recorded proof) is in the trailer, hashed as the parts go by.
    """
    h = _hasher(proof) if proof is not None else None

    def seen(part: str) -> str:
        if h is not None:
            h.update(part.encode())
        return part
    header = _header_json(lowered)
    columns = header.pop("columns")
    yield seen(json.dumps(header)[:-1] + f',\n "columns": {json.dumps(columns)},\n "programs": [')
    strs: dict[str, str] = {}
    for r, prog in enumerate(lowered.programs):
        yield seen(("\n  " if r == 0 else ",\n  ") + _program_text(prog, strs, lines=True))
    tail = f'\n ],\n "overlap": {json.dumps(lowered.overlap)}'
    if h is None:
        yield tail + "\n}\n"
        return
    # (quotes in a string are escaped: this is the field, nothing inside a value)
    blank = f',\n "{PROVED}": "{_UNSIGNED}"\n}}\n'
    h.update((tail + blank).encode())
    yield tail + blank.replace(_UNSIGNED, _DIGEST_PREFIX + h.hexdigest())


# NOTE (the recorded proof): the ranks of a compiled program interpret lowered.json, so
# main.py must run only what `check --lowered` would accept; proving it again on every rank
# costs as much as the check (seconds at 100k instructions). `pipeirc compile` proves the
# programs before it writes them and records in the trailer a digest of the file's text (with
# the digest itself blanked) and of the rules that proved it (`commcheck.rules_id`). main.py
# proves again only when the digest it computes differs: any edit of the file (a tag, a peer,
# a dropped instruction, the header) or other rules. It is a check against edits
# and stale files, not a signature: whoever edits the file on purpose and forges the digest
# has chosen to run what they wrote.
PROVED = "proved"
_DIGEST_PREFIX = "sha256:"
_UNSIGNED = _DIGEST_PREFIX + "0" * 64
_TRAILER = 256  # characters: the trailer (`dump_parts`) is shorter
_RECORDED = re.compile(r'"proved": "(sha256:[0-9a-f]{64})"')
_CHUNK = 1 << 20


def _hasher(proof: str) -> hashlib._Hash:
    """The digest of a lowered.json's text (its digest blanked) proved under `proof`, to be
    fed the text."""
    return hashlib.sha256(f"{proof}\n".encode())


def is_proved(text: str, proof: str) -> bool:
    """Whether `text`, a lowered.json, is exactly what `dumps` wrote of programs proved under
    `proof` (the NOTE above): its recorded digest is the one of its text."""
    found = _RECORDED.search(text, max(0, len(text) - _TRAILER))  # the trailer holds it
    if found is None:
        return False
    start, end = found.span(1)
    h = _hasher(proof)
    for k in range(0, start, _CHUNK):  # encoded a piece at a time: no copy of the whole
        h.update(text[k:min(k + _CHUNK, start)].encode())
    h.update(_UNSIGNED.encode())
    h.update(text[end:].encode())
    return h.hexdigest() == found.group(1)[len(_DIGEST_PREFIX):]

