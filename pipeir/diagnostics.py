"""Diagnostics: user-facing errors with source spans, rendered like a compiler's.

Every error a user can cause ends up as a `Diagnostic`; the CLI renders it as
``file:line:col: error: message``, the source line and carets under the span, then notes.
Library code raises `PipeirError`; nothing user-facing is ever a bare traceback.
"""

from __future__ import annotations

import bisect
import contextlib
import difflib
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

Severity = Literal["error", "warning", "note"]

#: Exit codes shared by every command.
EXIT_OK = 0
EXIT_INVALID = 1  # the input is well-formed but the schedule is wrong (verification)
EXIT_USAGE = 2  # syntax, name, type or command-line errors
INTERRUPTED = "pipeirc: interrupted"  # the one line a Ctrl-C prints


#: The files (device, inode) `read_bytes` has read inside `reading()`: a command's inputs,
#: which `pipeir.files` refuses to write over (`pipeirc print a.sched -o a.sched` would
#: replace a hand-written source with its flat canonical form). None outside a command: a
#: Python caller may well load a file and save it back.
_inputs: set[tuple[int, int]] | None = None


@contextlib.contextmanager
def reading() -> Iterator[None]:
    """Within this, every file `read_bytes` reads counts as an input (`is_input`)."""
    global _inputs
    outer, _inputs = _inputs, set()
    try:
        yield
    finally:
        _inputs = outer


def mark_input(path: Path) -> None:
    """Count `path` as an input inside `reading()`: for files read other than by `read_bytes`
    (a model or pass plugin imported by path)."""
    if _inputs is not None:
        try:
            st = os.stat(path)
        except OSError:
            return
        _inputs.add((st.st_dev, st.st_ino))


def read_inputs() -> frozenset[tuple[int, int]]:
    """The files read as inputs so far inside `reading()` (none outside it), to carry them
    back from a process that read them for this one (`pipeir.runtime.forked`)."""
    return frozenset(_inputs or ())


def add_inputs(files: Iterable[tuple[int, int]]) -> None:
    """Count files another process read (`read_inputs` there) as inputs inside `reading()`."""
    if _inputs is not None:
        _inputs.update(files)


def is_input(st: os.stat_result) -> bool:
    """Whether the file with status `st` was read as an input inside `reading()`."""
    return _inputs is not None and (st.st_dev, st.st_ino) in _inputs


def read_bytes(p: Path, kind: str, most: int | None) -> bytes:
    """The bytes of `p` (at most `most` + 1 of them when `most` is given); errors as
    UsageErrors."""
    try:
        with p.open("rb") as f:
            if _inputs is not None:
                st = os.fstat(f.fileno())
                _inputs.add((st.st_dev, st.st_ino))
            return f.read() if most is None else f.read(most + 1)
    except FileNotFoundError:
        raise UsageError(f"{p}: no such {kind}") from None
    except IsADirectoryError:
        raise UsageError(f"{p}: is a directory, not a {kind}") from None
    except OSError as e:
        raise UsageError(f"{p}: cannot read: {e.strerror}") from None


#: a carriage return that does not start a "\r\n"
_LONE_CR = re.compile(r"\r(?!\n)")


@dataclass(frozen=True)
class Source:
    """A piece of source text and the name it is reported under."""

    name: str
    text: str

    def __post_init__(self) -> None:
        # NOTE: Lark, json and tomllib end a line at "\n" only, and every error of a file
        # with old Mac line endings (a lone "\r") was on its line 1. A lone "\r" ends a line
        # in every editor, so it is read as "\n": one character for one, so the offsets a
        # reader finds stay where they were ("\r\n" stays as it is).
        if isinstance(self.text, str) and "\r" in self.text:
            object.__setattr__(self, "text", _LONE_CR.sub("\n", self.text))

    @classmethod
    def read(cls, path: str | os.PathLike[str], kind: str = ".sched file") -> Source:
        """Read a user's text file (`kind` names it in messages): a missing, unreadable,
        binary or non-UTF-8 file is a UsageError, never a traceback. A UTF-8 byte-order mark
        is dropped."""
        return cls.decode(path, read_bytes(Path(path), kind, None), kind)

    @classmethod
    def decode(cls, path: str | os.PathLike[str], data: bytes, kind: str = ".sched file"
               ) -> Source:
        """The text of `data`, read from `path`: binary or non-UTF-8 data is a UsageError."""
        p = Path(path)
        try:
            text = data.decode("utf-8-sig")
        except UnicodeDecodeError as e:
            raise UsageError(f"{p}: not UTF-8 text (bad byte at offset {e.start}); "
                             f"expected a {kind}") from None
        if "\x00" in text:
            raise UsageError(f"{p}: binary file (contains NUL bytes), not a {kind}")
        return cls(str(path), text)

    def line(self, lineno: int) -> str:
        # NOTE: lines end at "\n" only, as Lark, json and tomllib count them for spans;
        # str.splitlines also breaks at "\r", "\x0c", "\u2028", ... and would show the
        # wrong line under a diagnostic for text that holds one of those.
        starts = self._starts
        if not 0 < lineno <= len(starts):
            return ""
        end = starts[lineno] - 1 if lineno < len(starts) else len(self.text)
        return self.text[starts[lineno - 1]:end]

    def span(self, start: int, end: int) -> Span:
        """The span of the text from offset `start` to `end` (for readers that find offsets
        themselves: a cost file's key, an instruction of a lowered JSON file)."""
        starts = self._starts
        line, end_line = bisect.bisect_right(starts, start), bisect.bisect_right(starts, end)
        return Span(self, line, start - starts[line - 1] + 1, end_line,
                    end - starts[end_line - 1] + 1)

    @cached_property
    def _starts(self) -> list[int]:
        """Where each line begins: found once, so a file with many diagnostics (or a large
        lowered JSON file) is not rescanned for each."""
        return [0, *(m.end() for m in re.finditer("\n", self.text))]


@dataclass(frozen=True)
class Span:
    """A 1-based, end-exclusive region of a source; `end_col` may be on a later line."""

    source: Source = field(compare=False, repr=False)
    line: int
    col: int
    end_line: int
    end_col: int

    @property
    def file(self) -> str:
        return self.source.name

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Note:
    message: str
    span: Span | None = None


@dataclass(frozen=True)
class Diagnostic:
    message: str
    span: Span | None = None
    notes: tuple[Note, ...] = ()
    severity: Severity = "error"

    def render(self) -> str:
        return "\n".join(_render_one(self.severity, self.message, self.span, fallback=None)
                         + [line for n in self.notes
                            for line in _render_one("note", n.message, n.span,
                                                    fallback=self.span)])


#: Source lines longer than this are shown as a window of this many columns around the span.
SHOWN_COLUMNS = 200


def _render_one(severity: str, message: str, span: Span | None,
                fallback: Span | None) -> list[str]:
    if span is None:
        where = f"{fallback.file}: " if fallback is not None and severity != "note" else ""
        return [f"{where}{severity}: {message}"]
    out = [f"{span}: {severity}: {message}"]
    text = span.source.line(span.line)
    if text:
        same_line = span.end_line == span.line
        col = span.col - 1
        width = (span.end_col - span.col) if same_line else len(text) - col
        # (before stripping: a line of only a tab and a control character such as \x1f,
        # which `rstrip` takes for space, keeps its tab above the carets)
        head = text[:col]
        text = text.rstrip()
        if len(text) > SHOWN_COLUMNS:  # a window around the span (a 16,000-digit number...)
            start = max(0, min(col - 20, len(text) - SHOWN_COLUMNS))
            pre = "..." if start else ""
            post = "..." if start + SHOWN_COLUMNS < len(text) else ""
            shown = text[start:start + SHOWN_COLUMNS]
            width = min(width, len(shown) - (col - start))
            text, col = pre + shown + post, len(pre) + col - start
            head = text[:col]
        out.append("    " + text)
        # tabs under tabs: the carets line up whatever width the terminal gives a tab
        pad = "".join("\t" if c == "\t" else " " for c in head).ljust(col)
        out.append("    " + pad + "^" * max(1, width))
    return out


class PipeirError(Exception):
    """An error caused by the user's input; carries one or more diagnostics and an exit code."""

    def __init__(self, diagnostics: Diagnostic | Sequence[Diagnostic], exit_code: int = EXIT_USAGE):
        if isinstance(diagnostics, Diagnostic):
            diagnostics = [diagnostics]
        self.diagnostics: tuple[Diagnostic, ...] = tuple(diagnostics)
        self.exit_code = exit_code
        super().__init__(self.render())

    def annotate(self, note: Note) -> None:
        """Add `note` to the first diagnostic: context met on the way out, such as the call an
        error inside a macro's body came from."""
        d = self.diagnostics[0]
        self.diagnostics = (replace(d, notes=(*d.notes, note)), *self.diagnostics[1:])
        self.args = (self.render(),)

    def render(self) -> str:
        return "\n".join(d.render() for d in self.diagnostics)

    @property
    def message(self) -> str:
        return self.diagnostics[0].message

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its class and attributes (its `__init__` takes other arguments than
        `args`), so an error raised in another process arrives as itself
        (`pipeir.runtime.forked`)."""
        return _restore, (type(self), dict(self.__dict__))


def _restore(cls: type[PipeirError], state: dict[str, Any]) -> PipeirError:
    e = cls.__new__(cls)
    e.__dict__.update(state)
    e.args = (e.render(),)
    return e


class UsageError(PipeirError):
    """Syntax, name, type and command-line errors: exit code 2."""

    def __init__(self, message: str, span: Span | None = None, notes: Iterable[Note] = ()):
        super().__init__(Diagnostic(message, span, tuple(notes)), EXIT_USAGE)


class VerifyError(PipeirError):
    """A well-formed schedule that is wrong (incomplete, misplaced, deadlocking, over memory)."""

    def __init__(self, diagnostics: Diagnostic | Sequence[Diagnostic], check: str):
        self.check = check
        super().__init__(diagnostics, 1)


def did_you_mean(name: str, candidates: Iterable[str]) -> tuple[Note, ...]:
    """A "did you mean" note for the closest candidate, if any is close."""
    close = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return (Note(f"did you mean '{close[0]}'?"),) if close else ()


def where_prefix(where: str | None, span: Span | None) -> str:
    """A file-name prefix (`where: `) for messages that have no span to carry the location."""
    return f"{where}: " if where is not None and span is None else ""
