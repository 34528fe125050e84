"""The front door: read `.sched` files or text into schedules."""

from __future__ import annotations

import os
from collections.abc import Mapping

from pipeir.diagnostics import Source
from pipeir.frontend.elaborate import Elaborated, Value, elaborate
from pipeir.frontend.parser import parse_source
from pipeir.schedule import Schedule


def read_source(path: str | os.PathLike[str]) -> Source:
    """Read a `.sched` file; unreadable or non-UTF-8 files are usage errors, not tracebacks."""
    return Source.read(path, ".sched file")


def _source(src: str | os.PathLike[str]) -> Source:
    if isinstance(src, os.PathLike):
        return read_source(src)
    if "\n" not in src and "{" not in src and (src.endswith(".sched") or os.path.exists(src)):
        return read_source(src)
    return Source("<string>", src)


def load(src: str | os.PathLike[str], *, overrides: Mapping[str, Value] | None = None,
         use: tuple[str, Mapping[str, Value]] | None = None) -> Elaborated:
    """Parse and elaborate a `.sched` file (a path) or text; keeps the file's cost settings."""
    return elaborate(parse_source(_source(src)), overrides=overrides, use=use)


def parse(src: str | os.PathLike[str], *, overrides: Mapping[str, Value] | None = None
          ) -> Schedule:
    """Read a schedule from a `.sched` file path or from `.sched` text.

    `overrides` replace pipeline settings or schedule parameters, like `--set` on the CLI.
    """
    return load(src, overrides=overrides).schedule
