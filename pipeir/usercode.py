"""Running code pipeir does not own: a model file or `--model` spec, a pass plugin, a batch
function. Whatever it raises (an exception, `sys.exit`, Ctrl-C) becomes one `UserCodeError`
naming the user's file, the line of the raise and the exception, exit 1 (130 for an interrupt);
`pipeirc ... --traceback` prints the whole trace (`UserCodeError.format_cause`).

NOTE (stdout): while user code runs, its output goes to stderr, so a plugin that prints cannot
corrupt a schedule that `pipeirc opt` writes to stdout: Python-level writes (`sys.stdout`) and
writes to file descriptor 1 itself (`os.write(1, ...)`, a C extension's unbuffered output)
alike (`stdout_to_stderr`). A rank runs the model outside any `contained`, so it sends both to
stderr for good and writes its own report (a torchrun rank's step lines) to a copy of the
stdout it had (`stdout_for_good`). Output a C library buffers
in its own `stdout` is written when that library flushes, which pipeir cannot time.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import sysconfig
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, TextIO

from pipeir.diagnostics import Diagnostic, Note, PipeirError, UsageError

#: The exit code of an interrupt (128 + SIGINT), as a shell reports it.
EXIT_INTERRUPT = 130
#: The exit code of user code that failed.
EXIT_USER = 1

_PIPEIR = str(Path(__file__).resolve().parent)
_LIBRARY = tuple(p for p in {sysconfig.get_paths().get(k) for k in ("stdlib", "purelib",
                                                                      "platlib")} if p)


class UserCodeError(PipeirError):
    """User code raised `cause` (exit 1, or 130 for KeyboardInterrupt)."""

    def __init__(self, message: str, cause: BaseException):
        code = EXIT_INTERRUPT if isinstance(cause, KeyboardInterrupt) else EXIT_USER
        super().__init__(Diagnostic(message), exit_code=code)
        #: None once pickled (the user's exception class may not exist where it arrives)
        self.cause: BaseException | None = cause
        self._trace: str | None = None

    def format_cause(self) -> str:
        """The user's exception with its full Python traceback (`--traceback`)."""
        if self.cause is not None:
            return "".join(traceback.format_exception(self.cause))
        return self._trace or ""

    def __reduce__(self) -> tuple[Any, ...]:
        """The cause travels as its formatted traceback (see `PipeirError.__reduce__`)."""
        name, (cls, state) = super().__reduce__()
        return name, (cls, {**state, "cause": None, "_trace": self.format_cause()})


def raised_at(e: BaseException) -> str:
    """`file:line` where `e` was raised in the user's code: the innermost frame outside pipeir
    and the Python installation (a model's line, not torch's), else the innermost frame."""
    if isinstance(e, SyntaxError) and e.filename:
        return f"{e.filename}:{e.lineno}"
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if not f.filename.startswith((_PIPEIR, *_LIBRARY))
            and not f.filename.startswith("<frozen")]
    pick = (mine or frames)[-1:] if frames else []
    return f"{pick[0].filename}:{pick[0].lineno}" if pick else "?"


def explain(e: BaseException) -> str:
    """`SystemExit(3)`, `ValueError: bad width`, `KeyboardInterrupt` for messages."""
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r})" if e.code is not None else "SystemExit"
    try:
        text = str(e).strip().splitlines()
    except Exception:  # an exception whose __str__ raises: its class still says something
        text = ["(its message could not be printed)"]
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


@contextlib.contextmanager
def contained(label: str, doing: str) -> Iterator[None]:
    """Run user code inside: `label` names what the user gave (`--model 'm.py'`), `doing`
    what pipeir was doing with it (`importing m.py`, `calling spec()`). A PipeirError passes
    through (the user code called pipeir, which explained itself)."""
    try:
        with stdout_to_stderr():
            yield
    except PipeirError:
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as e:
        raise UserCodeError(f"{label}: {explain(e)} at {raised_at(e)} while {doing}",
                            e) from None


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Inside: `sys.stdout` is `sys.stderr` and file descriptor 1 is a copy of descriptor 2
    (see the module NOTE); both are restored after."""
    sys.stdout.flush()
    try:
        saved: int | None = os.dup(1)
    except OSError:  # no descriptor 1 (a closed stdout): nothing to protect
        saved = None
    if saved is not None:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def stdout_for_good() -> TextIO:
    """From now on this process's `sys.stdout` and descriptor 1 are stderr (see the module
    NOTE); returns a line-buffered stream onto the stdout it had, for pipeir's report."""
    sys.stdout.flush()
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return report


def import_module(name: str, label: str, notes: Iterable[Note] = ()) -> ModuleType:
    """Import the dotted module `name` a user named: a module that does not exist is a
    UsageError ("cannot import", with `notes`); one that raises while importing is
    contained."""
    with contained(label, f"importing {name}"):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise  # the module exists and imports something missing: its own error
            raise UsageError(f"{label}: cannot import {name}: {e}", notes=notes) from None
