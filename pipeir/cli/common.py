"""What every `pipeirc` command shares: how a schedule is named on the command line, how
files are written (atomically: nothing half-written on disk), and how errors print."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeir.api import load
from pipeir.diagnostics import UsageError
from pipeir.frontend.elaborate import Elaborated, Value, parse_override


def add_schedule_args(p: argparse.ArgumentParser, *, many: bool = False) -> None:
    """FILE (or FILE... when `many`), or a library schedule by name, plus --set."""
    p.add_argument("files", nargs="*" if many else "?", metavar="FILE",
                   help="a .sched file" + ("s" if many else ""))
    lib = p.add_argument_group("library schedule (instead of FILE)")
    lib.add_argument("--schedule", metavar="NAME", help="library schedule, e.g. 1f1b")
    lib.add_argument("--ranks", type=int, metavar="P")
    lib.add_argument("--microbatches", type=int, metavar="M")
    lib.add_argument("--v", type=int, metavar="V", help="chunks per rank (interleaved)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   dest="overrides", help="override a pipeline setting or schedule parameter")


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _overrides(args: argparse.Namespace) -> dict[str, Value]:
    out: dict[str, Value] = {}
    for text in args.overrides:
        k, v = parse_override(text)
        out[k] = v
    return out


def load_schedules(args: argparse.Namespace) -> list[Elaborated]:
    """Every schedule the command line names, elaborated (files first, in order)."""
    files = args.files if isinstance(args.files, list) else [args.files] if args.files else []
    overrides = _overrides(args)
    if args.schedule is not None:
        if files:
            raise UsageError("give either FILE or --schedule, not both")
        if args.ranks is None or args.microbatches is None:
            raise UsageError("--schedule needs --ranks P and --microbatches M")
        from pipeir import library

        name = library.canonical_name(args.schedule)
        if name is None:
            raise library.unknown_schedule(args.schedule)
        kw: dict[str, Value] = {}
        if args.v is not None:
            if "v" not in library.params(name):
                raise UsageError(f"--v: library schedule '{name}' has no chunks parameter v")
            kw["v"] = args.v
        for flag in ("ranks", "microbatches", "v"):
            if flag in overrides and getattr(args, flag) is not None:
                raise UsageError(f"--set {flag}=... and --{flag} disagree about who decides; "
                                 "give one of them")
        overrides.update(ranks=args.ranks, microbatches=args.microbatches)
        from pipeir.frontend.elaborate import elaborate

        module, sdef = library.resolve(name)  # type: ignore[misc]
        return [elaborate(module, overrides=overrides, use=(sdef.name, kw))]
    if not files:
        raise UsageError("no schedule given: pass a .sched FILE, or --schedule NAME "
                         "--ranks P --microbatches M")
    for flag in ("ranks", "microbatches", "v"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} goes with --schedule; with a FILE, use --set {flag}=N")
    return [load(Path(f), overrides=overrides) for f in files]


def load_one(args: argparse.Namespace) -> Elaborated:
    return load_schedules(args)[0]
