"""Where each instruction of a lowered JSON file is, so a finding can point at its line.

`json` keeps no positions, so the file (already parsed once by `lower.from_json`, hence
valid) is walked again value by value: `JSONDecoder.raw_decode` gives each value's end, and
an instruction's span is its top-level `"i"` member (its mnemonic), the line a reader of the
file looks for. The walk runs only when there is a finding to place.
"""

from __future__ import annotations

import json

from pipeir.diagnostics import Source, Span

_SPACE = " \t\r\n"


def instruction_spans(source: Source) -> dict[tuple[int, int], Span]:
    """(rank, position) -> the span of that instruction's `"i": ...` member (the whole
    instruction where it has none) in `source`, a valid lowered JSON file."""
    text, dec = source.text, json.JSONDecoder()
    out: dict[tuple[int, int], Span] = {}

    def skip(i: int, chars: str = _SPACE) -> int:
        while i < len(text) and text[i] in chars:
            i += 1
        return i

    def members(i: int) -> list[tuple[object, int, int]]:
        """The (key, key start, value end) of the object at `i`, in file order."""
        out_: list[tuple[object, int, int]] = []
        i = skip(i + 1)
        while i < len(text) and text[i] == '"':
            key, after = dec.raw_decode(text, i)
            _, end = dec.raw_decode(text, skip(skip(skip(after), ":")))
            out_.append((key, i, end))
            i = skip(end, _SPACE + ",")
        return out_

    top = skip(0)
    if not text.startswith("{", top):
        return out
    programs = [m for m in members(top) if m[0] == "programs"]
    if not programs:
        return out
    _, key_at, _ = programs[-1]  # (json keeps the last of duplicated keys)
    i = skip(skip(skip(dec.raw_decode(text, key_at)[1]), ":"))
    i = skip(i + 1)  # into the array of programs
    rank = 0
    while i < len(text) and text[i] == "[":
        i, pc = skip(i + 1), 0
        while i < len(text) and text[i] == "{":
            end = dec.raw_decode(text, i)[1]
            mnemonic = [m for m in members(i) if m[0] == "i"]
            _, at, stop = mnemonic[-1] if mnemonic else (None, i, end)
            out[rank, pc] = source.span(at, stop)
            i, pc = skip(end, _SPACE + ","), pc + 1
        i, rank = skip(i + 1, _SPACE + ","), rank + 1  # past the program's "]"
    return out
