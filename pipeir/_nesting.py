"""Deeply nested input (a 2,000-term sum, 300 nested ifs) must be a diagnostic, not a
RecursionError: parsing, compiling and evaluating recurse once or twice per nesting level."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from pipeir.diagnostics import UsageError

RECURSION_LIMIT = 8000  # Python frames while elaborating; ~2,000 nesting levels


@contextmanager
def nesting_guard(what: str) -> Iterator[None]:
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, RECURSION_LIMIT))
    try:
        yield
    except RecursionError:
        raise UsageError(f"{what} nests too deeply (expressions or blocks thousands of levels "
                         "deep); split it up with 'let' or 'def'") from None
    finally:
        sys.setrecursionlimit(old)
