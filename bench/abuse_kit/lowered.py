"""The surfaces merged with the compact lowered form and partial memory release: a compiled
directory's lowered.json edited by hand (each fault one `l.json:line:col: error:` from
`check --lowered`), the memory flags in counts and bytes, cost files with memory_w_bytes,
`compile -o` onto a file, and `plan --synth-time`."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from abuse_kit.harness import OK, SCHED, Case, make_file

_LOWERED: list[str] = []
LIB = ["--schedule", "1f1b", "--ranks", "2", "--microbatches", "2"]


def _compiled() -> str:
    """lowered.json of 1F1B on 2 ranks, made once by `pipeirc compile` itself (blocking: the
    edits below name its plain sends)."""
    if not _LOWERED:
        r = subprocess.run([sys.executable, "-m", "pipeir", "compile", *LIB, "--blocking",
                            "--emit", "json"],
                           capture_output=True, text=True, timeout=60, check=True)
        _LOWERED.append(r.stdout)
    return _LOWERED[0]


def _edited(edit: Callable[[str], str]) -> Callable[[Path], None]:
    """Writes l.json: the compiled lowered.json after `edit` of its text."""
    return lambda d: (d / "l.json").write_text(edit(_compiled()), encoding="utf-8")


def _at_line(_: Path, out: str, err: str) -> tuple[str, str] | None:
    """A hand-edited lowered.json's error points at a line and column of it."""
    first = err.splitlines()[0] if err else ""
    if not first.startswith("l.json:") or ":" not in first[len("l.json:"):]:
        return ("unclear", f"no l.json:line:col: position: {first[:120]!r}")
    return None


def _drop_first(mnemonic: str) -> Callable[[str], str]:
    def edit(text: str) -> str:
        lines = text.splitlines(keepends=True)
        at = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith(f'["{mnemonic}", '))
        return "".join(lines[:at] + lines[at + 1:])
    return edit


#: rank 0's first send: the activation of stage 0, micro-batch 0, to rank 1 with tag 0 (its
#: row's last columns: tensor, stage, mb, peer, tag)
_SEND = '"act", 0, 0, 1, 0]'

#: (name, edit of the compiled text): each must be refused with a position in the file
EDITS: list[tuple[str, Callable[[str], str]]] = [
    ("a renamed instruction", lambda t: t.replace('["forward", ', '["forwrd", ', 1)),
    ("a dropped send", _drop_first("send")),
    ("a dropped forward", _drop_first("forward")),
    ("a swapped peer", lambda t: t.replace(_SEND, '"act", 0, 0, 0, 0]', 1)),
    ("a wrong tag", lambda t: t.replace(_SEND, '"act", 0, 0, 1, 7]', 1)),
    ("a negative tag", lambda t: t.replace(_SEND, '"act", 0, 0, 1, -7]', 1)),
    ("a NaN micro-batch", lambda t: t.replace(_SEND, '"act", 0, NaN, 1, 0]', 1)),
    ("a row too short", lambda t: t.replace(_SEND, '"act", 0, 0, 1]', 1)),
    ("a value after the last column", lambda t: t.replace(_SEND, '"act", 0, 0, 1, 0, 0]', 1)),
    ("an origin past the table", lambda t: re.sub(r'\["forward", \d+, ', '["forward", 99, ', t,
                                                  count=1)),
    ("a bad line", lambda t: t.replace('["forward", ', '["forward",, ', 1)),
    ("a key given twice", lambda t: t.replace('{"origins": ', '{"table": [], "origins": ', 1)),
    ("an unknown field", lambda t: t.replace('{"origins": ', '{"micro": 1, "origins": ', 1)),
    ("truncated", lambda t: t[:len(t) // 2]),
    ("empty", lambda t: ""),
    ("a header with fewer ranks", lambda t: t.replace('"ranks": 2', '"ranks": 1', 1)),
    ("a format of an earlier pipeir", lambda t: t.replace('"version": 2', '"version": 1', 1)),
]


def hand_cases() -> list[Case]:
    q = True
    cases = [Case(f"check --lowered: {name}", ["check", "--lowered", "l.json"],
                  setup=_edited(edit), check=_at_line, quick=q)
             for name, edit in EDITS]
    cases += [
        Case("check --lowered with a BOM", ["check", "--lowered", "l.json"], OK,
             setup=_edited(lambda t: "\ufeff" + t)),
        Case("check --memory-limit 8GB without memory_bytes",
             ["check", SCHED, "--memory-limit", "8GB"], quick=q),
        Case("check --memory-limit 0GB", ["check", SCHED, "--memory-limit", "0GB"]),
        Case("check --memory-limit 1e400", ["check", SCHED, "--memory-limit", "1e400"]),
        Case("check --memory-limit 8XB", ["check", SCHED, "--memory-limit", "8XB"]),
        Case("check --memory-limit 3.5 (1F1B holds 4)",
             ["check", SCHED, "--memory-limit", "3.5"], quick=q),
        Case("memory_w_bytes over memory_bytes", ["check", SCHED, "--costs", "c.toml"],
             setup=make_file("c.toml", "memory_bytes = 100\nmemory_w_bytes = 200\n"),
             quick=q),
        Case("memory_w_bytes without memory_bytes", ["check", SCHED, "--costs", "c.toml"],
             setup=make_file("c.toml", "memory_w_bytes = 50\n")),
        Case("memory_w_bytes nan", ["check", SCHED, "--costs", "c.toml"],
             setup=make_file("c.toml", "memory_bytes = 100\nmemory_w_bytes = nan\n")),
        Case("cost file version 3", ["check", SCHED, "--costs", "c.toml"],
             setup=make_file("c.toml", "version = 3\nmemory_bytes = 100\n")),
        Case("compile -o onto a file", ["compile", *LIB, "-o", "f"], setup=make_file("f"),
             quick=q),
        Case("plan --synth-time nan", ["plan", "--model", "transformer", "--ranks", "2",
                                       "--synth-time", "nan"]),
        Case("plan --synth-time -1", ["plan", "--model", "transformer", "--ranks", "2",
                                      "--synth-time", "-1"]),
    ]
    return cases
