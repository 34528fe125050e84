"""A one-line progress display for long commands (`tune`, `compile`, `profile`).

The work reports what it is doing through a plain callback (`Callable[[str], None]`, e.g.
"candidate 12/96: 1f1b v=1 m=8"), so library code knows nothing of terminals; `Progress`
draws it on stderr, only when stderr is a terminal, clipped to the terminal's width, with the
elapsed time, and erased when the command ends: pipes, files and tests see nothing. Callers
report per unit of real work (a candidate, a stage, a phase), never in a tight loop, so every
report is drawn: a dropped one would leave a stale line up for the whole next phase.
"""

from __future__ import annotations

import shutil
import sys
import time
from types import TracebackType
from typing import TextIO


class Progress:
    """`with Progress("tune") as show: ... show("candidate 3/96")`."""

    def __init__(self, command: str, stream: TextIO | None = None,
                 enabled: bool | None = None):
        self.command = command
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _is_tty(self.stream) if enabled is None else enabled
        self._start = time.monotonic()
        self._shown = False

    def __call__(self, text: str) -> None:
        """Show `text` in place of the line shown before."""
        if not self.enabled:
            return
        line = f"{self.command}: {text}  [{time.monotonic() - self._start:.0f} s]"
        width = max(10, shutil.get_terminal_size().columns - 1)
        self.stream.write("\r" + line[:width] + "\x1b[K")
        self.stream.flush()
        self._shown = True

    def close(self) -> None:
        """Erase the line, so what the command prints next starts clean."""
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False
