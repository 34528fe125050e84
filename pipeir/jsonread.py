"""The one JSON reader for user files (cost files, lowered programs): parse with errors as
one-line diagnostics at the fault, and find where each value is written.

`json` refuses some files with a traceback (a number of thousands of digits, nesting deeper
than the recursion limit), silently keeps the last of two equal keys, and keeps no positions.
`loads` turns the first two into `UsageError`s and refuses the third; `positions` walks the
(valid) text again value by value, `JSONDecoder.raw_decode` giving each value's end, so a
later error can point at the member it is about. The walk runs only when such an error needs
it: a lowered program file can hold hundreds of thousands of values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeir.diagnostics import Source, Span, UsageError

#: A value's place in the document: object keys and array indices from the top.
Path = tuple[str | int, ...]

_SPACE = " \t\r\n"


class _Duplicate(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys differ: `json` keeps the last of two silently."""
    out = dict(pairs)
    if len(out) < len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise _Duplicate(k)
            seen.add(k)
    return out


def loads(src: Source, what: str, key_noun: str = "key") -> Any:
    """The JSON value in `src`. A malformed file is a UsageError "malformed WHAT: ..." at the
    fault; a key given twice in one object is one naming it as `key_noun` ("cost 'F' is
    given twice in one object") at its second occurrence."""
    try:
        return json.loads(src.text, object_pairs_hook=_unique)
    except _Duplicate as e:
        quoted = json.dumps(e.key)  # best effort: the second place it is written as a key
        first = _key_at(src.text, quoted, 0)
        second = _key_at(src.text, quoted, first + 1) if first >= 0 else -1
        at = max(second, 0)
        raise UsageError(f"{key_noun} '{e.key}' is given twice in one object (JSON would keep "
                         "the last without a word)", src.span(at, at + len(quoted))) from None
    except json.JSONDecodeError as e:
        raise UsageError(f"malformed {what}: {e.msg}",
                         Span(src, e.lineno, e.colno, e.lineno, e.colno + 1)) from None
    except RecursionError:
        raise UsageError(f"{src.name}: malformed {what}: nested too deeply") from None
    except ValueError:  # Python refuses to convert integers of more than 4,300 digits
        raise UsageError(f"{src.name}: malformed {what}: a number has too many digits to read "
                         "(thousands)") from None


_WS = re.compile(r"[ \t\n\r]*")


def _skip(text: str, i: int) -> int:
    """The index of the first character at or after `i` that is not JSON whitespace."""
    m = _WS.match(text, i)
    return m.end() if m is not None else i


def loads_streamed(src: Source, member: str, each: Callable[[int, Any], Any]
                   ) -> dict[str, Any] | None:
    """A top-level JSON object read as `loads` reads it, except that the elements of its
    array `member` are passed to `each` (index, value) one at a time as they are read, and
    what `each` returns is kept instead: only one element's JSON values exist at once (a
    lowered.json holds a list per instruction, each program's table a rank's). None for any text
    `loads` might refuse or read otherwise (not an object, a fault, a key given twice): the
    caller then reads it with `loads`, which explains. Exceptions from `each` propagate."""
    text, dec = src.text, json.JSONDecoder(object_pairs_hook=_unique)
    out: dict[str, Any] = {}
    in_each = False
    try:
        i = _skip(text, 0)
        if text[i:i + 1] != "{":
            return None
        i = _skip(text, i + 1)
        closed = text[i:i + 1] == "}"
        i += closed
        while not closed:
            if text[i:i + 1] != '"':
                return None
            key, i = dec.raw_decode(text, i)
            i = _skip(text, i)
            if key in out or text[i:i + 1] != ":":
                return None
            i = _skip(text, i + 1)
            if key == member and text[i:i + 1] == "[":
                items: list[Any] = []
                i = _skip(text, i + 1)
                done = text[i:i + 1] == "]"
                i += done
                while not done:
                    item, i = dec.raw_decode(text, i)
                    in_each = True
                    items.append(each(len(items), item))
                    in_each = False
                    i, done = _next(text, i, "]")
                out[key] = items
            else:
                out[key], i = dec.raw_decode(text, i)
            i, closed = _next(text, i, "}")
        return out if _skip(text, i) == len(text) else None
    except (ValueError, RecursionError):  # (a JSONDecodeError, a key given twice, digits)
        if in_each:
            raise
        return None


def _next(text: str, i: int, close: str) -> tuple[int, bool]:
    """After a member or element ending at `i`: where the next one starts, and whether `close`
    ended its container instead. Anything but a comma or `close` is a ValueError."""
    i = _skip(text, i)
    c = text[i:i + 1]
    if c != "," and c != close:
        raise ValueError(f"expected ',' or '{close}'")
    return _skip(text, i + 1), c == close


def _key_at(text: str, quoted: str, start: int) -> int:
    """Where `quoted` next stands as a key (followed by a colon) from `start`, or -1."""
    i = text.find(quoted, start)
    while i >= 0:
        j = i + len(quoted)
        while j < len(text) and text[j] in _SPACE:
            j += 1
        if j < len(text) and text[j] == ":":
            return i
        i = text.find(quoted, i + 1)
    return -1


@dataclass(frozen=True)
class Place:
    """Where a value of the document is written: `key`, the key of an object member (None
    for an array element), and `whole`, the member (`"key": value`) or the element."""

    key: Span | None
    whole: Span


def positions(src: Source) -> dict[Path, Place]:
    """Every value of `src` (valid JSON, as `loads` accepted it) by its path, with where it is
    written; the top-level value is not included."""
    text, dec = src.text, json.JSONDecoder()
    out: dict[Path, Place] = {}

    def skip(i: int, chars: str = _SPACE) -> int:
        while i < len(text) and text[i] in chars:
            i += 1
        return i

    def value(i: int, path: Path) -> int:
        """Walk the value at `i` (recording its members' places); the index past it."""
        if text[i] == "{":
            i = skip(i + 1)
            while i < len(text) and text[i] == '"':
                key, after = dec.raw_decode(text, i)
                start = skip(skip(skip(after), ":"))
                end = value(start, (*path, key))
                out[(*path, key)] = Place(src.span(i, after), src.span(i, end))
                i = skip(end, _SPACE + ",")
            return i + 1
        if text[i] == "[":
            i, k = skip(i + 1), 0
            while i < len(text) and text[i] != "]":
                end = value(i, (*path, k))
                out[(*path, k)] = Place(None, src.span(i, end))
                i, k = skip(end, _SPACE + ","), k + 1
            return i + 1
        return int(dec.raw_decode(text, i)[1])

    top = skip(0)
    if top < len(text):
        value(top, ())
    return out
