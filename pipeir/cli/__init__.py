"""`pipeirc`: the pipeir command line. One module per command in this package; a command
module has NAME, HELP, ORDER (its place in `--help`), `add_arguments(parser)` and
`run(args) -> exit code`. Modules without NAME (like `common`) are helpers."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import pkgutil
import re
import sys
import traceback
from collections.abc import Sequence
from types import ModuleType
from typing import Any, NoReturn

from pipeir.diagnostics import EXIT_USAGE, INTERRUPTED, PipeirError, reading
from pipeir.runtime import forkserver
from pipeir.usercode import EXIT_INTERRUPT, EXIT_USER, UserCodeError, explain, raised_at


def _modules() -> list[ModuleType]:
    mods = [importlib.import_module(f"{__name__}.{info.name}")
            for info in pkgutil.iter_modules(__path__)]
    return sorted((m for m in mods if hasattr(m, "NAME")), key=lambda m: (m.ORDER, m.NAME))


class _Once(argparse._StoreAction):
    """An option that takes one value refuses a second: argparse kept the last without a
    word (`--passes 'interleave{v=2}' --passes split-backward` dropped the interleave).
    Options meant to repeat (`--set`, `--pass-plugin`, `--print-after`) append."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        given = namespace.__dict__.setdefault(_GIVEN, set())
        if option_string is not None and self.dest in given:
            raise argparse.ArgumentError(self, "given twice; give it once")
        given.add(self.dest)
        super().__call__(parser, namespace, values, option_string)


#: where a parse's namespace records the options `_Once` has seen (removed by the parse)
_GIVEN = "_pipeir_given"


class _Parser(argparse.ArgumentParser):
    """argparse with pipeirc's error shape: one `error:` line and a note, not the usage
    block first (subcommand parsers are made of this class too)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register("action", None, _Once)
        self.register("action", "store", _Once)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.__dict__.pop(_GIVEN, None)  # (a subcommand's before it is copied up)
        return parsed, rest

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"error: {message}\nnote: see `{self.prog} --help`\n")


def build_parser() -> argparse.ArgumentParser:
    from pipeir import __version__

    parser = _Parser(
        prog="pipeirc", description="pipeir: a compiler for pipeline-parallel schedules.")
    parser.add_argument("--version", action="version", version=f"pipeirc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for mod in _modules():
        p = sub.add_parser(mod.NAME, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(p)
        p.add_argument("--traceback", action="store_true",
                       help="when user code (a model, a pass plugin) fails, also print its "
                            "full Python traceback")
        p.set_defaults(_run=mod.run)
    return parser


#: A value that argparse would take for an option: `-1,0`, `-1e3`, `-nan` (it only knows
#: plain negative numbers), so `--lengths -1,0` said "expected one argument".
_NEGATIVE = re.compile(r"-(\d|\.\d|nan\b|inf\b)", re.IGNORECASE)


def _attach_negative_values(parser: argparse.ArgumentParser,
                            argv: Sequence[str]) -> list[str]:
    """`--opt -1,0` -> `--opt=-1,0` for options that take one value, so the option's own
    check gives the message (no pipeirc option is spelt like a negative number)."""
    takes_value = {s for a in _all_actions(parser) if a.nargs is None and a.option_strings
                   for s in a.option_strings}
    out: list[str] = []
    for tok in argv:
        if out and out[-1] in takes_value and _NEGATIVE.match(tok):
            out[-1] = f"{out[-1]}={tok}"
        else:
            out.append(tok)
    return out


def _all_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    out = list(parser._actions)
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for p in a.choices.values():
                out.extend(_all_actions(p))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """Run `pipeirc`; returns the exit code (0 ok, 1 invalid schedule, 2 usage error)."""
    argv = sys.argv[1:] if argv is None else argv
    # NOTE (start-up): `pipeirc run` starts its ranks' fork server first of all, before this
    # process imports the commands and the compiler, so that the fork server's imports (torch:
    # the longest part of the time to the first step) begin a second or two earlier
    if list(argv[:1]) == ["run"] and not forkserver.under_torchrun():
        forkserver.prestart()
    parser = build_parser()
    argv = _attach_negative_values(parser, argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse prints its own usage message
        return int(e.code or 0) if isinstance(e.code, int) else EXIT_USAGE
    try:
        with reading():  # what the command reads, it must not write over (`pipeir.files`)
            code = int(args._run(args))
        sys.stdout.flush()  # a full disk under `> FILE` fails here, inside the handlers
        return code
    except UserCodeError as e:
        print(e.render(), file=sys.stderr)
        if args.traceback:
            print(e.format_cause(), end="", file=sys.stderr)
        return e.exit_code
    except PipeirError as e:
        print(e.render(), file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return EXIT_INTERRUPT
    except SystemExit as e:  # user code pipeir called where it did not expect it to exit
        print(f"error: {explain(e)} at {raised_at(e)}: user code tried to end pipeirc",
              file=sys.stderr)
        if args.traceback:
            traceback.print_exception(e, file=sys.stderr)
        return EXIT_USER
    except BrokenPipeError:
        _drop_stdout()
        return 0
    except OSError as e:
        if e.filename is not None or e.errno not in _OUTPUT_ERRNOS:
            raise
        print(f"pipeirc: cannot write the output: {os.strerror(e.errno)}", file=sys.stderr)
        _drop_stdout()
        return 1


#: Errors of writing standard output to a file (`> /dev/full`, a full disk or quota); the
#: files pipeir writes itself report theirs as usage errors (`pipeir.files`).
_OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def _drop_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's flush at exit does not fail again."""
    # no file descriptor: an in-process caller's stream (io.UnsupportedOperation)
    with contextlib.suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
