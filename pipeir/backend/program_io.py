"""The text and JSON forms of lowered programs: `format_lowered` prints the readable text
(`pipeirc compile --emit lowered`), `to_json`/`dumps` write `lowered.json`, and `from_json`
reads one back, checking a hand-edited file field by field before anything runs on it.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import MISSING, fields
from typing import Any, get_args, get_type_hints

from pipeir import jsonread, limits
from pipeir._gc import paused_gc
from pipeir.backend.instructions import (
    BY_MNEMONIC,
    MNEMONICS,
    Batch,
    Instr,
    IRecv,
    ISend,
    Lowered,
)
from pipeir.diagnostics import Source, Span, UsageError


def format_lowered(lowered: Lowered) -> str:
    """The readable text form (`pipeirc compile --emit lowered`)."""
    lines = [f"# lowered {lowered.name}: {lowered.ranks} ranks, {lowered.stages} stages, "
             f"{lowered.microbatches} micro-batches, accumulate {lowered.accumulate}"
             f"{', overlap' if lowered.overlap else ''}",
             f"# placement {' '.join(map(str, lowered.placement))}"]
    for r, prog in enumerate(lowered.programs):
        lines.append(f"rank {r} {{")
        lines.extend(f"  {i:3d}  {ins}" for i, ins in enumerate(prog))
        lines.append("}")
    return "\n".join(lines) + "\n"


#: Per instruction class, its field names and a getter of all of them at once (read once:
#: `dataclasses.fields` and `getattr` per field were a third of writing a large lowered.json).
_NAMES: dict[type, tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls))
                                       for cls in MNEMONICS}
_VALUES: dict[type, Callable[[Instr], tuple[Any, ...]]] = {
    cls: operator.attrgetter(*names) for cls, names in _NAMES.items()}


def _instr_json(ins: Instr) -> dict[str, Any]:
    cls = type(ins)
    d: dict[str, Any] = {"i": MNEMONICS[cls]}
    d.update(zip(_NAMES[cls], _VALUES[cls](ins)))
    if not ins.paired:
        del d["paired"]
    if cls is Batch:
        d["posts"] = [_instr_json(v) for v in ins.posts]  # type: ignore[attr-defined]
    return d


def _header_json(lowered: Lowered) -> dict[str, Any]:
    return {"format": "pipeir-lowered", "version": 1, "name": lowered.name,
            "ranks": lowered.ranks, "stages": lowered.stages,
            "microbatches": lowered.microbatches, "accumulate": lowered.accumulate,
            "placement": list(lowered.placement)}


def to_json(lowered: Lowered) -> dict[str, Any]:
    return {**_header_json(lowered),
            "programs": [[_instr_json(i) for i in prog] for prog in lowered.programs],
            "overlap": lowered.overlap}


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

#: Per instruction class, its fields: (name, type, required), from the dataclass itself so
#: that a new instruction or field is read without touching the reader.
_FIELDS: dict[type, tuple[tuple[str, Any, bool], ...]] = {
    cls: tuple((f.name, get_type_hints(cls)[f.name],
                f.default is MISSING and f.default_factory is MISSING) for f in fields(cls))
    for cls in MNEMONICS}
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


def _instr_from(d: object, where: str, path: jsonread.Path, in_batch: bool = False) -> Instr:
    """One instruction object at `path`; `where` names it ("rank 0, instruction 3")."""
    if type(d) is not dict:
        raise _Fault(path, f"{where}: expected an instruction object {{\"i\": ...}}, got "
                         f"{_shown(d)}")
    name = d.get("i")
    cls = BY_MNEMONIC.get(name) if type(name) is str else None
    if cls is None:
        raise _Fault((*path, "i"), f"{where}: unknown instruction {_shown(name)} "
                     "(field \"i\")")
    where = f"{where} ({name})"
    if in_batch and cls not in (ISend, IRecv):
        raise _Fault(path, f"{where}: a batch holds only isend and irecv posts")
    known = {n for n, _, _ in _FIELDS[cls]}
    extra = [k for k in d if k != "i" and k not in known]
    if extra:
        raise _Fault((*path, extra[0]), f"{where}: unknown field {_shown(extra[0])} (a {name} has "
                         f"{', '.join(sorted(known))})")
    kw: dict[str, Any] = {}
    for field_name, hint, required in _FIELDS[cls]:
        if field_name not in d:
            if required:
                raise _Fault(path, f"{where}: missing field \"{field_name}\"")
            continue
        value = d[field_name]
        if field_name == "posts":
            if type(value) is not list or not value:
                raise _Fault((*path, "posts"), f"{where}: \"posts\" must be a non-empty list "
                             f"of isend and irecv objects, got {_shown(value)}")
            kw["posts"] = tuple(_instr_from(p, f"{where}, post {j}", (*path, "posts", j),
                                            in_batch=True)
                                for j, p in enumerate(value))
            continue
        want = _wanted(value, hint)
        if want is not None:
            raise _Fault((*path, field_name),
                         f"{where}: \"{field_name}\" must be {want}, got {_shown(value)}")
        kw[field_name] = value
    return cls(**kw)  # type: ignore[no-any-return]


def _header(data: object) -> dict[str, Any]:
    """The checked top-level object (module NOTE on reading lowered JSON)."""
    if type(data) is not dict or data.get("format") != "pipeir-lowered":
        raise _Fault((), "not a pipeir lowered-program JSON file "
                         "(format != pipeir-lowered)")
    if "version" not in data:
        raise _Fault((), "missing field \"version\"")
    if data["version"] != 1 or type(data["version"]) is not int:
        raise _Fault(("version",), f"\"version\" {_shown(data['version'])} is not one this "
                         "pipeir reads (1)")
    for key in ("name", *_SIZES, "placement", "programs"):
        if key not in data:
            raise _Fault((), f"missing field \"{key}\"")
    known = ("format", "version", *(f.name for f in fields(Lowered)), PROVED)
    extra = [k for k in data if k not in known]
    if extra:  # a "dp": 2 here reads as if it meant something; nothing reads it
        raise _Fault((extra[0],), f"unknown field {_shown(extra[0])} (the header has "
                         f"{', '.join(known)})")
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
        if type(prog) is not list and type(prog) is not tuple:  # (tuple: read already, `load`)
            raise _Fault(("programs", r), f"the program of rank {r} must be a list of "
                             f"instructions, got {_shown(prog)}")
    # NOTE: the checks run over every (stage, micro-batch): a header that claims far more
    # than its programs hold would make them loop for hours over what cannot be there
    mbs, have = data["microbatches"] * data["accumulate"], sum(map(len, programs))
    if 2 * stages * mbs > have:
        raise _Fault(("microbatches",), f"\"stages\" {stages} x \"microbatches\" "
                         f"{data['microbatches']} x \"accumulate\" {data['accumulate']} need "
                         f"{2 * stages * mbs:,} computes at least (a forward and a backward "
                         f"each), but the programs hold {have:,} instructions in all")
    return data


# NOTE (the fast reader): `_instr_from` names the fault exactly, and costs 5 µs per
# instruction doing it (a quarter of `check --lowered` at 65k ops). `_fast` reads the common
# case, a well-formed instruction, with a reader generated per class from its fields (one
# straight pass, as `dataclasses` generates `__init__`: `_reader`), and gives up
# (None) at the first thing it would have to explain; `_instr_from` then reads the same
# object and raises. So the two accept exactly the same objects (tests/test_check_inputs.py
# compares them on mutated instructions). Strings repeat on every instruction (the op, its
# `.sched` line): the reader shares one object per distinct text.
_INT, _FLOAT, _STR, _BOOL, _POSTS = range(5)


def _spec(hint: Any) -> int | frozenset[str]:
    if hint is int:
        return _INT
    if hint is float:
        return _FLOAT
    if hint is str:
        return _STR
    if hint is bool:
        return _BOOL
    if get_args(hint) and all(type(c) is str for c in get_args(hint)):
        return frozenset(get_args(hint))  # a Literal of strings
    return _POSTS


_MAX = limits.MAX_INT


def _reader(cls: type) -> Callable[..., Instr | None]:
    """The fast reader of one instruction class (the NOTE above), generated from its fields
    as `_encoder` is: one straight pass, no loop over the fields."""
    required = frozenset({"i", *(n for n, _, req in _FIELDS[cls] if req)})
    known = frozenset({"i", *(n for n, _, _ in _FIELDS[cls])})
    specs = [(n, _spec(hint)) for n, hint, _ in _FIELDS[cls]]
    defaults = {f.name: f.default for f in fields(cls)}
    kw_only = {f.name for f in fields(cls) if f.kw_only}
    lines = ["def read(d, texts):", "    keys = d.keys()",
             "    if not (required <= keys and keys <= known): return None"]
    plain: list[tuple[str, str]] = []
    kw: list[tuple[str, str]] = []
    scope: dict[str, Any] = {"cls": cls, "required": required, "known": known, "MAX": _MAX,
                             "isfinite": math.isfinite, "overflow": limits.int_overflow,
                             "posts": _fast_posts}
    for k, (name, want) in enumerate(specs):
        x = f"v{k}"
        if name in required:
            lines.append(f"    {x} = d[{name!r}]")
        else:
            scope[f"d{k}"] = defaults[name]
            lines.append(f"    {x} = d.get({name!r}, d{k})")
        if want is _STR:
            lines += [f"    if type({x}) is not str: return None",
                      f"    {x} = texts.setdefault({x}, {x})"]
        elif want is _INT:
            lines.append(f"    if type({x}) is not int or not 0 <= {x} <= MAX: return None")
        elif want is _BOOL:
            lines.append(f"    if type({x}) is not bool: return None")
        elif want is _FLOAT:
            lines.append(f"    if not ((type({x}) is float and isfinite({x})) or "
                         f"(type({x}) is int and not overflow({x}))): return None")
        elif want is _POSTS:
            lines += [f"    if type({x}) is not list or not {x}: return None",
                      f"    {x} = posts({x}, texts)",
                      f"    if {x} is None: return None"]
        else:  # a Literal of strings
            scope[f"c{k}"] = want
            lines += [f"    if type({x}) is not str or {x} not in c{k}: return None",
                      f"    {x} = texts.setdefault({x}, {x})"]
        (kw if name in kw_only else plain).append((name, x))
    args = [x for _, x in plain] + [f"{name}={x}" for name, x in kw]
    lines.append(f"    return cls({', '.join(args)})")
    exec("\n".join(lines), scope)
    return scope["read"]  # type: ignore[no-any-return]


def _fast_posts(items: list[Any], texts: dict[str, str]) -> tuple[Instr, ...] | None:
    out = []
    for p in items:
        post = _fast(p, texts, True)
        if post is None:
            return None
        out.append(post)
    return tuple(out)


_READERS: dict[str, Callable[..., Instr | None]] = {
    name: _reader(cls) for name, cls in BY_MNEMONIC.items()}
_POSTABLE = frozenset({MNEMONICS[ISend], MNEMONICS[IRecv]})


def _fast(d: object, texts: dict[str, str], in_batch: bool = False) -> Instr | None:
    """`d` as an instruction if `_instr_from` would accept it, else None (the NOTE above)."""
    if type(d) is not dict:
        return None
    name = d.get("i")
    read = _READERS.get(name) if type(name) is str else None
    if read is None or (in_batch and name not in _POSTABLE):
        return None
    return read(d, texts)


# NOTE (the fast writer): `json.dumps` of `_instr_json`'s dict per instruction was most of
# writing a large lowered.json (a dict built, then encoded: 0.9 s at 65k ops). `_ENCODERS`
# holds, per instruction class, a function generated once from its fields (as `dataclasses`
# generates `__init__`) that writes the same text straight from the fields, each string
# encoded once per file (the op and `.sched` line repeat on every instruction). It gives up
# (None) on any value of another type than the field's, and `_program_text` then encodes
# that instruction through `json.dumps`: the text is the same either way
# (tests/test_backend.py compares them).
def _encoder(cls: type) -> Callable[..., str | None]:
    lines = ["def encode(ins, strs, string, posts):", "    v = values(ins)"]
    text = "{{" + json.dumps("i") + ": " + json.dumps(MNEMONICS[cls])  # (an f-string's braces)
    for k, (name, hint, _) in enumerate(_FIELDS[cls]):
        want, x, key = _spec(hint), f"v[{k}]", json.dumps(name)
        if name == "paired":
            lines += [f"    if type({x}) is not bool: return None",
                      f"    b{k} = {', ' + key + ': true'!r} if {x} else ''"]
            text += f"{{b{k}}}"
        elif want is _STR or isinstance(want, frozenset):
            lines.append(f"    if type({x}) is not str: return None")
            text += f", {key}: {{strs.get({x}) or string({x})}}"
        elif want is _INT:
            lines.append(f"    if type({x}) is not int: return None")
            text += f", {key}: {{int_repr({x})}}"
        elif want is _FLOAT:
            lines.append(f"    if type({x}) is not float or not isfinite({x}): return None")
            text += f", {key}: {{float_repr({x})}}"
        elif want is _BOOL:
            lines += [f"    if type({x}) is not bool: return None",
                      f"    b{k} = 'true' if {x} else 'false'"]
            text += f", {key}: {{b{k}}}"
        else:  # a batch's posts
            lines += [f"    p{k} = posts({x}, strs, string)", f"    if p{k} is None: return None"]
            text += f", {key}: {{p{k}}}"
    lines.append(f"    return f{text + '}}'!r}")
    scope: dict[str, Any] = {"values": _VALUES[cls], "int_repr": int.__repr__,
                             "float_repr": float.__repr__, "isfinite": math.isfinite}
    exec("\n".join(lines), scope)
    return scope["encode"]  # type: ignore[no-any-return]


def _posts(items: object, strs: dict[str, str], string: Callable[[str], str]) -> str | None:
    if type(items) is not tuple:
        return None
    out = []
    for ins in items:
        encode = _ENCODERS.get(type(ins))
        text = encode(ins, strs, string, _posts) if encode is not None else None
        if text is None:
            return None
        out.append(text)
    return "[" + ", ".join(out) + "]"


_ENCODERS: dict[type, Callable[..., str | None]] = {cls: _encoder(cls) for cls in MNEMONICS}


def _program_text(prog: Sequence[Instr], strs: dict[str, str]) -> str:
    """`json.dumps([_instr_json(i) for i in prog])`, written faster (the NOTE above); `strs`
    holds the strings encoded so far."""
    def string(s: str) -> str:
        strs[s] = text = json.dumps(s)
        return text
    out = []
    for ins in prog:
        encode = _ENCODERS.get(type(ins))
        text = encode(ins, strs, string, _posts) if encode is not None else None
        out.append(text if text is not None else json.dumps(_instr_json(ins)))
    return "[" + ", ".join(out) + "]"


@paused_gc()  # (pipeir._gc: an instruction object per JSON object, no cycles)
def from_json(data: object, where: str = "lowered JSON", source: Source | None = None) -> Lowered:
    """Read what `to_json` wrote; malformed input is a UsageError naming the rank, the
    instruction and the field, at its line and column in `source` (the file's text) when
    given, else prefixed with `where` (the file)."""
    try:
        d = _header(data)
        texts: dict[str, str] = {}
        programs = tuple(tuple(_fast(ins, texts) or _instr_from(
            ins, f"rank {r}, instruction {pc}", ("programs", r, pc))
            for pc, ins in enumerate(prog)) for r, prog in enumerate(d["programs"]))
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


def load(path: str) -> tuple[Lowered, Source]:
    """The lowered programs in the file `path` (`pipeirc check --lowered`, a compiled
    directory's main.py) and its text; every malformed input is one UsageError at the fault.

    NOTE: read a program at a time (`jsonread.loads_streamed`, `_fast`), so the JSON objects
    of one rank's instructions exist at once, not of all; anything that reader would have to
    explain sends the whole file through `from_json`, which explains it as it always has."""
    source = limits.read_input(path, "lowered-program JSON", limits.BYTES_PER_JSON_BYTE)
    texts: dict[str, str] = {}

    def program(r: int, prog: Any) -> Any:
        if type(prog) is not list:
            raise _Fault(("programs", r), "")
        out = []
        for ins in prog:
            read = _fast(ins, texts)
            if read is None:
                raise _Fault(("programs", r), "")
            out.append(read)
        return tuple(out)
    with paused_gc():  # (pipeir._gc: an instruction object per JSON object, no cycles)
        try:
            data = jsonread.loads_streamed(source, "programs", program)
            d = _header(data) if data is not None else None
        except _Fault:
            d = None
    if d is None:
        return from_json(jsonread.loads(source, "lowered-program JSON file", "field"), path,
                         source), source
    return Lowered(d["name"], d["ranks"], d["stages"], d["microbatches"], d["accumulate"],
                   tuple(d["placement"]), tuple(d["programs"]), d.get("overlap", False)), source


def dumps(lowered: Lowered, proof: str | None = None) -> str:
    """`to_json` as text, one instruction per line. With `proof` (the caller proved the
    programs under the rules `proof` names: `pipeirc compile`), the last line records a digest
    of the text under that proof (`is_proved`)."""
    return "".join(dump_parts(lowered, proof))


def dump_parts(lowered: Lowered, proof: str | None = None) -> Iterator[str]:
    """`dumps`'s text in parts (a header, one part per rank, a trailer), each made when it is
    asked for: `pipeir.files` writes each before the next is made, so the text of a large
    program (35 MB at 65k ops, 0.7 KB per op) never exists whole, nor encoded whole.

    NOTE: written a program at a time with the C encoder (`json.dumps` without `indent`; with
    it the encoder is pure Python, and it was half of compiling a large schedule), then one
    line per instruction by breaking between instruction objects: the text `}, {"i": ` cannot
    occur inside a JSON string (its quotes would be escaped), so only object boundaries match.
    The digest (the NOTE on the recorded proof) is in the trailer, hashed as the parts go by.
    """
    h = _hasher(proof) if proof is not None else None

    def seen(part: str) -> str:
        if h is not None:
            h.update(part.encode())
        return part
    yield seen(json.dumps(_header_json(lowered))[:-1] + ',\n "programs": [')
    strs: dict[str, str] = {}
    for r, prog in enumerate(lowered.programs):
        body = _program_text(prog, strs)
        yield seen(("\n  " if r == 0 else ",\n  ") + body.replace('}, {"i": ', '},\n   {"i": '))
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
