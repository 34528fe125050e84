"""What every `pipeirc` command shares: how a schedule is named on the command line (FILE,
or `--schedule NAME` from the library) and how `--set name=value` is read."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeir import library
from pipeir.api import load
from pipeir.diagnostics import UsageError
from pipeir.frontend.elaborate import Elaborated, Value


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


def parse_override(text: str) -> tuple[str, Value]:
    """`--set name=value`: value is an integer, a number, a name (loop, vshape) or a list."""
    if "=" not in text:
        raise UsageError(f"--set {text}: expected NAME=VALUE")
    name, raw = (x.strip() for x in text.split("=", 1))
    return name, _literal(raw, f"--set {text}")


def _literal(raw: str, where: str) -> Value:
    if raw in ("true", "false"):
        return raw == "true"
    if raw.startswith("[") and raw.endswith("]"):
        inner = raw[1:-1].strip()
        return tuple(_literal(x.strip(), where) for x in inner.split(",")) if inner else ()
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    if raw.isidentifier():
        return raw
    raise UsageError(f"{where}: cannot read '{raw}' (expected an integer, a number, a name "
                     "or a list [a, b, ...])")


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
        found = library.require(args.schedule)
        kw: dict[str, Value] = {}
        if args.v is not None:
            if "v" not in found.params:
                raise UsageError(f"--v: library schedule '{found.name}' has no chunks parameter v")
            kw["v"] = args.v
        for flag in ("ranks", "microbatches", "v"):
            if flag in overrides and getattr(args, flag) is not None:
                raise UsageError(f"--set {flag}=... and --{flag} disagree about who decides; "
                                 "give one of them")
        overrides.update(ranks=args.ranks, microbatches=args.microbatches)
        return [library.instantiate(found, overrides, kw)]
    if not files:
        raise UsageError("no schedule given: pass a .sched FILE, or --schedule NAME "
                         "--ranks P --microbatches M")
    for flag in ("ranks", "microbatches", "v"):
        if getattr(args, flag) is not None:
            raise UsageError(f"--{flag} goes with --schedule; with a FILE, use --set {flag}=N")
    return [load(Path(f), overrides=overrides) for f in files]


def load_one(args: argparse.Namespace) -> Elaborated:
    return load_schedules(args)[0]
