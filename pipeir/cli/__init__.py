"""`pipeirc`: the pipeir command line. One module per command in this package; a command
module has NAME, HELP, ORDER (its place in `--help`), `add_arguments(parser)` and
`run(args) -> exit code`. Modules without NAME (like `common`) are helpers."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

from pipeir.diagnostics import EXIT_USAGE, PipeirError


def _modules() -> list[ModuleType]:
    mods = [importlib.import_module(f"{__name__}.{info.name}")
            for info in pkgutil.iter_modules(__path__)]
    return sorted((m for m in mods if hasattr(m, "NAME")), key=lambda m: (m.ORDER, m.NAME))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeirc", description="pipeir: a compiler for pipeline-parallel schedules.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in _modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pipeirc`; returns the exit code (0 ok, 1 invalid schedule, 2 usage error)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse prints its own usage message
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_USAGE
    try:
        return int(args._run(args))
    except PipeirError as e:
        print(e.render(), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("pipeirc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
